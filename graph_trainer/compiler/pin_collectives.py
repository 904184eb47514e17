"""Keep the collective schedule of the traced graph when Inductor compiles all of it.

An Inductor ``post_grad_custom_post_pass`` (:class:`PinCollectivesPass`) of ``full_inductor_pass(pin_collectives=
True)``; without it Inductor's ``reorder_for_peak_memory`` issues each collective just before its wait. For each
collective ``C`` whose ``wait_tensor`` ``W`` follows the anchors ``A1 .. Ak`` (matmuls: extern kernels Inductor
never fuses), Inductor's ``control_deps`` put ``A1`` after ``C`` and ``W`` after ``Ak``."""

import bisect
import hashlib

import torch

from graph_trainer import logger
from graph_trainer.compiler.collectives import collective_kind, is_wait
from graph_trainer.compiler.graph_values import positions
from graph_trainer.compiler.ops import packet_name

_ANCHORS = ("mm", "addmm", "bmm", "_scaled_mm")


def collective_pin_deps(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """``{dependent: [dependencies]}``: for each collective ``C`` whose wait ``W`` comes after anchors ``A1 .. Ak``
    (k >= 1), ``A1`` depends on ``C`` and ``W`` on ``Ak`` (module docstring). Pure: the graph is not changed."""
    pos = positions(graph)
    anchors = [n for n in graph.nodes if packet_name(n) in _ANCHORS]
    anchor_pos = [pos[a] for a in anchors]
    deps: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for w in graph.nodes:
        c = w.args[0] if is_wait(w) and w.args else None
        if not isinstance(c, torch.fx.Node) or collective_kind(c) is None:
            continue
        lo, hi = bisect.bisect_right(anchor_pos, pos[c]), bisect.bisect_left(anchor_pos, pos[w])
        if lo < hi:  # at least one anchor between issue and wait
            deps.setdefault(anchors[lo], []).append(c)
            deps.setdefault(w, []).append(anchors[hi - 1])
    return deps


def pin_collectives(graph: torch.fx.Graph) -> int:
    """Add :func:`collective_pin_deps` with Inductor's ``control_deps``; returns how many."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    deps = collective_pin_deps(graph)
    if deps:
        preserve_node_ordering(graph, {k: OrderedSet(v) for k, v in deps.items()})
        graph.lint()
    n = sum(len(v) for v in deps.values())
    logger.info(f"pin_collectives: {n} ordering dependencies on {len(deps)} nodes")
    return n


class PinCollectivesPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    """:func:`pin_collectives` as Inductor's ``post_grad_custom_post_pass``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        pin_collectives(graph)

    def uuid(self) -> bytes:  # part of Inductor's FX graph cache key
        return hashlib.sha256(b"graph_trainer.pin_collectives.v1").digest()
