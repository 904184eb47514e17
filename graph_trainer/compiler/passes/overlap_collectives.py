"""Overlap the in-graph FSDP collectives with compute by sinking their waits.

Matches: ``_c10d_functional.wait_tensor`` nodes whose input is a functional
collective (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce``...). As traced (:mod:`graph_trainer.distributed.fsdp`), every collective is
followed at once by its wait, so the compute stream blocks on each all-gather and
reduce-scatter in turn and no communication overlaps with compute.

Changes: the positions of waits and of reduce-scatters (with their cast / pad chain),
plus a :func:`~graph_trainer.compiler.common.hold` identity after every wait that no
longer follows its collective; no computation is added, removed or rewired, so the
values computed are bit for bit those of the input graph (a test checks it).

* A wait on an **all-gather** moves to just before its first user. The traced
  step issues every parameter's all-gather at the start of the forward (traceable
  FSDP gathers all parameters up front), which allocates the whole unsharded model
  at once; with ``ag_window=k`` (default 9, one Llama3 block) each parameter
  all-gather (input cast from a placeholder) is instead issued just before the first
  use of the parameter ``k`` places earlier in use order, so about ``k`` gathered
  parameters are in flight: layer ``i`` computes while layer ``i + 1`` is gathered.
* A **reduce-scatter** is issued as early as its gradient allows. As traced,
  autograd runs every parameter's all-gather backward (cast to fp32, pad,
  reduce-scatter) at the very end of the backward, because the all-gathers were
  the first autograd nodes created: all reduce-scatters queue up after the last
  matmul, none overlaps, and every unsharded gradient stays alive until then. The
  pass moves each reduce-scatter, with the single-use cast / view / pad chain that
  feeds it, to just after the node that produces the gradient.
* A wait on a **reduce-scatter** (or any other collective) moves towards its first
  user too, but no further than just before the issue of the ``max_in_flight``-th
  next collective of the same kind, so at most ``max_in_flight`` gradient buffers
  (the fp32 unsharded gradient being reduced) are kept alive by pending
  reduce-scatters: the backward of layer ``i`` runs while the gradient of layer
  ``i + 1`` is being reduced.

Eager execution of the graph issues functional collectives asynchronously on the
process group's stream and ``wait_tensor`` makes the current stream wait for them,
so this reordering is what gives overlap when the graph is run uncompiled or
with regional Inductor. (Full-graph Inductor schedules collectives itself.)

Buffer lifetime: the generated Python frees every value after its last use, which is
now the collective's *issue*. The pass does not rely on the process group keeping an
in-flight collective's input alive: every wait that no longer follows its collective
goes through ``hold``, an identity that also takes the collective's input, so the
input lives until the wait (for a reduce-scatter: one unsharded gradient per collective
in flight, bounded by ``max_in_flight``). ``full_inductor_pass`` removes these nodes
before compiling (:func:`~graph_trainer.compiler.common.strip_holds`).

CPU (gloo): with 2 gloo ranks, collectives left in flight while the main thread computes
intermittently corrupted the heap (``malloc(): unaligned tcache chunk``), with or without
the holds; the root cause was not found. Overlap buys nothing on CPU, so by default a
collective on CPU tensors is only hoisted, together with its wait, and never left in
flight; ``cpu_async=True`` separates them anyway (the 1-rank tests of the schedule).

Why not torch's scheduler: ``torch._inductor.fx_passes.overlap_scheduling`` has the
equivalent pass, ``schedule_overlap_bucketing`` (``OverlapScheduler``, which the
``overlap_preserving_bucketer`` then buckets). It decides from runtime estimates of every
compute node, and those come from the GPU: benchmarks, or a roofline of the device's
bandwidth that torch computes even when given ``custom_runtime_estimation``. With no CUDA
device, where the dry run, the tests and CI run, it raises (torch 2.11 and 2.13). With
one, on the traced step, it bounds what is in flight by bytes and its peak-memory budget
rather than by count, and leaves every reduce-scatter in flight to the end of the backward
(every unsharded gradient alive until then), where ``max_in_flight`` bounds them here; its
estimates are benchmarks aligned across ranks by a collective inside the pass; and torch
2.13 also buckets FSDP collectives first, which is ``bucket_collectives``' job in this
pipeline. tests/passes/test_overlap_collectives.py shows both cases (one runs where there
is no GPU, the other where there is).
"""

from __future__ import annotations

import torch
import torch.fx

from graph_trainer.compiler.common import (
    CAST_OPS,
    RESHAPE_OPS,
    SLICE_OPS,
    collective_kind,
    hold,
    is_wait,
    set_pass_summary,
    shard_chain,
)
from graph_trainer.compiler.registry import GraphPass

aten = torch.ops.aten

# Ops that may be hoisted together with the collective they feed (cheap, single use):
# the cast / view / pad chain of a gradient before its reduce-scatter.
_HOISTABLE = (
    CAST_OPS | RESHAPE_OPS
    | {aten.t.default, aten.permute.default, aten.clone.default, aten.constant_pad_nd.default, aten.pad.default}
)

# View ops that move together with the wait whose output they view (FSDP: slice -> view
# of the gathered buffer).
_WAIT_VIEWS = RESHAPE_OPS | SLICE_OPS


def _issues_by_kind(graph: torch.fx.Graph) -> dict[str, list[torch.fx.Node]]:
    """Collective issue nodes grouped by kind, in graph order."""
    out: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        kind = collective_kind(node)
        if kind is not None:
            out.setdefault(kind, []).append(node)
    return out


def _hoist_collective(graph: torch.fx.Graph, issue: torch.fx.Node) -> bool:
    """Move ``issue`` and its single-use cast/view/pad input chain to just after the
    latest node each depends on. Returns whether anything moved."""
    chain = [issue]
    cur = issue.args[0] if issue.args and isinstance(issue.args[0], torch.fx.Node) else None
    while (
        cur is not None and cur.op == "call_function" and len(cur.users) == 1
        and cur.target in _HOISTABLE
    ):
        chain.append(cur)
        nxt = cur.args[0] if cur.args and isinstance(cur.args[0], torch.fx.Node) else None
        cur = nxt
    moved = False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in reversed(chain):  # earliest first
        inputs = node.all_input_nodes
        if not inputs:
            continue
        latest = max(inputs, key=order.__getitem__)
        if latest.op == "placeholder" or order[latest] + 1 >= order[node]:
            continue
        latest.append(node)
        moved = True
        order = {n: i for i, n in enumerate(graph.nodes)}
    return moved


def _on_cpu(issue: torch.fx.Node) -> bool:
    val = issue.args[0].meta.get("val") if issue.args and isinstance(issue.args[0], torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


def _window_all_gathers(graph: torch.fx.Graph, window: int) -> int:
    """Delay each parameter all-gather (with its shard cast, its wait and the views
    before its first real use) to just before the first real use of the parameter
    ``window`` places earlier in use order. Returns how many were moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups = []
    for ag in [n for n in graph.nodes if collective_kind(n) == "all_gather_into_tensor"]:
        chain = shard_chain(ag)
        if chain is None or any(len(c.users) != 1 for c in chain):
            continue
        closure, stack = [ag], [ag]
        while stack:  # wait, hold, slice / view ... up to the first real use
            for u in stack.pop().users:
                if is_wait(u) or u.target is hold or u.target in _WAIT_VIEWS:
                    closure.append(u)
                    stack.append(u)
        users = [u for c in closure for u in c.users if u not in closure]
        if not users:
            continue
        groups.append((min(users, key=order.__getitem__), chain, closure))
    groups.sort(key=lambda g: order[g[0]])
    moved = 0
    for i, (first, chain, closure) in enumerate(groups):
        target = groups[max(i - window, 0)][0]
        order = {n: j for j, n in enumerate(graph.nodes)}
        if order[target] <= order[closure[0]] + 1:
            continue
        for node in sorted(chain + closure, key=order.__getitem__):
            if order[node] < order[target]:
                target.prepend(node)
        moved += 1
    return moved


def overlap_collectives_pass(
    gm: torch.fx.GraphModule, example_inputs=None, max_in_flight: int = 2, cpu_async: bool = False,
    ag_window: int | None = 9,
) -> torch.fx.GraphModule:
    """Sink the wait of every functional collective towards its first use (see the
    module docstring), after issuing every non-all-gather collective as early as its
    input allows. ``max_in_flight`` (>= 1) bounds the pending collectives of one
    kind other than all-gather. ``ag_window`` (>= 0, None: keep the traced issue points):
    parameter all-gathers issued about that many parameters ahead of their use.
    ``cpu_async``: also separate collectives on CPU tensors
    from their waits (off by default, see the module docstring). Stats: ``hoisted``
    (collectives issued earlier),
    ``moved`` (waits moved), ``all_gather`` /
    ``other`` (waits by kind), ``mean_distance`` (nodes between issue and wait after
    the pass, averaged).

    Raises:
        ValueError: ``max_in_flight < 1``.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if ag_window is not None and ag_window < 0:
        raise ValueError(f"ag_window must be >= 0 or None, got {ag_window}")
    graph = gm.graph
    windowed = _window_all_gathers(graph, ag_window) if ag_window is not None else 0
    issues_by_kind = _issues_by_kind(graph)
    hoisted = sum(
        _hoist_collective(graph, n) for k, ns in issues_by_kind.items() if k != "all_gather_into_tensor" for n in ns
    )
    if hoisted:  # issue order changed: re-read it
        issues_by_kind = _issues_by_kind(graph)
    index_in_kind = {n: (k, i) for k, ns in issues_by_kind.items() for i, n in enumerate(ns)}

    waits = [n for n in graph.nodes if is_wait(n) and n.args and isinstance(n.args[0], torch.fx.Node)
             and n.args[0] in index_in_kind]
    moved = 0
    counts = {"all_gather": 0, "other": 0}
    for wait in waits:
        order = {n: i for i, n in enumerate(graph.nodes)}  # positions change as waits move
        issue = wait.args[0]
        kind, i = index_in_kind[issue]
        if not cpu_async and _on_cpu(issue):  # never in flight on CPU (see module docstring)
            if wait.prev is not issue:
                issue.append(wait)
                moved += 1
            continue
        # the wait travels with its single-use view chain (FSDP: slice -> view of the
        # gathered buffer), so it lands before the first real use, not the first view
        chain = [wait]
        while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target in _WAIT_VIEWS:
            chain.append(next(iter(chain[-1].users)))
        users = sorted(chain[-1].users, key=order.__getitem__)
        target = users[0] if users else None
        if kind != "all_gather_into_tensor":
            counts["other"] += 1
            later = issues_by_kind[kind]
            if i + max_in_flight < len(later):
                bound = later[i + max_in_flight]
                if target is None or order[bound] < order[target]:
                    target = bound
        else:
            counts["all_gather"] += 1
        if target is None or order[target] == order[chain[-1]] + 1 or order[target] <= order[issue]:
            continue
        for node in chain:
            target.prepend(node)
        moved += 1
    # every collective whose wait does not follow it at once (moved here, or placed so by
    # an earlier pass, e.g. reshard_after_forward's prefetched re-gathers) holds its input
    for wait in waits:
        issue = wait.args[0]
        if wait.prev is issue or not isinstance(issue.args[0], torch.fx.Node):
            continue
        if any(u.target is hold for u in wait.users):
            continue
        with graph.inserting_after(wait):
            held = graph.call_function(hold, (wait, issue.args[0]))
        held.meta = dict(wait.meta)
        wait.replace_all_uses_with(held, delete_user_cb=lambda u: u is not held)
    graph.lint()
    gm.recompile()
    order = {n: i for i, n in enumerate(graph.nodes)}
    dists = [order[w] - order[w.args[0]] for w in waits]
    mean_d = sum(dists) / len(dists) if dists else 0.0
    set_pass_summary(
        gm,
        f"issued {windowed} parameter all-gather(s) later (window {ag_window}) and "
        f"{hoisted} reduce-scatter(s)/other collectives earlier; "
        f"moved {moved} of {len(waits)} collective waits towards first use "
        f"({counts['all_gather']} all-gather, {counts['other']} other; "
        f"mean issue->wait distance {mean_d:.0f} nodes)" if waits else "no functional collectives",
        moved=moved,
        hoisted=hoisted,
        windowed=windowed,
        mean_distance=round(mean_d, 1),
        **counts,
    )
    return gm


PASS = GraphPass(name="overlap_collectives", fn=overlap_collectives_pass, enabled=lambda ctx: True)
