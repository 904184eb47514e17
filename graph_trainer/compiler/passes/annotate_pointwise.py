"""Tag chains of pointwise ops as Inductor regions: SwiGLU, residual adds, casts, the loss.

Matches: aten ``pointwise`` / ``reduction`` ops (``torch.Tag``), ``_to_copy``, ``_log_softmax(_backward_data)``
and ``nll_loss_forward/backward``; not in-place, seeded-random or complex ops, nodes already tagged,
collectives. A view joins only a chain it continues. Connected matched nodes of one ``(phase, module
FQN)`` form a region, cut by ``split_acyclic`` where it would form a cycle (the residual
``out = h + ffn(norm(h))``); regions with fewer than ``min_ops`` non-view ops stay eager. So
Inductor fuses each chain while matmuls stay eager and no kernel mixes forward and backward.

Changes: ``compile_with_inductor = {"inductor_configs": {}, "inductor_region": "pointwise_<phase>_<i>"}``
on the chosen nodes. Changes numerics (fused bf16 chains in fp32): opt-in.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.fx

from graph_trainer.compiler.common import (
    PERMUTE_OPS,
    RESHAPE_OPS,
    DisjointSet,
    is_tagged_for_inductor,
    module_fqn_of,
    packet_name,
    packet_names,
    phase_of,
    set_pass_summary,
    split_acyclic,
    tag_for_inductor,
)
from graph_trainer.compiler.registry import GraphPass

aten = torch.ops.aten

_EXTRA_OPS = {"_to_copy", "_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward"}
# View-family ops (every overload) that join a chain they continue.
_VIEW_PACKETS = packet_names(RESHAPE_OPS | PERMUTE_OPS) | {"unsqueeze", "squeeze"}


def _is_real_tensor_node(node: torch.fx.Node) -> bool:
    """A real tensor result with no complex tensor input (Inductor has no complex codegen)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_complex():
        return False
    return not any(isinstance(v := u.meta.get("val"), torch.Tensor) and v.is_complex() for u in node.all_input_nodes)


def _kind(node: torch.fx.Node) -> str | None:
    """"compute", "view" or None (not eligible)."""
    name = packet_name(node)
    if name is None or node.target.namespace != "aten" or is_tagged_for_inductor(node):
        return None
    if not _is_real_tensor_node(node):
        return None
    tags = set(node.target.tags)
    if node.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in tags:
        return None  # in-place / out= ops (torch 2.11 has no Tag.inplace)
    if name in _VIEW_PACKETS:
        return "view"
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags or name in _EXTRA_OPS:
        return "compute"
    return None


def find_pointwise_regions(
    graph: torch.fx.Graph, min_ops: int = 2, accept: Callable[[torch.fx.Node], bool] | None = None,
) -> list[list[torch.fx.Node]]:
    """Acyclic regions of chained cheap ops (rules: module docstring), in graph order, each a
    list of nodes in graph order with at least ``min_ops`` non-view ops. ``accept``: a further
    test every non-view op must pass (views are joined by the same rule either way)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    chains = DisjointSet()
    kind: dict[torch.fx.Node, str] = {}
    for n in nodes:  # union matched neighbours of the same (phase, module)
        k = _kind(n)
        if k is None or (k == "compute" and accept is not None and not accept(n)):
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
    """Tag the nodes of each region for ``regional_inductor`` as region ``<prefix>_<phase>_<i>``
    with ``inductor_configs``. Returns the stats ``regions``, ``nodes``, ``forward_regions``,
    ``backward_regions`` and ``largest`` (nodes of the largest region)."""
    by_phase: dict[str, int] = defaultdict(int)
    for i, region in enumerate(regions):
        phase = phase_of(region[0]) or "none"
        by_phase[phase] += 1
        for n in region:
            tag_for_inductor(n, inductor_configs, f"{prefix}_{phase}_{i}")
    return {"regions": len(regions), "nodes": sum(map(len, regions)), "forward_regions": by_phase["forward"],
            "backward_regions": by_phase["backward"], "largest": max(map(len, regions), default=0)}


def annotate_pointwise_for_regional_inductor_pass(
    gm: torch.fx.GraphModule,
    example_inputs: Any = None,
    inductor_configs: dict[str, Any] | None = None,
    min_ops: int = 2,
) -> torch.fx.GraphModule:
    """Tag each region of :func:`find_pointwise_regions` for ``regional_inductor`` with
    ``inductor_configs`` (default ``{}``); ``ValueError`` for ``min_ops < 1``. Stats: those of
    :func:`tag_regions`."""
    if min_ops < 1:
        raise ValueError(f"min_ops must be >= 1, got {min_ops}")
    st = tag_regions(find_pointwise_regions(gm.graph, min_ops), dict(inductor_configs or {}), "pointwise")
    set_pass_summary(gm, f"tagged {st['nodes']} pointwise/cast/reduction node(s) into {st['regions']} region(s) "
                     f"({st['forward_regions']} forward, {st['backward_regions']} backward; largest {st['largest']} "
                     "nodes)", **st)
    return gm


PASS = GraphPass(
    name="annotate_pointwise_for_regional_inductor", fn=annotate_pointwise_for_regional_inductor_pass,
    changes_numerics=True, requires=("regional_inductor",), aliases=("pointwise",),
)
