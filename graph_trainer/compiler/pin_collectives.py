"""Keep the collective schedule of the traced graph when Inductor compiles all of it.

Not a pipeline pass: an Inductor post-grad hook (:class:`PinCollectivesPass`, installed
as ``post_grad_custom_post_pass``) that ``full_inductor_pass`` uses when called with
``pin_collectives=True`` (``--compile.full_inductor.pin_collectives``, the default).

Why: ``overlap_collectives`` places every all-gather / reduce-scatter issue and its
``wait_tensor`` so that communication runs under compute. Full-graph Inductor does not
keep that order: its scheduler's ``reorder_for_peak_memory`` (on by default) picks the
topological order with the smallest estimated peak, which issues each collective just
before its wait, so none of the communication overlaps (docs/perf.md, "The fix:
pin_collectives"). Separately, the traced step is an inference graph to Inductor, and
for those the post-grad ``reorder_for_locality`` moves every wait right before its
first user: each reduce-scatter wait to the end of the graph, keeping every unsharded
fp32 gradient alive (Inductor holds a collective's input until its wait).
``full_inductor_pass(pin_collectives=True)`` turns that pass off.

Matches (on Inductor's post-grad graph, through ``post_grad_custom_post_pass``):
``_c10d_functional`` collectives and their ``wait_tensor`` nodes, and the *anchors*:
``aten.mm`` / ``addmm`` / ``bmm`` / ``_scaled_mm`` nodes, extern kernels that Inductor
never fuses (single-output, so wrapping them in ``control_deps`` is simple).

Changes: no computation. For each collective ``C`` whose wait ``W`` follows anchors
``A1 .. Ak`` in the given order, it adds two ordering dependencies with Inductor's
``control_deps`` (:func:`preserve_node_ordering`): ``A1`` after ``C`` and ``W`` after
``Ak`` -- the constraints Inductor's own overlap scheduler inserts (``start -> hiding
compute -> wait``, ``overlap_preserving_bucketer``). Every dependency points forward in
the existing order, so the graph stays acyclic; whatever order Inductor then picks, each
collective still runs under the matmuls it overlapped as ``overlap_collectives`` placed
it, and the peak-memory reordering puts the issue just before ``A1`` and the wait just
after ``Ak`` at the latest / earliest. (A dependency *on* a wait would not work: Inductor
resolves it to the collective's output buffer, i.e. to the issue.)
"""

from __future__ import annotations

import bisect
import hashlib
import logging

import torch
import torch.fx

from graph_trainer.compiler.common import collective_kind, is_wait, packet_name

logger = logging.getLogger("graph_trainer")


_ANCHORS = ("mm", "addmm", "bmm", "_scaled_mm")


def _is_anchor(n: torch.fx.Node) -> bool:
    return packet_name(n) in _ANCHORS


def collective_pin_deps(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """``{dependent: [dependencies]}`` that keep each collective overlapped with the
    anchors it overlaps in ``graph``'s order (see the module docstring); pure, the graph
    is not changed.

    For a collective ``C`` whose ``wait_tensor`` ``W`` comes after anchors ``A1 .. Ak``
    (k >= 1): ``A1`` depends on ``C`` and ``W`` on ``Ak``. A collective with no anchor
    before its wait gets nothing (it overlaps nothing as given).
    """
    pos: dict[torch.fx.Node, int] = {}
    anchors: list[int] = []
    anchor_at: dict[int, torch.fx.Node] = {}
    for i, n in enumerate(graph.nodes):
        pos[n] = i
        if _is_anchor(n):
            anchors.append(i)
            anchor_at[i] = n
    deps: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for w in graph.nodes:
        if not is_wait(w):
            continue
        c = w.args[0] if w.args else None
        if not isinstance(c, torch.fx.Node) or collective_kind(c) is None or c not in pos:
            continue
        lo = bisect.bisect_right(anchors, pos[c])
        hi = bisect.bisect_left(anchors, pos[w])
        if lo >= hi:  # no anchor between issue and wait
            continue
        first, last = anchor_at[anchors[lo]], anchor_at[anchors[hi - 1]]
        deps.setdefault(first, []).append(c)
        deps.setdefault(w, []).append(last)
    return deps


def pin_collectives(graph: torch.fx.Graph) -> int:
    """Add the ordering dependencies of :func:`collective_pin_deps` with Inductor's
    ``control_deps``. Returns the number of dependencies added."""
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
