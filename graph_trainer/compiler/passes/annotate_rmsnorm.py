"""Tag every RMSNorm (forward and backward) for regional Inductor compilation.

Eager RMSNorm is memory bound: the fused CUDA kernel reads the input several
times and the decomposed form launches one kernel per op. Compiling each norm with
Inductor gives one fused kernel per norm (forward) and one or two per norm
backward. This changes numerics slightly (different reduction order / fp32
intermediates), hence the pipeline runs it only with ``--compile.numerics_changing_optim``
(and regional Inductor).

Matches
=======

1. **Fused** (CUDA traces): every ``aten._fused_rms_norm.default`` node
   (returns ``(out, rstd)``) and every ``aten._fused_rms_norm_backward.default``
   node (returns ``(grad_input, grad_weight)``), plus their ``operator.getitem``
   users. Each such node is one norm instance. Nothing else is tagged for it
   (dtype casts / views around it stay eager).

2. **Decomposed** (CPU traces, or any trace where ``F.rms_norm`` was decomposed
   into ``pow -> mean -> add(eps) -> rsqrt -> mul -> mul(weight)`` and a
   decomposed backward), recognised through the node metadata written by the
   tracer: nodes are grouped by ``(custom["module_fqn"], custom["phase"])``.
   A module qualifies as a norm when

   * its last FQN component ends with ``"norm"`` (``attention_norm``,
     ``ffn_norm``, ``norm``, ``q_norm``...) **or** its forward nodes contain the
     RMS pattern ``rsqrt([add(] mean(pow(x, 2) | mul(x, x)) [, eps)])`` (dtype
     casts / views allowed between the steps), and
   * its forward nodes contain no "heavy" op (matmul / convolution / attention /
     embedding / higher-order op / collective) -- so a mis-named container
     module is never swallowed, and
   * it contains no fused RMSNorm node (those are handled by form 1).

   For a qualifying module, its forward group (phase ``"forward"``) is one norm
   instance and its backward group (phase ``"backward"``; backward nodes
   inherit ``module_fqn`` from the forward op with the same ``seq_nr``) is
   another. Tagged are the group's ``call_function`` nodes that produce tensors
   (``meta["val"]`` is a tensor or a tuple of tensors); never placeholders,
   ``get_attr``, the output, collectives, or nodes of neighbouring modules
   (the matmuls consuming the norm output and the gradient-accumulation adds
   have other / no ``module_fqn``). A group that cannot be one region without
   a dependency cycle is split into the fewest cycle-free parts
   (:func:`graph_trainer.compiler.common.split_acyclic`), each its own instance:
   with activation checkpointing the backward group of a norm holds the
   recomputed forward norm and the norm backward, which become two backward
   instances. A module called several times in one phase is otherwise one
   instance per phase (documented limitation).

Changes
=======

Each tagged node gets ``meta["custom"]["compile_with_inductor"] = {"inductor_configs":
{...}, "inductor_region": "rmsnorm_<kind>_<i>"}`` (plus ``"candidate_inductor_configs"``
when tuning); existing ``custom`` entries are kept and every node gets its own dict
copies. No node is added, removed or rewired.

Separate regions
================

``torch.fx.passes.regional_inductor`` groups tagged nodes into partitions with
``CapabilityBasedPartitioner``, which merges *all* tagged nodes it can without
creating a cycle (horizontal fusion), so on its own two norm instances without
a path between them (e.g. the weight-gradient reductions of two backward norms)
could end up in one compiled region. Newer torch (2.13 here) partitions per
``inductor_region`` id and never merges across ids; torch 2.11 ignores the key.
:func:`graph_trainer.compiler.passes.regional_inductor.regional_inductor_pass` therefore
forms the partitions itself, one per region id, on every torch version: every
norm instance (forward and backward separately) is exactly one compiled region.
"""

from __future__ import annotations

from dataclasses import dataclass

import difflib
import operator
from collections.abc import Mapping
from typing import Any

import logging

import torch
import torch.fx

from graph_trainer.compiler.common import (
    json_object,
    CAST_OPS,
    RESHAPE_OPS,
    is_collective,
    is_getitem,
    module_fqn_of,
    packet_name,
    packet_names,
    phase_of,
    set_pass_summary,
    split_acyclic,
    tag_for_inductor,
)
from graph_trainer.compiler.registry import GraphPass, PassContext

aten = torch.ops.aten

#: Inductor configs every RMSNorm region is compiled with first: Inductor's defaults.
#: They are the baseline and the fallback of the guarded selection below.
DEFAULT_RMSNORM_INDUCTOR_CONFIGS: dict[str, Any] = {}

#: Config sets that ``regional_inductor_pass`` also tries for every *distinct* RMSNorm
#: region (same ops and input shapes) when tuning (``--compile.rmsnorm.tune``, the default;
#: off with ``--debug.deterministic``, since the pick depends on timings):
#: each candidate is compiled, all variants are timed on CUDA on random inputs of the
#: region's shapes, and a candidate is kept only when it beats Inductor's defaults by
#: more than ``regional_inductor.MIN_CANDIDATE_GAIN`` (the regression guard).
#:
#: The candidates are the split size of Inductor's mix-order reduction (the norm
#: backward's ``dx`` row reduction fused with its ``dw`` column reduction). Inductor
#: picks ``last_power_of_2(M / (8 * SMs))`` clamped to [16, 128] rows per split
#: (``SIMDScheduling._codegen_mix_order_reduction``), and the fp32 partial ``dw`` sums it
#: writes and reads back, ``2 * (M / split) * N * 4`` bytes, add to the ``10 * M * N``
#: bytes the norm must move. Larger splits shrink that traffic at the cost of fewer
#: blocks. No fixed size wins on every shape and some sizes are much slower on others,
#: hence timed per region with a guard rather than a new fixed default (measurements:
#: docs/perf.md, "RMSNorm fwd+bwd: the split size of the backward's mix-order reduction").
DEFAULT_RMSNORM_CANDIDATE_CONFIGS: list[dict[str, Any]] = [
    {"triton.mix_order_reduction_split_size": 32},
    {"triton.mix_order_reduction_split_size": 64},
    {"triton.mix_order_reduction_split_size": 128},
    {"triton.mix_order_reduction_split_size": 256},
    {"triton.mix_order_reduction_autotune_split_size": True},
]

_PHASES = ("forward", "backward")

logger = logging.getLogger("graph_trainer")


def _op(name: str, overload: str = "default"):
    packet = getattr(aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


FUSED_RMS_NORM = _op("_fused_rms_norm")
FUSED_RMS_NORM_BACKWARD = _op("_fused_rms_norm_backward")
_FUSED_TARGETS = {t for t in (FUSED_RMS_NORM, FUSED_RMS_NORM_BACKWARD) if t is not None}

# Ops that never belong to a norm: their presence disqualifies a module.
_HEAVY_PACKETS = {
    "mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_scaled_mm", "convolution",
    "embedding", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
    "_grouped_mm", "scaled_dot_product_attention",
}  # fmt: skip
# Ops (every overload) skipped between the steps of the RMS pattern.
_PASS_THROUGH_PACKETS = packet_names(RESHAPE_OPS | CAST_OPS) | {"clone", "detach"}


def validate_inductor_configs(inductor_configs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check every key against ``torch._inductor.config`` and return a plain dict copy.

    Raises ``ValueError`` naming each unknown key and its closest valid keys.
    """
    if inductor_configs is None:
        return {}
    if not isinstance(inductor_configs, Mapping):
        raise TypeError(f"inductor_configs must be a dict, got {type(inductor_configs).__name__}")
    import torch._inductor.config as inductor_config

    try:
        valid = set(inductor_config.get_config_copy().keys())
    except Exception:  # pragma: no cover - config API change
        valid = None
    problems = []
    for key in inductor_configs:
        ok = (key in valid) if valid is not None else hasattr(inductor_config, key)
        if not ok:
            close = difflib.get_close_matches(str(key), sorted(valid or ()), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            problems.append(f"{key!r}{hint}")
    if problems:
        raise ValueError(
            "unknown torch._inductor.config key(s) in RMSNorm inductor_configs: "
            + "; ".join(problems)
            + ". Valid keys are the names in torch._inductor.config (dotted for nested "
            "configs, e.g. 'triton.cudagraphs')."
        )
    return dict(inductor_configs)


def _is_heavy(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator) or is_collective(node):
        return True
    return packet_name(node) in _HEAVY_PACKETS


def _produces_tensors(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)) and val:
        return all(isinstance(v, torch.Tensor) or v is None for v in val)
    return False


def _skip_pass_through(node: Any) -> Any:
    while isinstance(node, torch.fx.Node) and packet_name(node) in _PASS_THROUGH_PACKETS:
        node = node.args[0] if node.args else None
    return node


def _is_rms_rsqrt(node: torch.fx.Node) -> bool:
    """``node`` is ``rsqrt([add(] mean(pow(x, 2) | mul(x, x)) [, eps)])``."""
    if packet_name(node) != "rsqrt" or not node.args:
        return False
    arg = _skip_pass_through(node.args[0])
    if isinstance(arg, torch.fx.Node) and packet_name(arg) in ("add", "add_"):
        tensors = [a for a in arg.args if isinstance(a, torch.fx.Node)]
        if len(tensors) != 1:
            return False
        arg = _skip_pass_through(tensors[0])
    if not (isinstance(arg, torch.fx.Node) and packet_name(arg) == "mean" and arg.args):
        return False
    sq = _skip_pass_through(arg.args[0])
    if not isinstance(sq, torch.fx.Node):
        return False
    name = packet_name(sq)
    if name == "pow" and len(sq.args) >= 2 and sq.args[1] == 2:
        return True
    return name == "mul" and len(sq.args) >= 2 and sq.args[0] is sq.args[1]


def has_rms_pattern(nodes) -> bool:
    """True if any node in ``nodes`` is the rsqrt of an RMS computation."""
    return any(_is_rms_rsqrt(n) for n in nodes)


def _is_norm_name(fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1].lower().endswith("norm")


def find_rmsnorm_instances(graph: torch.fx.Graph) -> list[dict[str, Any]]:
    """All RMSNorm instances in ``graph`` in graph order.

    Each instance is ``{"phase", "kind", "form" ("fused" | "decomposed"),
    "module_fqn", "nodes": [fx nodes to tag]}``; ``kind`` is ``"forward"``,
    ``"backward"`` (a norm's gradient), or ``"recompute"`` (a forward norm
    recomputed in the backward phase by activation checkpointing: a fused
    forward op, or a decomposed group with the RMS rsqrt pattern). Pure
    analysis: does not modify the graph.
    """
    instances: list[dict[str, Any]] = []
    fused_fqns: set[str] = set()
    order = {n: i for i, n in enumerate(graph.nodes)}

    # 1. Fused form.
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _FUSED_TARGETS:
            continue
        phase = phase_of(node)
        if phase not in _PHASES:
            phase = "backward" if node.target is FUSED_RMS_NORM_BACKWARD else "forward"
        fqn = module_fqn_of(node)
        if fqn is not None:
            fused_fqns.add(fqn)
        nodes = [node] + [u for u in node.users if is_getitem(u)]
        if phase == "forward":
            kind = "forward"
        else:
            kind = "backward" if node.target is FUSED_RMS_NORM_BACKWARD else "recompute"
        instances.append({"phase": phase, "kind": kind, "form": "fused", "module_fqn": fqn, "nodes": nodes})

    # 2. Decomposed form, grouped by (module_fqn, phase).
    groups: dict[tuple[str, str], list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        fqn, phase = module_fqn_of(node), phase_of(node)
        if fqn is None or phase not in _PHASES:
            continue
        groups.setdefault((fqn, phase), []).append(node)

    for (fqn, phase), nodes in groups.items():
        if fqn in fused_fqns:
            continue
        fwd = groups.get((fqn, "forward"), [])
        if not fwd or any(_is_heavy(n) for n in fwd):
            continue
        if not (_is_norm_name(fqn) or has_rms_pattern(fwd)):
            continue
        if any(_is_heavy(n) for n in nodes):
            continue
        tag = [n for n in nodes if not is_collective(n) and _produces_tensors(n)]
        # With activation checkpointing the backward group also holds the
        # recomputed forward norm, which cannot share a region with the norm's
        # backward (the attention recompute/backward sits between them).
        for part in split_acyclic(tag, order):
            if phase == "forward":
                kind = "forward"
            else:
                kind = "recompute" if has_rms_pattern(part) else "backward"
            instances.append(
                {"phase": phase, "kind": kind, "form": "decomposed", "module_fqn": fqn, "nodes": part}
            )

    instances.sort(key=lambda inst: order[inst["nodes"][0]])
    return instances


def annotate_rmsnorm_for_regional_inductor_pass(
    gm: torch.fx.GraphModule,
    example_inputs=None,
    inductor_configs: dict[str, Any] | None = None,
    candidate_configs: list[dict[str, Any]] | None = None,
) -> torch.fx.GraphModule:
    """Tag each RMSNorm instance (fused or decomposed, forward and backward) as
    its own ``compile_with_inductor`` region.

    ``inductor_configs`` (``--compile.rmsnorm.inductor_configs``; validated against
    ``torch._inductor.config``; default :data:`DEFAULT_RMSNORM_INDUCTOR_CONFIGS`) is
    stored in every tagged node's annotation as ``{"inductor_configs": {...},
    "inductor_region": id}``. ``candidate_configs`` (each validated the same way) are
    stored as ``"candidate_inductor_configs"``: ``regional_inductor_pass`` compiles every
    candidate too, times them and keeps the fastest (CUDA only). Default: none (the
    pipeline passes :data:`DEFAULT_RMSNORM_CANDIDATE_CONFIGS` with
    ``--compile.rmsnorm.tune``).
    Region ids are ``rmsnorm_<kind>_<i>`` (kind: forward / backward /
    recompute, see :func:`find_rmsnorm_instances`). Stats
    (``gm.meta["graph_trainer_pass_stats"]``, also
    ``annotate_rmsnorm_for_regional_inductor_pass.last_stats``): ``forward``,
    ``backward``, ``recompute`` (norm instances of each kind), ``regions``,
    ``nodes`` (tagged nodes), ``getitems``, ``fused``, ``decomposed``,
    ``inductor_configs``.
    """
    configs = validate_inductor_configs(
        DEFAULT_RMSNORM_INDUCTOR_CONFIGS if inductor_configs is None else inductor_configs
    )
    candidates = [validate_inductor_configs(c) for c in candidate_configs or []]
    instances = find_rmsnorm_instances(gm.graph)
    counts = {"forward": 0, "backward": 0, "recompute": 0}
    tagged = 0
    forms = {"fused": 0, "decomposed": 0}
    for inst in instances:
        kind = inst["kind"]
        region = f"rmsnorm_{kind}_{counts[kind]}"
        counts[kind] += 1
        forms[inst["form"]] += 1
        for node in inst["nodes"]:
            tag_for_inductor(node, configs, region, candidates)
            tagged += 1
    n_getitems = sum(1 for inst in instances for n in inst["nodes"] if n.target is operator.getitem)
    recompute = f" + {counts['recompute']} recomputed (activation checkpointing)" if counts["recompute"] else ""
    stats = dict(
        forward=counts["forward"],
        backward=counts["backward"],
        recompute=counts["recompute"],
        regions=len(instances),
        nodes=tagged,
        getitems=n_getitems,
        fused=forms["fused"],
        decomposed=forms["decomposed"],
        inductor_configs=configs,
        candidate_inductor_configs=candidates,
    )
    set_pass_summary(
        gm,
        f"tagged {counts['forward']} forward + {counts['backward']} backward RMSNorms{recompute} "
        f"and their getitems ({forms['fused']} fused, {forms['decomposed']} decomposed; {tagged} nodes, "
        f"{n_getitems} getitems) -> {len(instances)} regions",
        **stats,
    )
    annotate_rmsnorm_for_regional_inductor_pass.last_stats = stats  # type: ignore[attr-defined]
    return gm


annotate_rmsnorm_for_regional_inductor_pass.last_stats = {}  # type: ignore[attr-defined]

__all__ = [
    "DEFAULT_RMSNORM_CANDIDATE_CONFIGS",
    "DEFAULT_RMSNORM_INDUCTOR_CONFIGS",
    "annotate_rmsnorm_for_regional_inductor_pass",
    "find_rmsnorm_instances",
    "validate_inductor_configs",
]


@dataclass
class RMSNormOptions:
    """``[compile.rmsnorm]``: options of ``annotate_rmsnorm_for_regional_inductor``
    (run by ``--compile.numerics_changing_optim`` with regional Inductor)."""

    inductor_configs: str = ""
    """Inductor configs of the RMSNorm regions: JSON on the CLI, a table in TOML.
    Empty: DEFAULT_RMSNORM_INDUCTOR_CONFIGS (graph_trainer/compiler/passes/annotate_rmsnorm.py)."""

    tune: bool = True
    """Also compile each distinct RMSNorm region with each of DEFAULT_RMSNORM_CANDIDATE_CONFIGS
    (split sizes of the norm backward's reduction), time them on CUDA and keep a candidate
    only when it beats Inductor's defaults by 2 %. About a second of compile per candidate
    and distinct region. No effect on CPU; off with --debug.deterministic (the pick depends
    on timings). Measured: docs/perf.md."""

    def check(self) -> None:
        """Raises ValueError: inductor_configs is not a JSON object of known Inductor keys."""
        validate_inductor_configs(json_object(self.inductor_configs, "--compile.rmsnorm.inductor_configs"))


def _kwargs(options: RMSNormOptions, ctx: PassContext) -> dict[str, Any]:
    configs = json_object(options.inductor_configs, "--compile.rmsnorm.inductor_configs")
    tune = options.tune and not ctx.deterministic
    if options.tune and ctx.deterministic:
        logger.info("--debug.deterministic: RMSNorm regions use Inductor's defaults (no timed config pick)")
    return {"inductor_configs": configs or None, "candidate_configs": DEFAULT_RMSNORM_CANDIDATE_CONFIGS if tune else None}


PASS = GraphPass(
    name="annotate_rmsnorm_for_regional_inductor", fn=annotate_rmsnorm_for_regional_inductor_pass,
    options=RMSNormOptions, section="rmsnorm", kwargs=_kwargs, changes_numerics=True, requires=("regional_inductor",),
    enabled=lambda ctx: ctx.compile_cfg.numerics_changing_optim and ctx.compile_cfg.inductor_compilation == "regional",
    aliases=("rmsnorm",),
)
