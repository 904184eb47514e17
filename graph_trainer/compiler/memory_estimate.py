"""Static estimate of a graph's peak activation memory, from the fake tensors in
``node.meta["val"]``.

Not a pipeline pass: an analysis helper (it never changes the graph), used by the dry
run (:mod:`graph_trainer.projection.dry_run`, peak before / after the passes) and by the tests of
the memory-policy passes (``sac_recompute``, ``reshard_after_forward``) to check them
without running them.

Model: nodes run in graph order; every storage (fake tensors that are views share their
base's storage) is allocated by the first node producing it and freed after the last
node that uses any tensor on it, as the FX-generated code frees a value after its last
use. Graph inputs (parameters, buffers, batch) are held by the caller and not counted;
values returned by the graph live to the end. Collectives allocate their output at the
issue node, and ``wait_tensor`` (like :func:`~graph_trainer.compiler.common.hold`)
returns that same buffer: at run time it is an alias, although its fake value is a
separate tensor. Not modelled: the allocator's fragmentation and caching, kernel workspaces,
and Inductor regions' internal buffers.
"""

from __future__ import annotations

import torch
import torch.fx

from graph_trainer.compiler.common import DisjointSet, hold, is_wait, storages


def estimate_peak_memory(gm: torch.fx.GraphModule) -> tuple[int, str | None]:
    """``(peak bytes, name of the node at the peak)`` of ``gm``'s live intermediate
    storages under the model in the module docstring. Bytes are exact storage sizes
    (``numel * itemsize`` of each base), not rounded to allocator blocks."""
    peak, at, _ = peak_breakdown(gm, top=0)
    return peak, at


def peak_breakdown(gm: torch.fx.GraphModule, top: int = 10) -> tuple[int, str | None, list[tuple[str, str, str, int]]]:
    """Like :func:`estimate_peak_memory`, plus the ``top`` largest storages live at the
    peak as ``(producing node, its first user / "output", last user, bytes)``."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    inputs = {ref for n in nodes if n.op == "placeholder" for ref, _ in storages(n.meta.get("val"))}
    size: dict = {}
    born: dict = {}
    last: dict = {}
    end = len(nodes)
    # wait_tensor / hold return their input's buffer: one storage class (union-find)
    same_buffer = DisjointSet()
    find = same_buffer.find
    for n in nodes:
        if (is_wait(n) or n.target is hold) and n.args and isinstance(n.args[0], torch.fx.Node):
            for (a, _), (b, _) in zip(storages(n.meta.get("val")), storages(n.args[0].meta.get("val"))):
                same_buffer.union(a, b)

    def refs_of(n):
        return [(find(r), b) for r, b in storages(n.meta.get("val"))]

    inputs = {find(r) for r in inputs}
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        uses = [pos[u] for u in n.users]
        death = max(uses, default=pos[n])
        for ref, nbytes in refs_of(n):
            if ref in inputs:
                continue
            size[ref] = max(size.get(ref, 0), nbytes)
            born.setdefault(ref, pos[n])
            last[ref] = max(last.get(ref, 0), death)
    out_node = nodes[-1]
    for arg in out_node.all_input_nodes:  # returned values live to the end
        for ref, _ in refs_of(arg):
            if ref in last:
                last[ref] = end
    delta = [0] * (end + 2)
    for ref, b in born.items():
        delta[b] += size[ref]
        delta[last[ref] + 1] -= size[ref]
    peak, cur, at = 0, 0, None
    for i in range(end):
        cur += delta[i]
        if cur > peak:
            peak, at = cur, i
    live = []
    if at is not None and top:
        producer = {}
        for n in nodes:
            for ref, _ in refs_of(n) if n.op not in ("placeholder", "output") else []:
                producer.setdefault(ref, n)
        for ref, b in born.items():
            if b <= at <= last[ref]:
                n = producer[ref]
                users = sorted(n.users, key=pos.__getitem__)
                live.append((n.name, users[0].name if users else "-",
                             "output" if last[ref] == end else nodes[last[ref]].name, size[ref]))
        live.sort(key=lambda x: -x[3])
    return peak, (nodes[at].name if at is not None else None), live[:top]
