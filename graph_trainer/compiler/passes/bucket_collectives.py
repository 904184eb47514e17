"""Bucket the traced FSDP collectives, after ``overlap_collectives`` placed them: one all-gather / reduce-scatter
per ``bucket_size`` parameters instead of one per parameter (many small NCCL kernels slow the overlapped matmuls).

Matches: functional all-gather / reduce-scatter issues with a 1-D input (FSDP's), each with one wait (and its
``hold``). Runs of up to ``bucket_size`` consecutive issues of one kind, group, dtype (and reduce op) whose results
are first read after the bucket's wait form a bucket: ``cat`` -> one all-gather -> :func:`unbucket_all_gather` at the
first member's issue, waited at the earliest member wait; torch's ``merge_reduce_scatter_bucket`` after the last
member's issue, waited at the last member wait. The same bits, except NCCL's summation order with more than 2 ranks
(under ``--debug.deterministic`` the reduce-scatter buckets are FSDP2's units). Not torch's ``bucket_all_gather`` /
``bucket_reduce_scatter``: they put each bucket's wait right behind its last member, un-overlapping the placed
graph; ``OverlapPreservingBucketer`` merges almost nothing with our prefetch windows
(tests/passes/test_bucket_collectives.py)."""

import contextlib
import operator
from typing import Any

import torch

from graph_trainer.compiler.collectives import collective_kind, hold, is_wait, on_cpu, read_through, sole_wait
from graph_trainer.compiler.graph_values import positions, tensor_val
from graph_trainer.compiler.node_meta import custom_meta, set_pass_summary
from graph_trainer.compiler.ops import VIEW_OPS, aten
from graph_trainer.compiler.registry import GraphPass, PassContext

_c10d = torch.ops._c10d_functional
_KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor")


@torch.library.custom_op("graph_trainer::unbucket_all_gather", mutates_args=())
def unbucket_all_gather(gathered: torch.Tensor, world: int, sizes: list[int]) -> list[torch.Tensor]:
    """Copy each member out of a bucketed all-gather result ``gathered`` (``[world * sum(sizes)]``, rank-major;
    ``world`` ranks, ``sizes``: elements per rank of each member) into a new ``[world * sizes[i]]`` rank-major tensor
    each, as FSDP2's ``split_with_sizes_copy``. Opaque so that Inductor gives each output its own buffer and the
    bucket buffer dies here."""
    outs = [gathered.new_empty(world * s) for s in sizes]
    views = [o.view(world, s) for o, s in zip(outs, sizes)]
    torch.split_with_sizes_copy(gathered.view(world, -1), sizes, dim=1, out=views)
    return outs


@unbucket_all_gather.register_fake
def _(gathered, world, sizes):
    return [gathered.new_empty(world * s) for s in sizes]


def _member(issue: torch.fx.Node):
    """``(issue, wait, hold_or_None)`` for a bucketable collective, else ``None``."""
    wait, val = sole_wait(issue), tensor_val(issue.args[0])
    if wait is None or val is None or val.dim() != 1:
        return None
    holds = [u for u in wait.users if u.target is hold]
    if len(holds) > 1 or (holds and len(wait.users) != 1):
        return None
    return issue, wait, (holds[0] if holds else None)


def _key(issue: torch.fx.Node):
    """Kind, the arguments after the input (group size and name; reduce op) and the dtype."""
    return (collective_kind(issue), *issue.args[1:], issue.args[0].meta["val"].dtype)


def _call(graph, target, args, meta_from):
    """A new node ``target(*args)`` with ``meta_from``'s custom metadata and, where computable, its fake value."""
    node = graph.call_function(target, args)
    node.meta["custom"] = dict(custom_meta(meta_from))
    a = torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))
    vals = [v for v in torch.utils._pytree.tree_leaves(a) if isinstance(v, torch.Tensor)]
    mode = getattr(vals[0], "fake_mode", None) if vals else None
    if vals and (mode is not None or all(v.device.type == "meta" for v in vals)):
        with contextlib.suppress(Exception), mode if mode is not None else contextlib.nullcontext():
            node.meta["val"] = target(*a)
    return node


def _movable_chain(x: torch.fx.Node, before: int, pos) -> list[torch.fx.Node] | None:
    """``x`` and its inputs from position ``before`` on, each a call_function used once; else None."""
    chain, stack = [], [x]
    while stack:
        n = stack.pop()
        if pos[n] < before:
            continue
        users = [u for u in n.users if u.target is not hold]
        if n.op != "call_function" or len(users) != 1 or collective_kind(n) or is_wait(n):
            return None
        chain.append(n)
        stack.extend(n.all_input_nodes)
    return sorted(chain, key=pos.__getitem__)


def _bucket_all_gather(graph, members) -> None:
    """Replace the all-gathers ``members`` (``(issue, wait, hold)`` s) by one."""
    first_issue = members[0][0]
    pos = positions(graph)
    for issue, _, _ in members[1:]:  # shard casts defined later move up to the bucket's issue
        for n in _movable_chain(issue.args[0], pos[first_issue], pos) or []:
            first_issue.prepend(n)
    w, group = first_issue.args[1], first_issue.args[2]
    sizes = [m[0].args[0].meta["val"].numel() for m in members]
    with graph.inserting_before(first_issue):
        flat = _call(graph, aten.cat.default, ([m[0].args[0] for m in members],), first_issue)
        ag = _call(graph, _c10d.all_gather_into_tensor.default, (flat, w, group), first_issue)
    first_wait = min((m[1] for m in members), key=positions(graph).__getitem__)
    with graph.inserting_before(first_wait):
        out = _call(graph, _c10d.wait_tensor.default, (ag,), first_wait)
        if any(m[2] is not None for m in members):
            out = _call(graph, hold, (out, flat), first_wait)
        parts = _call(graph, torch.ops.graph_trainer.unbucket_all_gather.default, (out, w, sizes), first_wait)
        results = [_call(graph, operator.getitem, (parts, i), first_wait) for i in range(len(members))]
    for (issue, wait, hld), res in zip(members, results):  # every use of a member's result
        (hld or wait).replace_all_uses_with(res)
        for n in (hld, wait, issue):
            if n is not None:
                graph.erase_node(n)


def _bucket_reduce_scatter(graph, members) -> None:
    """Replace the reduce-scatters ``members`` by one (torch's ``merge_reduce_scatter_bucket``)."""
    from torch._inductor.fx_passes.bucketing import merge_reduce_scatter_bucket

    held = any(m[2] is not None for m in members)
    for _, wait, hld in members:  # torch replaces the waits' uses: read the waits, not the holds
        if hld is not None:
            hld.replace_all_uses_with(wait)
            graph.erase_node(hld)
    pos = positions(graph)
    last_issue = max((m[0] for m in members), key=pos.__getitem__)
    last_wait = max((m[1] for m in members), key=pos.__getitem__)
    new_nodes, _ = merge_reduce_scatter_bucket(graph, [m[0] for m in members], "default",
                                               insert_before=last_issue.next, wait_insertion_point=last_wait.next)
    if held:  # the bucket buffer lives until the wait, as each member's input did
        wait = next(n for n in new_nodes if is_wait(n))
        with graph.inserting_after(wait):
            kept = graph.call_function(hold, (wait, wait.args[0].args[0]))
        kept.meta = dict(wait.meta)
        wait.replace_all_uses_with(kept, delete_user_cb=lambda u: u is not kept)


def _runs(graph: torch.fx.Graph, kind: str, bucket_size: int) -> list[list[tuple]]:
    """Buckets (of >= 2) of consecutive bucketable issues of ``kind`` with one key."""
    pos = positions(graph)
    issues = [m for n in graph.nodes if collective_kind(n) == kind and (m := _member(n)) is not None]
    runs: list[list[tuple]] = []
    for m in issues:
        cur = runs[-1] if runs else None
        if cur and len(cur) < bucket_size and _key(cur[0][0]) == _key(m[0]) and _fits(cur + [m], kind, pos):
            cur.append(m)
        else:
            runs.append([m])
    return [r for r in runs if len(r) > 1]


def _grad_index(wait: torch.fx.Node) -> int | None:
    """The parameter index whose gradient ``wait`` (a reduce-scatter's) becomes, through single-user nodes."""
    node = wait
    for _ in range(8):
        users = list(node.users)
        if len(users) != 1:
            return None
        if users[0].op == "output":
            outs = list(users[0].args[0])
            return outs.index(node) - 1 if outs.count(node) == 1 and outs.index(node) > 0 else None
        node = users[0]
    return None


def _unit_runs(graph: torch.fx.Graph, units) -> list[list[tuple]]:
    """Reduce-scatter buckets (of >= 2) of FSDP2's units of the ``BlockLayout`` ``units`` (the parameters before the
    first block, each block, the rest), in parameter order; a unit that cannot form one bucket stays unbucketed."""
    pos = positions(graph)
    first = units.params_before

    def unit(i: int) -> int:
        return -1 if i < first else min((i - first) // max(units.params_per_block, 1), units.n_blocks)

    by_unit: dict[int, list[tuple[int, tuple]]] = {}
    for n in graph.nodes:
        if collective_kind(n) == "reduce_scatter_tensor" and (m := _member(n)) is not None:
            if (i := _grad_index(m[2] or m[1])) is not None:
                by_unit.setdefault(unit(i), []).append((i, m))
    runs = []
    for members in by_unit.values():
        run = [m for _, m in sorted(members, key=lambda x: x[0])]
        if len(run) > 1 and len({_key(m[0]) for m in run}) == 1 and _fits(run, "reduce_scatter_tensor", pos):
            runs.append(run)
    return runs


def _fits(members, kind, pos) -> bool:
    """Can ``members`` form one bucket without reading a result before its wait?"""
    if kind == "all_gather_into_tensor":
        first_issue = members[0][0]
        for issue, _, _ in members[1:]:
            x = issue.args[0]
            if pos[x] >= pos[first_issue] and _movable_chain(x, pos[first_issue], pos) is None:
                return False
        return True
    last_issue = max(pos[m[0]] for m in members)
    last_wait = max(pos[m[1]] for m in members)
    for issue, wait, hld in members:
        if pos[issue.args[0]] > last_issue:
            return False
        if any(pos[u] <= last_wait for u in (hld or wait).users):
            return False  # a result read before the bucket's wait
    return True


_RESULT_VIEWS = VIEW_OPS | {aten.split_with_sizes.default, aten.split.Tensor, operator.getitem}


def _defer_reduce_scatter_waits(graph: torch.fx.Graph, in_flight: int, cpu_async: bool) -> int:
    """Move each FSDP reduce-scatter's wait (with its ``hold`` and result views) later, to just before the issue of
    the ``in_flight``-th next one or its first real reader; returns how many moved. CPU ones only with ``cpu_async``."""
    issues = [n for n in graph.nodes if collective_kind(n) == "reduce_scatter_tensor"
              and (v := tensor_val(n.args[0])) is not None and v.dim() == 1]  # FSDP's, not TP's
    moved = 0
    for i, issue in enumerate(issues):
        wait = sole_wait(issue)
        if wait is None or (not cpu_async and on_cpu(issue)):
            continue
        chain = read_through(wait, _RESULT_VIEWS)  # the wait, its hold and views, up to the real readers
        chain.sort()  # fx nodes compare by graph position
        readers = [u for c in chain for u in c.users if u not in chain]
        target = min(readers + ([issues[i + in_flight]] if i + in_flight < len(issues) else []), default=None)
        if target is None or target <= chain[-1].next or any(
                a >= target for c in chain for a in c.all_input_nodes if a not in chain):
            continue
        for node in chain:
            target.prepend(node)
        moved += 1
    return moved


def bucket_collectives_pass(gm: torch.fx.GraphModule, example_inputs=None, bucket_size: int = 9, fsdp2_units=None,
                            reduce_scatter_in_flight: int = 0, cpu_async: bool = False) -> torch.fx.GraphModule:
    """Bucket consecutive FSDP all-gathers and reduce-scatters (module docstring).

    ``bucket_size`` (>= 1): most collectives per bucket. ``fsdp2_units``: a ``BlockLayout``: the reduce-scatters
    bucketed by FSDP2's units instead. ``reduce_scatter_in_flight`` (>= 0): when > 0, each reduce-scatter (bucket)
    is waited just before the issue of the N-th next one or its first reader (0: at its last member's wait);
    ``cpu_async``: that also on CPU. Stats: ``all_gather_before`` / ``_after``, ``reduce_scatter_before`` /
    ``_after``, ``reduce_scatter_waits_deferred``. Raises ``ValueError`` for ``bucket_size < 1`` or
    ``reduce_scatter_in_flight < 0``."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    if reduce_scatter_in_flight < 0:
        raise ValueError(f"reduce_scatter_in_flight must be >= 0, got {reduce_scatter_in_flight}")
    graph = gm.graph
    ag, rs = _KINDS
    before = {k: sum(1 for n in graph.nodes if collective_kind(n) == k) for k in _KINDS}
    if bucket_size > 1 or fsdp2_units is not None:
        for run in _runs(graph, ag, bucket_size) if bucket_size > 1 else []:
            _bucket_all_gather(graph, run)
        for run in _unit_runs(graph, fsdp2_units) if fsdp2_units is not None else _runs(graph, rs, bucket_size):
            _bucket_reduce_scatter(graph, run)
    deferred = (_defer_reduce_scatter_waits(graph, reduce_scatter_in_flight, cpu_async)
                if reduce_scatter_in_flight else 0)
    later = f"; {deferred} reduce-scatter wait(s) moved to <= {reduce_scatter_in_flight} in flight" if deferred else ""
    graph.lint()
    gm.recompile()
    after = {k: sum(1 for n in graph.nodes if collective_kind(n) == k) for k in _KINDS}
    rs_how = "FSDP2's units" if fsdp2_units is not None else f"<= {bucket_size}"
    set_pass_summary(
        gm, f"all-gathers {before[ag]} -> {after[ag]} (buckets of <= {bucket_size}), reduce-scatters {before[rs]} -> "
            f"{after[rs]} (buckets of {rs_how}, merged by torch's merge_reduce_scatter_bucket){later}",
        all_gather_before=before[ag], all_gather_after=after[ag],
        reduce_scatter_before=before[rs], reduce_scatter_after=after[rs], reduce_scatter_waits_deferred=deferred)
    return gm


def _bucket_blocks(ctx: PassContext) -> int:
    """The memory policy's choice, else ``[compile.fsdp] bucket_blocks`` (-1: auto, on)."""
    return ctx.levers.bucket_blocks if ctx.levers is not None else ctx.compile_cfg.fsdp.bucket_blocks


def _kwargs(options: None, ctx: PassContext) -> dict[str, Any]:
    """``bucket_size`` from the blocks per bucket, ``fsdp2_units``, the in-flight bound; ``ValueError`` w/o layout."""
    blocks = _bucket_blocks(ctx)
    extra = {"fsdp2_units": ctx.layout} if ctx.deterministic and ctx.layout is not None else {}
    if in_flight := ctx.compile_cfg.fsdp.reduce_scatter_in_flight:
        extra["reduce_scatter_in_flight"] = in_flight
    if blocks <= 0:
        return {"bucket_size": 1, **extra} if blocks == 0 else extra
    if ctx.layout is None:
        raise ValueError("--compile.fsdp.bucket_blocks needs the model's block layout")
    return {"bucket_size": blocks * ctx.layout.params_per_block, **extra}


PASS = GraphPass(name="bucket_collectives", fn=bucket_collectives_pass, kwargs=_kwargs,
                 enabled=lambda ctx: _bucket_blocks(ctx) != 0 or (ctx.deterministic and ctx.layout is not None))
