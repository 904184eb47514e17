"""Tag every RMSNorm (forward and backward) as its own regional Inductor region.

Eager RMSNorm is memory bound; Inductor compiles each norm into one or two fused kernels. This
changes numerics slightly (reduction order), so it runs only with ``--compile.numerics_changing_optim``.

Matches: **fused** norms (CUDA traces): each ``aten._fused_rms_norm`` / ``_fused_rms_norm_backward``
node with its ``getitem`` users. **Decomposed** norms (CPU traces): the tensor-producing nodes of one
``(custom["module_fqn"], custom["phase"])`` group whose module is named ``*norm`` or computes
``rsqrt([add(] mean(pow(x, 2) | mul(x, x)) [, eps)])`` (casts / views between the steps), without a
heavy op (matmul, attention, embedding, higher-order op, collective) or a fused norm. A group that
would form a dependency cycle is split (with activation checkpointing the backward group holds the
recomputed forward norm and the norm backward); a module called twice in one phase is one instance.

Changes: ``compile_with_inductor = {"inductor_configs": {...}, "inductor_region":
"rmsnorm_<kind>_<i>"}`` (plus ``"candidate_inductor_configs"`` when tuning) on every node of a
norm; nothing is added, removed or rewired.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from graph_trainer.compiler.common import (
    CAST_OPS,
    RESHAPE_OPS,
    is_collective,
    is_getitem,
    json_object,
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
logger = logging.getLogger("graph_trainer")

#: Inductor configs of every RMSNorm region: Inductor's defaults (the baseline of the timed selection).
DEFAULT_RMSNORM_INDUCTOR_CONFIGS: dict[str, Any] = {}

#: Config sets ``regional_inductor`` also compiles and times on CUDA per distinct RMSNorm region
#: (``--compile.rmsnorm.tune``): split sizes of the norm backward's mix-order reduction (``dx`` rows
#: fused with ``dw`` columns); no fixed size wins on every shape (docs/perf.md).
DEFAULT_RMSNORM_CANDIDATE_CONFIGS: list[dict[str, Any]] = [
    {"triton.mix_order_reduction_split_size": 32},
    {"triton.mix_order_reduction_split_size": 64},
    {"triton.mix_order_reduction_split_size": 128},
    {"triton.mix_order_reduction_split_size": 256},
    {"triton.mix_order_reduction_autotune_split_size": True},
]

FUSED_RMS_NORM = aten._fused_rms_norm.default
FUSED_RMS_NORM_BACKWARD = aten._fused_rms_norm_backward.default
_PHASES = ("forward", "backward")

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
    """A dict copy of ``inductor_configs`` (None: ``{}``); raises ``ValueError`` naming each key
    not in ``torch._inductor.config`` and the closest valid keys."""
    import torch._inductor.config as inductor_config

    valid = set(inductor_config.get_config_copy())
    problems = []
    for key in inductor_configs or {}:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            problems.append(f"{key!r}{hint}")
    if problems:
        raise ValueError(f"unknown torch._inductor.config key(s) in RMSNorm inductor_configs: {'; '.join(problems)}. "
                         "Valid keys are the names in torch._inductor.config (dotted for nested configs, "
                         "e.g. 'triton.cudagraphs').")
    return dict(inductor_configs or {})


def _is_heavy(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator) or is_collective(node):
        return True
    return packet_name(node) in _HEAVY_PACKETS


def _produces_tensors(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return bool(val) and all(isinstance(v, torch.Tensor) or v is None for v in val)
    return isinstance(val, torch.Tensor)


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
    if not isinstance(sq, torch.fx.Node) or len(sq.args) < 2:
        return False
    name = packet_name(sq)
    return (name == "pow" and sq.args[1] == 2) or (name == "mul" and sq.args[0] is sq.args[1])


def _has_rms_pattern(nodes) -> bool:
    return any(_is_rms_rsqrt(n) for n in nodes)


def find_rmsnorm_instances(graph: torch.fx.Graph) -> list[dict[str, Any]]:
    """All RMSNorm instances of ``graph`` in graph order (pure analysis).

    Each is ``{"phase", "kind", "form" ("fused" | "decomposed"), "module_fqn", "nodes": [nodes
    to tag]}``; ``kind`` is ``"forward"``, ``"backward"`` (a norm's gradient) or ``"recompute"``
    (a forward norm recomputed in the backward phase by activation checkpointing).
    """
    instances: list[dict[str, Any]] = []
    fused_fqns: set[str] = set()
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple[str, str], list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        fqn, phase = module_fqn_of(node), phase_of(node)
        if node.target in (FUSED_RMS_NORM, FUSED_RMS_NORM_BACKWARD):
            is_bwd = node.target is FUSED_RMS_NORM_BACKWARD
            phase = phase if phase in _PHASES else "backward" if is_bwd else "forward"
            if fqn is not None:
                fused_fqns.add(fqn)
            kind = "forward" if phase == "forward" else "backward" if is_bwd else "recompute"
            nodes = [node] + [u for u in node.users if is_getitem(u)]
            instances.append({"phase": phase, "kind": kind, "form": "fused", "module_fqn": fqn, "nodes": nodes})
        elif fqn is not None and phase in _PHASES:
            groups.setdefault((fqn, phase), []).append(node)

    for (fqn, phase), nodes in groups.items():
        fwd = groups.get((fqn, "forward"), [])
        if fqn in fused_fqns or not fwd or any(_is_heavy(n) for n in fwd) or any(_is_heavy(n) for n in nodes):
            continue
        if not (fqn.rsplit(".", 1)[-1].lower().endswith("norm") or _has_rms_pattern(fwd)):
            continue
        tag = [n for n in nodes if not is_collective(n) and _produces_tensors(n)]
        for part in split_acyclic(tag, order):
            kind = "forward" if phase == "forward" else "recompute" if _has_rms_pattern(part) else "backward"
            instances.append({"phase": phase, "kind": kind, "form": "decomposed", "module_fqn": fqn, "nodes": part})

    instances.sort(key=lambda inst: order[inst["nodes"][0]])
    return instances


def annotate_rmsnorm_for_regional_inductor_pass(
    gm: torch.fx.GraphModule,
    example_inputs=None,
    inductor_configs: dict[str, Any] | None = None,
    candidate_configs: list[dict[str, Any]] | None = None,
) -> torch.fx.GraphModule:
    """Tag each RMSNorm instance (:func:`find_rmsnorm_instances`) as its own region
    ``rmsnorm_<kind>_<i>``.

    ``inductor_configs`` (default :data:`DEFAULT_RMSNORM_INDUCTOR_CONFIGS`) and
    ``candidate_configs`` (also compiled and timed by ``regional_inductor``, CUDA only) go into
    every tag; an unknown ``torch._inductor.config`` key raises ``ValueError``. Stats: instances
    per kind and form, ``regions``, ``nodes``, ``getitems`` and the configs.
    """
    configs = validate_inductor_configs(
        DEFAULT_RMSNORM_INDUCTOR_CONFIGS if inductor_configs is None else inductor_configs
    )
    candidates = [validate_inductor_configs(c) for c in candidate_configs or []]
    instances = find_rmsnorm_instances(gm.graph)
    counts = {"forward": 0, "backward": 0, "recompute": 0, "fused": 0, "decomposed": 0}
    for inst in instances:
        region = f"rmsnorm_{inst['kind']}_{counts[inst['kind']]}"
        counts[inst["kind"]] += 1
        counts[inst["form"]] += 1
        for node in inst["nodes"]:
            tag_for_inductor(node, configs, region, candidates)
    tagged = sum(len(inst["nodes"]) for inst in instances)
    getitems = sum(is_getitem(n) for inst in instances for n in inst["nodes"])
    recompute = f" + {counts['recompute']} recomputed (activation checkpointing)" if counts["recompute"] else ""
    set_pass_summary(
        gm,
        f"tagged {counts['forward']} forward + {counts['backward']} backward RMSNorms{recompute} "
        f"and their getitems ({counts['fused']} fused, {counts['decomposed']} decomposed; {tagged} nodes, "
        f"{getitems} getitems) -> {len(instances)} regions",
        **counts, regions=len(instances), nodes=tagged, getitems=getitems,
        inductor_configs=configs, candidate_inductor_configs=candidates,
    )
    return gm


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
    if options.tune and ctx.deterministic:
        logger.info("--debug.deterministic: RMSNorm regions use Inductor's defaults (no timed config pick)")
    tune = options.tune and not ctx.deterministic
    return {"inductor_configs": configs or None,
            "candidate_configs": DEFAULT_RMSNORM_CANDIDATE_CONFIGS if tune else None}


PASS = GraphPass(
    name="annotate_rmsnorm_for_regional_inductor", fn=annotate_rmsnorm_for_regional_inductor_pass,
    options=RMSNormOptions, section="rmsnorm", kwargs=_kwargs, changes_numerics=True, requires=("regional_inductor",),
    enabled=lambda ctx: ctx.compile_cfg.numerics_changing_optim and ctx.compile_cfg.inductor_compilation == "regional",
    aliases=("rmsnorm",),
)
