"""Pattern matching over the traced graph: chains of pointwise ops and RMSNorm instances (plus :func:`tag_regions`)."""

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch

from graph_trainer.compiler.collectives import is_collective
from graph_trainer.compiler.graph_values import DisjointSet, positions, split_acyclic
from graph_trainer.compiler.node_meta import is_tagged_for_inductor, module_fqn_of, phase_of, tag_for_inductor
from graph_trainer.compiler.ops import CAST_OPS, PERMUTE_OPS, RESHAPE_OPS, aten, is_getitem, packet_name, packet_names

_POINTWISE_EXTRA_OPS = {"_to_copy", "_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward"}
# View-family ops (every overload) that join a chain they continue.
_CHAIN_VIEW_PACKETS = packet_names(RESHAPE_OPS | PERMUTE_OPS) | {"unsqueeze", "squeeze"}


def _chain_kind(node: torch.fx.Node) -> str | None:
    """"compute", "view" or None (not eligible, or a complex or non-tensor value: Inductor has no complex codegen)."""
    name, val = packet_name(node), node.meta.get("val")
    if name is None or node.target.namespace != "aten" or is_tagged_for_inductor(node):
        return None
    if not isinstance(val, torch.Tensor) or val.is_complex() or any(
            isinstance(v := u.meta.get("val"), torch.Tensor) and v.is_complex() for u in node.all_input_nodes):
        return None
    tags = set(node.target.tags)
    if node.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in tags:
        return None  # in-place / out= ops (torch 2.11 has no Tag.inplace)
    if name in _CHAIN_VIEW_PACKETS:
        return "view"
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags or name in _POINTWISE_EXTRA_OPS:
        return "compute"
    return None


def find_pointwise_regions(graph: torch.fx.Graph, min_ops: int = 2,
                           accept: Callable[[torch.fx.Node], bool] | None = None) -> list[list[torch.fx.Node]]:
    """Acyclic regions of chained cheap ops, in graph order, each a list of nodes in graph order with at least
    ``min_ops`` non-view ops. Ops: aten ``pointwise`` / ``reduction`` ops, ``_to_copy``, ``_log_softmax`` and
    ``nll_loss`` (and backwards); not in-place, seeded-random or complex ops, nodes already tagged for Inductor. A
    view joins only a chain it continues. Connected ops of one ``(phase, module FQN)`` form a region, cut by
    :func:`split_acyclic` where it would form a cycle. ``accept``: a further test every non-view op must pass."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    chains = DisjointSet()
    kind: dict[torch.fx.Node, str] = {}
    for n in nodes:  # union matched neighbours of the same (phase, module)
        if (k := _chain_kind(n)) is None or (k == "compute" and accept is not None and not accept(n)):
            continue
        key = (phase_of(n), module_fqn_of(n))
        ins = [u for u in n.all_input_nodes if u in kind and (phase_of(u), module_fqn_of(u)) == key]
        if k == "view" and not ins:
            continue  # a view joins only a chain it continues
        kind[n] = k
        for u in ins:
            chains.union(u, n)
    components: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for n in nodes:  # graph order within each component
        if n in kind:
            components[chains.find(n)].append(n)
    pieces = [part for comp in components.values() for part in split_acyclic(comp, pos)]
    pieces.sort(key=lambda p: pos[p[0]])
    return [p for p in pieces if sum(kind[n] == "compute" for n in p) >= min_ops]


def tag_regions(regions: list[list[torch.fx.Node]], inductor_configs: dict[str, Any], prefix: str) -> dict[str, int]:
    """Tag the nodes of each region for ``regional_inductor`` as region ``<prefix>_<phase>_<i>`` with
    ``inductor_configs``. Returns the stats ``regions``, ``nodes``, ``forward_regions``, ``backward_regions`` and
    ``largest`` (nodes of the largest region)."""
    by_phase: dict[str, int] = defaultdict(int)
    for i, region in enumerate(regions):
        phase = phase_of(region[0]) or "none"
        by_phase[phase] += 1
        for n in region:
            tag_for_inductor(n, inductor_configs, f"{prefix}_{phase}_{i}")
    return {"regions": len(regions), "nodes": sum(map(len, regions)), "forward_regions": by_phase["forward"],
            "backward_regions": by_phase["backward"], "largest": max(map(len, regions), default=0)}


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


def _is_heavy(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (isinstance(node.target, torch._ops.HigherOrderOperator)
                                           or is_collective(node) or packet_name(node) in _HEAVY_PACKETS)


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


def find_rmsnorm_instances(graph: torch.fx.Graph) -> list[dict[str, Any]]:
    """All RMSNorm instances of ``graph`` in graph order: **fused** (``aten._fused_rms_norm`` / its backward with
    their ``getitem`` s) or **decomposed** (one module's nodes of one phase computing ``rsqrt(mean(x ** 2) + eps)``
    or of a module named ``*norm``, split where they would form a cycle). Each is ``{"name", "phase", "kind",
    "form", "module_fqn", "nodes"}``; ``kind`` is ``"forward"``, ``"backward"`` or ``"recompute"`` (a forward norm
    recomputed in the backward phase); ``name`` is ``rmsnorm_<kind>_<i>`` counting each kind. Reads only."""
    instances: list[dict[str, Any]] = []
    fused_fqns: set[str] = set()
    order = positions(graph)
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
        if not (fqn.rsplit(".", 1)[-1].lower().endswith("norm") or any(map(_is_rms_rsqrt, fwd))):
            continue
        for part in split_acyclic([n for n in nodes if not is_collective(n) and _produces_tensors(n)], order):
            kind = "forward" if phase == "forward" else "recompute" if any(map(_is_rms_rsqrt, part)) else "backward"
            instances.append({"phase": phase, "kind": kind, "form": "decomposed", "module_fqn": fqn, "nodes": part})

    instances.sort(key=lambda inst: order[inst["nodes"][0]])
    per_kind: Counter = Counter()
    for inst in instances:
        inst["name"] = f"rmsnorm_{inst['kind']}_{per_kind[inst['kind']]}"
        per_kind[inst["kind"]] += 1
    return instances
