"""Overlap the in-graph FSDP collectives with compute by moving their issues and waits.

As traced, every functional collective is followed at once by its ``wait_tensor``. A parameter all-gather is issued
just before the first use of the parameter ``ag_window`` places earlier, its wait (with its views) at its first real
use; every other collective is issued just after its input is produced, its wait moved towards its first user but no
later than the issue of the ``max_in_flight``-th next one of its kind. Positions only, plus a
:func:`~graph_trainer.compiler.collectives.hold` of the input after every moved wait: the same bits. A collective on
CPU (gloo) is never left in flight unless ``cpu_async`` (it corrupted the heap). Not torch's
``schedule_overlap_bucketing``: it raises without a GPU and with one leaves every reduce-scatter in flight to the
end of the backward (tests/passes/test_overlap_collectives.py). Nodes are compared by graph position (``fx.Node``'s
``<``, kept current as nodes move), not by an index of the graph recomputed after every move."""

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import flop_registry

from graph_trainer.compiler.collectives import collective_kind, hold, is_wait, on_cpu, read_through, shard_chain
from graph_trainer.compiler.graph_values import positions
from graph_trainer.compiler.node_meta import set_pass_summary
from graph_trainer.compiler.ops import CAST_OPS, RESHAPE_OPS, SLICE_OPS, aten, only_user
from graph_trainer.compiler.passes.sac_recompute import RECOMPUTED_FROM_KEY
from graph_trainer.compiler.registry import GraphPass

# The cast / view / pad chain of a gradient, hoisted with its reduce-scatter.
_HOISTABLE = CAST_OPS | RESHAPE_OPS | {aten.t.default, aten.permute.default, aten.clone.default,
                                      aten.constant_pad_nd.default, aten.pad.default}

# Views that move with the wait whose output they view (FSDP: slice -> view of the gathered buffer).
_WAIT_VIEWS = RESHAPE_OPS | SLICE_OPS


def _issues_by_kind(graph: torch.fx.Graph) -> dict[str, list[torch.fx.Node]]:
    out: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if (kind := collective_kind(node)) is not None:
            out.setdefault(kind, []).append(node)
    return out


def _hoist_collective(issue: torch.fx.Node) -> bool:
    """Move ``issue`` and its single-use cast / view / pad chain up to its inputs; returns whether anything moved."""
    chain = [issue]
    cur = issue.args[0] if issue.args and isinstance(issue.args[0], torch.fx.Node) else None
    while cur is not None and cur.op == "call_function" and len(cur.users) == 1 and cur.target in _HOISTABLE:
        chain.append(cur)
        cur = cur.args[0] if cur.args and isinstance(cur.args[0], torch.fx.Node) else None
    moved = False
    for node in reversed(chain):  # earliest first
        latest = max(node.all_input_nodes, default=None)
        if latest is not None and latest.op != "placeholder" and latest.next is not node:
            latest.append(node)
            moved = True
    return moved


def _window_all_gathers(graph: torch.fx.Graph, window: int) -> int:
    """Move each parameter all-gather (with its shard cast, wait and views) to just before the
    first real use of the parameter ``window`` places earlier in use order; returns how many."""
    groups = []
    for ag in [n for n in graph.nodes if collective_kind(n) == "all_gather_into_tensor"]:
        chain = shard_chain(ag)
        if chain is None or any(len(c.users) != 1 for c in chain):
            continue
        closure = read_through(ag, _WAIT_VIEWS)  # wait, hold, slice / view ... up to the first real use
        users = [u for c in closure for u in c.users if u not in closure]
        if not users:
            continue
        groups.append((min(users), chain, closure))
    groups.sort(key=lambda g: g[0])
    moved = 0
    for i, (first, chain, closure) in enumerate(groups):
        target = groups[max(i - window, 0)][0]
        if target <= closure[0].next:
            continue
        for node in sorted(chain + closure):
            if node < target:
                target.prepend(node)
        moved += 1
    return moved


def _lead_recomputed_gathers(graph: torch.fx.Graph, lead: int) -> int:
    """Move each recomputed all-gather (``RECOMPUTED_FROM_KEY``), with the recomputed values it reads, before the
    ``lead``-th op with a FLOP formula (``torch.utils.flop_counter``: matmuls, attention) ahead of its wait, past
    none of the values it reads that were not recomputed; returns how many moved."""
    moved = 0
    for ag in [n for n in graph.nodes
               if collective_kind(n) == "all_gather_into_tensor" and RECOMPUTED_FROM_KEY in n.meta]:
        chain, floor, todo = {ag}, None, [ag]
        while todo:
            for a in todo.pop().all_input_nodes:
                if a.op == "call_function" and RECOMPUTED_FROM_KEY in a.meta:
                    if a not in chain:
                        chain.add(a)
                        todo.append(a)
                elif floor is None or a > floor:
                    floor = a
        target, found, cur = None, 0, ag.prev
        while found < lead and cur.op != "root" and (floor is None or cur > floor):
            if cur not in chain and isinstance(cur.target, torch._ops.OpOverload) and (
                    cur.target.overloadpacket in flop_registry):
                target, found = cur, found + 1
            cur = cur.prev
        if target is None:
            continue
        for node in sorted(n for n in chain if n > target):
            target.prepend(node)
        moved += 1
    return moved


def overlap_collectives_pass(gm: torch.fx.GraphModule, example_inputs=None, max_in_flight: int = 2,
                             cpu_async: bool = False, ag_window: int | None = 18,
                             regather_lead: int = 1) -> torch.fx.GraphModule:
    """Move collective issues and waits so that communication overlaps compute (module docstring).

    ``max_in_flight`` (>= 1): pending collectives of one kind other than all-gather. ``ag_window`` (>= 0; None: keep
    the traced issue points): parameter all-gathers in flight. ``regather_lead`` (>= 0): matmul / attention ops a
    recomputed all-gather is issued ahead of. ``cpu_async``: also leave collectives on CPU tensors in flight. Stats:
    ``windowed``, ``led`` (recomputed all-gathers moved), ``hoisted`` (collectives issued earlier), ``moved`` (waits
    moved), ``all_gather`` / ``other`` (waits by kind), ``mean_distance`` (nodes between issue and wait, averaged).
    Raises ``ValueError`` for ``max_in_flight < 1``, ``ag_window < 0`` or ``regather_lead < 0``."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if ag_window is not None and ag_window < 0:
        raise ValueError(f"ag_window must be >= 0 or None, got {ag_window}")
    if regather_lead < 0:
        raise ValueError(f"regather_lead must be >= 0, got {regather_lead}")
    graph = gm.graph
    windowed = _window_all_gathers(graph, ag_window) if ag_window is not None else 0
    led = _lead_recomputed_gathers(graph, regather_lead) if regather_lead else 0
    issues_by_kind = _issues_by_kind(graph)
    hoisted = sum(_hoist_collective(n) for k, ns in issues_by_kind.items() if k != "all_gather_into_tensor" for n in ns)
    if hoisted:  # issue order changed: re-read it
        issues_by_kind = _issues_by_kind(graph)
    index_in_kind = {n: (k, i) for k, ns in issues_by_kind.items() for i, n in enumerate(ns)}

    waits = [n for n in graph.nodes if is_wait(n) and n.args and isinstance(n.args[0], torch.fx.Node)
             and n.args[0] in index_in_kind]
    moved, counts = 0, {"all_gather": 0, "other": 0}
    for wait in waits:
        issue = wait.args[0]
        kind, i = index_in_kind[issue]
        if not cpu_async and on_cpu(issue):  # never in flight on CPU (module docstring)
            if wait.prev is not issue:
                issue.append(wait)
                moved += 1
            continue
        chain = [wait]  # with its single-use view chain: it lands before the first real use
        while (view := only_user(chain[-1])) is not None and view.target in _WAIT_VIEWS:
            chain.append(view)
        target = min(chain[-1].users, default=None)
        counts["all_gather" if kind == "all_gather_into_tensor" else "other"] += 1
        if kind != "all_gather_into_tensor" and i + max_in_flight < len(issues_by_kind[kind]):
            bound = issues_by_kind[kind][i + max_in_flight]
            target = bound if target is None or bound < target else target
        if target is None or target is chain[-1].next or target <= issue:
            continue
        for node in chain:
            target.prepend(node)
        moved += 1
    for wait in waits:  # every wait not right after its collective (moved here or before) holds its input
        issue = wait.args[0]
        if wait.prev is issue or not isinstance(issue.args[0], torch.fx.Node) or hold in {u.target for u in wait.users}:
            continue
        with graph.inserting_after(wait):
            held = graph.call_function(hold, (wait, issue.args[0]))
        held.meta = dict(wait.meta)
        wait.replace_all_uses_with(held, delete_user_cb=lambda u: u is not held)
    graph.lint()
    gm.recompile()
    order = positions(graph)
    dists = [order[w] - order[w.args[0]] for w in waits]
    mean_d = sum(dists) / len(dists) if dists else 0.0
    set_pass_summary(
        gm, f"issued {windowed} parameter all-gather(s) later (window {ag_window}), {led} recomputed all-gather(s) "
        f"{regather_lead} matmul / attention op(s) ahead and {hoisted} reduce-scatter(s)/other collectives earlier; "
        f"moved {moved} of {len(waits)} collective waits towards first use "
        f"({counts['all_gather']} all-gather, {counts['other']} other; mean issue->wait distance {mean_d:.0f} nodes)"
        if waits else "no functional collectives",
        moved=moved, hoisted=hoisted, windowed=windowed, led=led, mean_distance=round(mean_d, 1), **counts,
    )
    return gm


@dataclass
class OverlapCollectivesOptions:
    """``[compile.overlap_collectives]``: options of ``overlap_collectives`` (in the default pipeline)."""

    ag_window: int = 18
    """Each FSDP parameter all-gather is issued just before the first use of the parameter this many places
    earlier in use order (18: two Llama3 blocks' parameters ahead; 0: at its own first use). Larger hides a
    slower all-gather under more compute and keeps more gathered parameters alive (18 against 9: faster with NCCL
    at FSDP2×TP2 at the same peak, docs/perf.md). Numerics unchanged."""

    regather_lead: int = 1
    """An all-gather that SAC recomputes in the backward (``--compile.sac.save all_but_cheap``: TP's gathered
    activations) is issued, with the recomputed norm it gathers, before this many matmul / attention ops ahead of
    its first use (0: just before that use). It keeps one gathered activation alive longer. Numerics unchanged."""

    def check(self) -> None:
        for name in ("ag_window", "regather_lead"):
            if getattr(self, name) < 0:
                raise ValueError(f"--compile.overlap_collectives.{name} must be >= 0, got {getattr(self, name)}")


PASS = GraphPass(name="overlap_collectives", fn=overlap_collectives_pass, options=OverlapCollectivesOptions,
                 enabled=lambda ctx: True)
