"""Bucket the traced FSDP collectives: one all-gather / reduce-scatter per group of
parameters instead of one per parameter, after ``overlap_collectives`` placed them.

Why: traceable FSDP (:mod:`graph_trainer.distributed.fsdp`) issues one collective per parameter
(9 per Llama3 block), where FSDP2 issues one per block. Each NCCL kernel holds SMs
while it runs, so many small collectives overlapped with the matmuls slow them down
(docs/perf.md, "bucketed collectives and kept blocks in full-graph Inductor"). The
pipeline adds this pass with ``--compile.fsdp.bucket_blocks B`` (``bucket_size`` = B
blocks' collectives).

Matches: ``_c10d_functional.all_gather_into_tensor`` and ``reduce_scatter_tensor`` issue
nodes with a 1-D input (FSDP shards and flat padded gradients; TP's collectives on
activations are N-D and left alone), each with its one ``wait_tensor`` (and the ``hold``
that ``overlap_collectives`` puts after a moved wait). Runs of up to ``bucket_size``
consecutive issues (graph order) of the same kind, process group, dtype (and reduce op)
form a bucket.

Changes, per bucket of ``n`` collectives of a ``W``-rank group:

* **all-gather** (issued where the first member was issued, waited where the earliest
  member wait was): ``cat`` of the ``n`` shards -> one all-gather -> the ``[W * S]``
  result copied out, by :func:`unbucket_all_gather` (one op, opaque to Inductor), to the
  ``[W * chunk]`` rank-major layout each member produced. Bit for bit the same values;
  one extra copy of the gathered bytes (FSDP2's ``split_with_sizes_copy``). Member shard
  casts defined after the bucket's issue point are moved up to it (they depend only on
  placeholders); a member whose input cannot move ends the bucket.
* **reduce-scatter** (issued where the last member was, once every gradient exists;
  waited where the last member wait was): torch's
  ``torch._inductor.fx_passes.bucketing.merge_reduce_scatter_bucket`` builds it: the
  ``n`` flat gradients viewed ``[W, chunk]``, concatenated along dim 1 (rank-major, so
  rank ``r`` gets its chunk of every member) -> one reduce-scatter -> split into the
  members' ``[chunk]`` results (views); this pass tells it where to issue and where to
  wait, and holds the bucket buffer until the wait. The members' gradient buffers die at
  the ``cat``; one bucket buffer stays alive until the wait. Each element is reduced by
  the same op over the same ranks; NCCL may order a sum differently for a different
  message size, so only the 2-rank case (``a + b``) is exact by construction.

A bucket whose members' results are read before the new wait position is split there.
``bucket_size`` 1 or a graph without such collectives: unchanged. Numerics: the same bits
(bucketing copies bytes; the tests compare whole steps bit for bit).

What stays ours, and why (tests/passes/test_bucket_collectives.py shows each on the traced
step, with torch 2.11 and 2.13):

* **Which collectives form a bucket, and where it is issued and waited.** This pass runs
  after ``overlap_collectives`` has placed every issue and wait. torch's
  ``bucket_all_gather`` / ``bucket_reduce_scatter`` (greedy, by wait order, capped in MB by
  a size determinator) insert each bucket after its last member's issue with the wait
  right behind it: on our graphs the first members' readers then come before the values
  they read: the graph fails ``lint`` (torch 2.13 re-sorts a reduce-scatter bucket's
  region so that it lints; each bucket's wait then follows its issue, and the overlap
  ``overlap_collectives`` placed is gone). torch's
  ``OverlapPreservingBucketer`` (``overlap_preserving_bucketer``, built for graphs that
  torch's own scheduler placed) keeps every collective's hiding interval, so with our
  prefetch windows it merges almost nothing. And ``bucket_size`` counts collectives (the
  pipeline: blocks x parameters per block; tests/test_fsdp.py checks ``ceil(n / 4)``
  reduce-scatters for ``bucket_size`` 4), which no cap in MB reproduces: parameters of
  one block differ in size.
* **The all-gather merge** (:func:`unbucket_all_gather`). torch's
  ``merge_all_gather_bucket`` gathers into a preallocated buffer with
  ``all_gather_into_tensor_out`` (after ``_foreach_copy_`` / ``copy_`` of the shards into
  a rank-specific slice), a collective kind that ``reshard_after_forward``, the memory
  policy and the cost model do not count as an all-gather (the cost model has no formula
  for it); it hands the members back as views of the bucket (``split`` + ``reshape``), and
  torch 2.11 ignores its ``insert_before``.
"""

from __future__ import annotations

import contextlib
import operator

from typing import Any

import torch
import torch.fx

from torch._inductor.fx_passes.bucketing import merge_reduce_scatter_bucket

from graph_trainer.compiler.common import collective_kind, custom_meta, hold, is_wait, set_pass_summary
from graph_trainer.compiler.registry import GraphPass, PassContext

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor")


@torch.library.custom_op("graph_trainer::unbucket_all_gather", mutates_args=())
def unbucket_all_gather(gathered: torch.Tensor, world: int, sizes: list[int]) -> list[torch.Tensor]:
    """Copy each member out of a bucketed all-gather result, as FSDP2's
    ``split_with_sizes_copy`` does.

    Args:
        gathered: ``[world * sum(sizes)]``, rank-major: rank ``r``'s bucket (its shards
            of every member, concatenated) at ``[r * sum(sizes), (r + 1) * sum(sizes))``.
        world: number of ranks of the all-gather.
        sizes: each member's shard size (elements per rank).

    Returns:
        One new ``[world * sizes[i]]`` tensor per member, rank-major, the layout the
        member's own all-gather produced; same dtype and device as ``gathered``.

    An opaque op on purpose: Inductor realizes its outputs as buffers of their own, so
    the bucket buffer dies here. With plain ``split`` + ``clone``, Inductor inlined the
    copy of pointwise-read members (the norm weights) into their backward consumers and
    kept the whole bucket alive next to the copied matmul weights; with parameters kept
    unsharded for the backward (``--compile.fsdp.keep_last_blocks``, or no
    ``reshard_after_forward``) that is twice their bytes.
    """
    outs = [gathered.new_empty(world * s) for s in sizes]
    torch.split_with_sizes_copy(gathered.view(world, -1), sizes, dim=1, out=[o.view(world, s) for o, s in zip(outs, sizes)])
    return outs


@unbucket_all_gather.register_fake
def _(gathered, world, sizes):
    return [gathered.new_empty(world * s) for s in sizes]


def _member(issue: torch.fx.Node):
    """``(issue, wait, hold_or_None)`` for a bucketable collective, else ``None``."""
    waits = [u for u in issue.users if is_wait(u)]
    if len(waits) != 1 or len(issue.users) != 1:
        return None
    x = issue.args[0]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 1:
        return None
    wait = waits[0]
    holds = [u for u in wait.users if u.target is hold]
    if len(holds) > 1 or (holds and len(wait.users) != 1):
        return None
    return issue, wait, (holds[0] if holds else None)


def _key(issue: torch.fx.Node):
    x = issue.args[0]
    if collective_kind(issue) == "all_gather_into_tensor":  # (input, group_size, group_name)
        return ("ag", issue.args[1], issue.args[2], x.meta["val"].dtype)
    return ("rs", issue.args[1], issue.args[2], issue.args[3], x.meta["val"].dtype)  # (input, op, size, name)


def _val(target, args, kwargs=None):
    """Fake value of ``target(*args)`` from the args' ``meta["val"]`` (None if unavailable)."""
    a = torch.fx.node.map_arg(args, lambda n: n.meta.get("val"))
    k = torch.fx.node.map_arg(kwargs or {}, lambda n: n.meta.get("val"))
    vals = [v for v in torch.utils._pytree.tree_leaves((a, k)) if isinstance(v, torch.Tensor)]
    if not vals:
        return None
    mode = getattr(vals[0], "fake_mode", None)
    if mode is None and not all(v.device.type == "meta" for v in vals):
        return None
    try:
        with mode if mode is not None else contextlib.nullcontext():  # fake, or the dry run's meta tensors
            return target(*a, **k)
    except Exception:  # no meta kernel: leave the node without a value
        return None


def _call(graph, target, args, meta_from, kwargs=None):
    node = graph.call_function(target, args, kwargs or {})
    node.meta["custom"] = dict(custom_meta(meta_from))
    val = _val(target, args, kwargs)
    if val is not None:
        node.meta["val"] = val
    return node


def _pos(graph):
    return {n: i for i, n in enumerate(graph.nodes)}


def _movable_chain(x: torch.fx.Node, before: int, pos) -> list[torch.fx.Node] | None:
    """Nodes to move so that ``x`` is defined before position ``before``: ``x`` and its
    inputs defined at or after ``before``, all call_functions with one user besides
    ``hold``s (the shard cast chain; ``overlap_collectives``' keep-alive ``hold`` of the
    wait also reads it, and comes later); None when that is not the case."""
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


def _bucket_all_gather(graph, members) -> int:
    """Replace the all-gathers ``members`` by one; returns the number replaced."""
    first_issue = members[0][0]
    pos = _pos(graph)
    for issue, _, _ in members[1:]:  # shard casts defined later move up to the bucket's issue
        for n in _movable_chain(issue.args[0], pos[first_issue], pos) or []:
            first_issue.prepend(n)
    w, group = first_issue.args[1], first_issue.args[2]
    sizes = [m[0].args[0].meta["val"].numel() for m in members]
    with graph.inserting_before(first_issue):
        flat = _call(graph, aten.cat.default, ([m[0].args[0] for m in members],), first_issue)
        ag = _call(graph, _c10d.all_gather_into_tensor.default, (flat, w, group), first_issue)
    pos = _pos(graph)
    first_wait = min((m[1] for m in members), key=pos.__getitem__)
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
    return len(members)


def _bucket_reduce_scatter(graph, members) -> int:
    """Replace the reduce-scatters ``members`` by one, built by torch's
    ``merge_reduce_scatter_bucket``: issued just after the last member's issue, its wait
    and split moved to just after the last member's wait; returns the number replaced."""
    held = any(m[2] is not None for m in members)
    for _, wait, hld in members:  # torch replaces the waits' uses: read the waits, not the holds
        if hld is not None:
            hld.replace_all_uses_with(wait)
            graph.erase_node(hld)
    pos = _pos(graph)
    last_issue = max((m[0] for m in members), key=pos.__getitem__)
    last_wait = max((m[1] for m in members), key=pos.__getitem__)
    new_nodes, _ = merge_reduce_scatter_bucket(
        graph, [m[0] for m in members], "default", insert_before=last_issue.next, wait_insertion_point=last_wait.next,
    )
    if held:  # the bucket buffer lives until the wait, as each member's input did
        wait = next(n for n in new_nodes if is_wait(n))
        with graph.inserting_after(wait):
            kept = graph.call_function(hold, (wait, wait.args[0].args[0]))
        kept.meta = dict(wait.meta)
        wait.replace_all_uses_with(kept, delete_user_cb=lambda u: u is not kept)
    return len(members)


def _runs(graph: torch.fx.Graph, kind: str, bucket_size: int) -> list[list[tuple]]:
    """Buckets of consecutive bucketable issues of ``kind`` with one key, <= bucket_size,
    whose members' results are first read after the bucket's wait point."""
    pos = _pos(graph)
    issues = [m for n in graph.nodes if collective_kind(n) == kind and (m := _member(n)) is not None]
    runs: list[list[tuple]] = []
    for m in issues:
        cur = runs[-1] if runs else None
        if cur and len(cur) < bucket_size and _key(cur[0][0]) == _key(m[0]) and _fits(cur + [m], kind, pos):
            cur.append(m)
        else:
            runs.append([m])
    return [r for r in runs if len(r) > 1]


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
        out = hld or wait
        if any(pos[u] <= last_wait for u in out.users):
            return False  # a result read before the bucket's wait
    return True


def bucket_collectives_pass(
    gm: torch.fx.GraphModule, example_inputs=None, bucket_size: int = 9
) -> torch.fx.GraphModule:
    """Bucket consecutive FSDP all-gathers and reduce-scatters (see the module docstring).

    Args:
        bucket_size: most collectives per bucket (>= 1; 9 = one Llama3 block). The
            pipeline passes ``--compile.fsdp.bucket_blocks`` times the parameters per block.

    Stats: ``all_gather_before`` / ``_after``, ``reduce_scatter_before`` / ``_after``.

    Raises:
        ValueError: ``bucket_size < 1``.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    graph = gm.graph
    before = {k: sum(1 for n in graph.nodes if collective_kind(n) == k) for k in _KINDS}
    if bucket_size > 1:
        for run in _runs(graph, "all_gather_into_tensor", bucket_size):
            _bucket_all_gather(graph, run)
        for run in _runs(graph, "reduce_scatter_tensor", bucket_size):
            _bucket_reduce_scatter(graph, run)
        graph.lint()
        gm.recompile()
    after = {k: sum(1 for n in graph.nodes if collective_kind(n) == k) for k in _KINDS}
    set_pass_summary(
        gm,
        f"all-gathers {before['all_gather_into_tensor']} -> {after['all_gather_into_tensor']}, "
        f"reduce-scatters {before['reduce_scatter_tensor']} -> {after['reduce_scatter_tensor']} "
        f"(buckets of <= {bucket_size}; reduce-scatters merged by torch's merge_reduce_scatter_bucket)",
        all_gather_before=before["all_gather_into_tensor"], all_gather_after=after["all_gather_into_tensor"],
        reduce_scatter_before=before["reduce_scatter_tensor"], reduce_scatter_after=after["reduce_scatter_tensor"],
    )
    return gm


def _bucket_blocks(ctx: PassContext) -> int:
    """Blocks per bucket: the memory policy's choice, else ``[compile.fsdp] bucket_blocks``
    (-1: auto, so on until the policy decides)."""
    return ctx.levers.bucket_blocks if ctx.levers is not None else ctx.compile_cfg.fsdp.bucket_blocks


def _kwargs(options: None, ctx: PassContext) -> dict[str, Any]:
    """Blocks per bucket -> collectives per bucket (``ctx.layout.params_per_block`` each).

    Raises:
        ValueError: buckets without the model's block layout.
    """
    blocks = _bucket_blocks(ctx)
    if blocks <= 0:
        return {}
    if ctx.layout is None:
        raise ValueError("--compile.fsdp.bucket_blocks needs the model's block layout")
    return {"bucket_size": blocks * ctx.layout.params_per_block}


PASS = GraphPass(
    name="bucket_collectives", fn=bucket_collectives_pass, enabled=lambda ctx: _bucket_blocks(ctx) != 0, kwargs=_kwargs,
)
