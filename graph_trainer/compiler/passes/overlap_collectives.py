"""Overlap the in-graph collectives with compute by moving their issues and waits.

As traced, every functional collective is followed at once by its ``wait_tensor``. A parameter all-gather is issued
just before the first use of the parameter ``ag_window`` places earlier, its wait (with its views) at its first real
use; a TP all-gather / reduce-scatter is issued, with the values it reads, ahead of the ``tp_lead`` nearest matmul or
attention ops that do not feed it; every other collective just after its input is produced. Each wait is moved
towards its first user but no later than the issue of the ``max_in_flight``-th next collective of its kind.
Positions only, plus a :func:`~graph_trainer.compiler.collectives.hold` of the input after every moved wait: the same
bits. A collective on CPU (gloo) is never left in flight unless ``cpu_async`` (it corrupted the heap). Not torch's
``schedule_overlap_bucketing``: it raises without a GPU and with one leaves every reduce-scatter in flight to the
end of the backward (tests/passes/test_overlap_collectives.py). Nodes are compared by graph position (``fx.Node``'s
``<``, kept current as nodes move), not by an index of the graph recomputed after every move."""

from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import flop_registry

from graph_trainer.compiler.collectives import (collective_kind, group_name_of, hold, is_collective, is_wait, on_cpu,
                                                read_through, shard_chain)
from graph_trainer.compiler.graph_values import positions
from graph_trainer.compiler.node_meta import set_pass_summary
from graph_trainer.compiler.ops import CAST_OPS, RESHAPE_OPS, SLICE_OPS, aten, is_call, only_user
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
    while chain[-1].args and is_call(cur := chain[-1].args[0], _HOISTABLE) and len(cur.users) == 1:
        chain.append(cur)
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


def _lead_tp_collectives(graph: torch.fx.Graph, group: str, lead: int) -> int:
    """Issue each all-gather / reduce-scatter of the TP group ``group`` before the ``lead`` nearest ops with a FLOP
    formula (``torch.utils.flop_counter``: matmuls, attention) ahead of it that it does not read, with the values it
    reads that are computed after them (a parameter all-gather's wait included), never past another collective or
    wait or an op that mutates; returns how many moved. In the backward: the re-gathered inputs of the weight
    gradients, the reduce-scatters of the input gradients (sums of matmuls), each otherwise issued with nothing left
    to run under it."""
    moved = 0
    for issue in [n for n in graph.nodes if str(group_name_of(n)) == group]:  # its all-gathers and reduce-scatters
        feeds, target, found, cur = {issue}, None, 0, issue.prev
        while found < lead and cur.op == "call_function":
            if any(u in feeds for u in cur.users):
                if (is_collective(cur) and not (is_wait(cur) and shard_chain(cur.args[0]) is not None)
                        or cur.target is hold or getattr(getattr(cur.target, "_schema", None), "is_mutable", False)):
                    break
                feeds.add(cur)
            elif isinstance(cur.target, torch._ops.OpOverload) and cur.target.overloadpacket in flop_registry:
                target, found = cur, found + 1
            cur = cur.prev
        if target is not None:
            for node in sorted(n for n in feeds if n > target):
                target.prepend(node)
            moved += 1
    return moved


def overlap_collectives_pass(gm: torch.fx.GraphModule, example_inputs=None, max_in_flight: int = 2,
                             cpu_async: bool = False, ag_window: int | None = 18,
                             tp_lead: int = 1, tp_group_name: str | None = None) -> torch.fx.GraphModule:
    """Move collective issues and waits so that communication overlaps compute (module docstring).

    ``max_in_flight`` (>= 1): pending collectives of one kind other than all-gather. ``ag_window`` (>= 0; None: keep
    the traced issue points): parameter all-gathers in flight. ``tp_lead`` (>= 0): matmul / attention ops a collective
    of the TP group ``tp_group_name`` (None: no TP) is issued ahead of. ``cpu_async``: also leave collectives on CPU
    tensors in flight. Stats: ``windowed``, ``led`` (TP collectives moved), ``hoisted`` (collectives issued earlier),
    ``moved`` (waits moved), ``all_gather`` / ``other`` (waits by kind), ``mean_distance`` (nodes between issue and
    wait, averaged). Raises ``ValueError`` for ``max_in_flight < 1``, ``ag_window < 0`` or ``tp_lead < 0``."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if ag_window is not None and ag_window < 0:
        raise ValueError(f"ag_window must be >= 0 or None, got {ag_window}")
    if tp_lead < 0:
        raise ValueError(f"tp_lead must be >= 0, got {tp_lead}")
    graph = gm.graph
    windowed = _window_all_gathers(graph, ag_window) if ag_window is not None else 0
    led = _lead_tp_collectives(graph, tp_group_name, tp_lead) if tp_lead and tp_group_name else 0
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
    set_pass_summary(gm, f"issued {windowed} parameter all-gather(s) later (window {ag_window}), {led} TP "
                     f"collective(s) {tp_lead} matmul / attention op(s) ahead and {hoisted} reduce-scatter(s)/other "
                     f"collectives earlier; moved {moved} of {len(waits)} collective waits towards first use "
                     f"({counts['all_gather']} all-gather, {counts['other']} other; mean issue->wait distance "
                     f"{mean_d:.0f} nodes)" if waits else "no functional collectives",
                     moved=moved, hoisted=hoisted, windowed=windowed, led=led, mean_distance=round(mean_d, 1), **counts)
    return gm


@dataclass
class OverlapCollectivesOptions:
    """``[compile.overlap_collectives]``: options of ``overlap_collectives`` (in the default pipeline)."""

    ag_window: int = 18
    """Each FSDP parameter all-gather is issued just before the first use of the parameter this many places
    earlier in use order (18: two Llama3 blocks' parameters ahead; 0: at its own first use). Larger hides a
    slower all-gather under more compute and keeps more gathered parameters alive (18 against 9: faster with NCCL
    at FSDP2×TP2 at the same peak, docs/perf.md). Numerics unchanged."""

    tp_lead: int = 1
    """Each TP all-gather / reduce-scatter is issued, with the values it reads, ahead of this many matmul / attention
    ops that do not feed it (0: just after its input): in the backward the re-gathered activations of
    ``--compile.sac.save all_but_cheap`` and the reduce-scatters of the input gradients, which nothing overlapped.
    Keeps a gathered activation or a matmul output alive longer. Numerics unchanged."""

    def check(self) -> None:
        for name in ("ag_window", "tp_lead"):
            if getattr(self, name) < 0:
                raise ValueError(f"--compile.overlap_collectives.{name} must be >= 0, got {getattr(self, name)}")


PASS = GraphPass(name="overlap_collectives", fn=overlap_collectives_pass, options=OverlapCollectivesOptions,
                 enabled=lambda ctx: True, kwargs=lambda o, ctx: {**asdict(o), "tp_group_name": ctx.tp_group_name})
