"""bucket_collectives_pass on a traced FSDP step (1-rank gloo group, fixtures in
tests/conftest.py; the 2-rank layout is checked end to end in tests/test_fsdp.py), and why
it keeps its own grouping, placement and all-gather merge: torch's bucketing passes on the
same graphs (``torch._inductor.fx_passes.bucketing`` / ``overlap_preserving_bucketer``)."""

import copy

import pytest
import torch

from graph_trainer.compiler.passes.bucket_collectives import bucket_collectives_pass

from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass

from graph_trainer.compiler.passes.reshard_after_forward import reshard_after_forward_pass
from graph_trainer.compiler.common import collective_kind, hold, is_wait
from graph_trainer.projection.cost_model import ring_bytes_on_wire


def _count(gm, kind):
    return sum(1 for n in gm.graph.nodes if collective_kind(n) == kind)


def _overlapped(traced):
    """A copy of the traced step after reshard_after_forward and overlap_collectives, as the
    pipeline runs them before this pass (collectives left in flight, windows of 2)."""
    gm = reshard_after_forward_pass(copy.deepcopy(traced.gm), None, prefetch=2, cpu_async=True)
    return overlap_collectives_pass(gm, None, cpu_async=True, ag_window=2)


def _mms_hidden(gm, issue):
    """Matmuls between ``issue`` and its wait."""
    (wait,) = [u for u in issue.users if is_wait(u)]
    n, count = issue.next, 0
    while n is not wait:
        count += n.target == torch.ops.aten.mm.default
        n = n.next
    return count


@pytest.mark.parametrize("bucket_size", [4, 9])
def test_buckets_bitwise(fsdp_step, bucket_size):
    traced, inputs, n_params = fsdp_step
    with torch.no_grad():
        ref = traced.gm(*inputs)
    gm = _overlapped(traced)
    ag0, rs0 = _count(gm, "all_gather_into_tensor"), _count(gm, "reduce_scatter_tensor")
    assert rs0 == n_params and ag0 == 2 * n_params - 1  # forward gathers + backward re-gathers
    gm = bucket_collectives_pass(gm, None, bucket_size=bucket_size)
    stats = gm.meta["graph_trainer_pass_stats"]
    ag1, rs1 = _count(gm, "all_gather_into_tensor"), _count(gm, "reduce_scatter_tensor")
    assert (stats["all_gather_before"], stats["all_gather_after"]) == (ag0, ag1)
    assert -(-ag0 // bucket_size) <= ag1 < ag0 and -(-rs0 // bucket_size) <= rs1 < rs0
    gm.graph.lint()
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:  # every collective keeps exactly one wait, after it
        if collective_kind(n):
            waits = [u for u in n.users if is_wait(u)]
            assert len(waits) == 1 and pos[waits[0]] > pos[n]
    for n in gm.graph.nodes:  # a bucket's gathered buffer is read once, by the copy-out op
        if collective_kind(n) == "all_gather_into_tensor" and n.args[0].target is torch.ops.aten.cat.default:
            (out,) = n.users  # the wait, or overlap_collectives' hold after it
            out = next((u for u in out.users if u.target is hold), out)
            readers = list(out.users)
            assert [u.target for u in readers] == [torch.ops.graph_trainer.unbucket_all_gather.default]
    # most reduce-scatter buckets (torch's merge) still overlap the backward: waited where
    # their last member was, not right after the issue (the last gradients have no matmul left)
    rs = [n for n in gm.graph.nodes if collective_kind(n) == "reduce_scatter_tensor"]
    assert sum(_mms_hidden(gm, n) > 0 for n in rs) > len(rs) // 2
    with torch.no_grad():
        for _ in range(2):
            out = gm(*inputs)
            assert len(out) == len(ref) and all(torch.equal(a, b) for a, b in zip(out, ref))


def test_bucket_size_one_is_noop_and_validation(fsdp_step):
    traced, _, _ = fsdp_step
    before = [n.name for n in traced.gm.graph.nodes]
    gm = bucket_collectives_pass(traced.gm, None, bucket_size=1)
    assert [n.name for n in gm.graph.nodes] == before
    with pytest.raises(ValueError, match="bucket_size"):
        bucket_collectives_pass(gm, None, bucket_size=0)


def test_bf16_shard_casts_move_with_their_bucket(fsdp_trace):
    """Mixed precision: each all-gather reads a bf16 cast of its shard that overlap_collectives'
    hold also reads; the casts move up to the bucket's issue and the step stays bitwise."""
    traced, inputs, n_params = fsdp_trace(param_dtype=torch.bfloat16)
    with torch.no_grad():
        ref = traced.gm(*inputs)
    gm = overlap_collectives_pass(traced.gm, None, cpu_async=True, ag_window=2)
    casts = [n.args[0] for n in gm.graph.nodes if collective_kind(n) == "all_gather_into_tensor"]
    assert all(len(c.users) == 2 for c in casts)  # the all-gather and the wait's hold
    gm = bucket_collectives_pass(gm, None, bucket_size=9)
    assert _count(gm, "all_gather_into_tensor") == -(-n_params // 9)
    gm.graph.lint()
    with torch.no_grad():
        out = gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_torch_bucket_passes_break_the_overlapped_graph(fsdp_step):
    """torch's greedy bucketing (by wait order, capped in MB) inserts each bucket, wait
    included, after its last member's issue: after overlap_collectives the first members'
    readers come earlier, so the graph reads values before they exist (torch 2.13 re-sorts
    a reduce-scatter bucket's region instead, and its wait then follows its issue: no
    overlap left). Its all-gather merge is ``all_gather_into_tensor_out``, which the
    project does not count as an all-gather: the cost model has no formula for it."""
    from torch._inductor.fx_passes import bucketing

    traced, _, _ = fsdp_step
    gm = _overlapped(traced)
    bucketing.bucket_all_gather(gm, lambda bucket_idx: 2000.0)
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        gm.graph.lint()
    assert _count(gm, "all_gather_into_tensor") == 0
    assert _count(gm, "all_gather_into_tensor_out") > 0
    with pytest.raises(ValueError, match="all_gather_into_tensor_out"):
        ring_bytes_on_wire("all_gather_into_tensor_out", 1.0, 2)

    gm = _overlapped(traced)
    bucketing.bucket_reduce_scatter(gm, lambda bucket_idx: 2000.0)
    try:
        gm.graph.lint()
    except RuntimeError as e:  # torch 2.11
        assert "used before it has been defined" in str(e)
    else:  # torch 2.13
        rs = [n for n in gm.graph.nodes if collective_kind(n) == "reduce_scatter_tensor"]
        assert rs and all(_mms_hidden(gm, n) == 0 for n in rs)


def test_torch_overlap_preserving_bucketer_merges_little(fsdp_step):
    """torch's bucketer for placed graphs keeps every collective's hiding interval (here:
    the matmuls between issue and wait as overlap_collectives placed them): with prefetch
    windows of 2 it leaves most collectives alone, where this pass merges a block's worth."""
    from torch._inductor.fx_passes.overlap_preserving_bucketer import OverlapPreservingBucketer
    from torch._inductor.fx_passes.overlap_scheduling import CollectiveInfo
    from torch.utils._ordered_set import OrderedSet

    traced, _, _ = fsdp_step
    gm = _overlapped(traced)
    ag0, rs0 = _count(gm, "all_gather_into_tensor"), _count(gm, "reduce_scatter_tensor")
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    info = {}
    for n in gm.graph.nodes:
        if collective_kind(n) in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            (wait,) = n.users
            hiding = OrderedSet(m for m in gm.graph.nodes
                                if pos[n] < pos[m] < pos[wait] and m.target == torch.ops.aten.mm.default)
            size = n.meta["val"].numel() * n.meta["val"].element_size()
            info[n] = CollectiveInfo(n, wait, size, 1.0, 0.0 if hiding else 1.0, hiding)
    block_gib = 9 * max(i.size_bytes for i in info.values()) / 2**30  # room for a block's collectives
    OverlapPreservingBucketer(gm.graph, info, OrderedSet(gm.graph.nodes), block_gib).bucket_collectives()
    gm.graph.lint()
    ag1 = _count(gm, "all_gather_into_tensor") + _count(gm, "all_gather_into_tensor_out")
    assert ag1 > ag0 // 2 and _count(gm, "reduce_scatter_tensor") > rs0 // 2
    ours = bucket_collectives_pass(_overlapped(traced), None, bucket_size=9)
    assert _count(ours, "all_gather_into_tensor") < ag0 // 4 and _count(ours, "reduce_scatter_tensor") < rs0 // 4
