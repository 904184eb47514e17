"""Static estimate of a graph's peak activation memory, from the fake tensors in ``node.meta["val"]``.

Model: nodes run in graph order; every storage (views share their base's) is allocated by the first node producing
it and freed after the last node using it, as the FX-generated code does. Graph inputs are not counted; returned
values live to the end. ``wait_tensor`` and :func:`~graph_trainer.compiler.collectives.hold` return their input's
buffer; :func:`kept_in_kernels` hold none. Not modelled: the allocator, kernel workspaces, Inductor's scratch."""

import itertools

import torch

from graph_trainer.compiler.collectives import hold, is_wait
from graph_trainer.compiler.graph_values import DisjointSet, storages
from graph_trainer.compiler.node_meta import region_of

#: Ops besides ``torch.Tag.pointwise`` ones whose output whole-graph Inductor computes inside their users' kernels.
_FUSED_EXTRA = {"_to_copy", "_log_softmax", "_log_softmax_backward_data", "nll_loss_forward",
                "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward"}


def _fusable(node: torch.fx.Node, consumer: bool) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return (torch.Tag.pointwise in target.tags or target.overloadpacket.__name__ in _FUSED_EXTRA
            or consumer and torch.Tag.reduction in target.tags)


def kept_in_kernels(gm: torch.fx.GraphModule, fused: bool = False) -> set[torch.fx.Node]:
    """Nodes no buffer holds: read only inside their ``regional_inductor`` region (:func:`~.node_meta.region_of`), or
    with ``fused`` (whole-graph Inductor) pointwise ops or casts read only by pointwise ops or reductions."""
    returned = {n for o in gm.graph.find_nodes(op="output") for n in o.all_input_nodes}
    inside = ((lambda n, u: _fusable(n, False) and _fusable(u, True)) if fused else
              (lambda n, u: region_of(n) is not None and region_of(u) == region_of(n)))
    return {n for n in gm.graph.nodes if n not in returned and n.users and all(inside(n, u) for u in n.users)}


def estimate_peak_memory(gm: torch.fx.GraphModule, fused: bool = False) -> tuple[int, str | None]:
    """``(peak bytes, node at the peak)`` (module docstring), without :func:`kept_in_kernels`."""
    nodes, skip = list(gm.graph.nodes), kept_in_kernels(gm, fused)
    pos = {n: i for i, n in enumerate(nodes)}
    same_buffer = DisjointSet()  # wait_tensor / hold return their input's buffer
    for n in nodes:
        if (is_wait(n) or n.target is hold) and n.args and isinstance(n.args[0], torch.fx.Node):
            for (a, _), (b, _) in zip(storages(n.meta.get("val")), storages(n.args[0].meta.get("val"))):
                same_buffer.union(a, b)

    def refs_of(n):
        return [(same_buffer.find(r), b) for r, b in storages(n.meta.get("val"))]

    inputs = {ref for n in nodes if n.op == "placeholder" for ref, _ in refs_of(n)}
    size, born, last, end = {}, {}, {}, len(nodes)
    for n in nodes:
        if n.op in ("placeholder", "output") or n in skip:
            continue
        death = max((pos[u] for u in n.users), default=pos[n])
        for ref, nbytes in refs_of(n):
            if ref not in inputs:
                size[ref] = max(size.get(ref, 0), nbytes)
                born.setdefault(ref, pos[n])
                last[ref] = max(last.get(ref, 0), death)
    for arg in nodes[-1].all_input_nodes:  # returned values live to the end
        for ref, _ in refs_of(arg):
            if ref in last:
                last[ref] = end
    delta = [0] * (end + 2)
    for ref, b in born.items():
        delta[b] += size[ref]
        delta[last[ref] + 1] -= size[ref]
    live = list(itertools.accumulate(delta[:end]))  # bytes live at each node
    peak = max(live, default=0)
    return peak, (nodes[live.index(peak)].name if peak > 0 else None)
