"""bucket_collectives_pass on a traced 1-rank FSDP step (2 ranks: tests/test_fsdp.py), and why not torch's."""

import copy

import pytest
import torch
from torch._inductor.fx_passes import bucketing
from torch._inductor.fx_passes.overlap_preserving_bucketer import OverlapPreservingBucketer
from torch._inductor.fx_passes.overlap_scheduling import CollectiveInfo
from torch.utils._ordered_set import OrderedSet

from graph_trainer.compiler.collectives import collective_kind, hold, is_wait
from graph_trainer.compiler.passes.bucket_collectives import bucket_collectives_pass
from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass
from graph_trainer.compiler.passes.reshard_after_forward import reshard_after_forward_pass
from graph_trainer.model import BlockLayout
from graph_trainer.projection.cost_model import ring_bytes_on_wire

from .conftest import AG, RS, aten, assert_bitwise, run_no_grad, stats


def _count(gm, kind):
    return sum(1 for n in gm.graph.nodes if collective_kind(n) == kind)


def _overlapped(traced):
    """A copy of the traced step after reshard_after_forward and overlap_collectives (windows of 2)."""
    gm = reshard_after_forward_pass(copy.deepcopy(traced.gm), None, prefetch=2, cpu_async=True)
    return overlap_collectives_pass(gm, None, cpu_async=True, ag_window=2)


def _mms_hidden(gm, issue):
    """Matmuls between ``issue`` and its wait."""
    nodes = list(gm.graph.nodes)
    (wait,) = [u for u in issue.users if is_wait(u)]
    return sum(n.target == aten.mm.default for n in nodes[nodes.index(issue):nodes.index(wait)])


@pytest.mark.parametrize("bucket_size", [4, 9])
def test_buckets_bitwise(fsdp_step, bucket_size):
    traced, inputs, n_params = fsdp_step
    ref = run_no_grad(traced.gm, inputs)
    gm = _overlapped(traced)
    ag0, rs0 = _count(gm, AG), _count(gm, RS)
    assert rs0 == n_params and ag0 == 2 * n_params - 1  # forward gathers + backward re-gathers
    gm = bucket_collectives_pass(gm, None, bucket_size=bucket_size)
    ag1, rs1 = _count(gm, AG), _count(gm, RS)
    assert (stats(gm)["all_gather_before"], stats(gm)["all_gather_after"]) == (ag0, ag1)
    assert -(-ag0 // bucket_size) <= ag1 < ag0 and -(-rs0 // bucket_size) <= rs1 < rs0
    gm.graph.lint()
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if collective_kind(n):  # every collective keeps exactly one wait, after it
            waits = [u for u in n.users if is_wait(u)]
            assert len(waits) == 1 and pos[waits[0]] > pos[n]
        if collective_kind(n) == AG and n.args[0].target is aten.cat.default:
            (out,) = n.users  # a bucket's buffer is read once, by the copy-out op (after the wait's hold)
            out = next((u for u in out.users if u.target is hold), out)
            assert [u.target for u in out.users] == [torch.ops.graph_trainer.unbucket_all_gather.default]
    # most reduce-scatter buckets (torch's merge) still overlap the backward
    rs = [n for n in gm.graph.nodes if collective_kind(n) == RS]
    assert sum(_mms_hidden(gm, n) > 0 for n in rs) > len(rs) // 2
    for _ in range(2):
        assert_bitwise(run_no_grad(gm, inputs), ref)


def test_bf16_shard_casts_move_with_their_bucket(fsdp_trace):
    """The bf16 casts of the shards (read by all-gather and hold) move to the bucket's issue; bitwise."""
    traced, inputs, n_params = fsdp_trace(param_dtype=torch.bfloat16)
    ref = run_no_grad(traced.gm, inputs)
    gm = overlap_collectives_pass(traced.gm, None, cpu_async=True, ag_window=2)
    assert all(len(n.args[0].users) == 2 for n in gm.graph.nodes if collective_kind(n) == AG)
    before = [n.name for n in gm.graph.nodes]
    assert [n.name for n in bucket_collectives_pass(gm, None, bucket_size=1).graph.nodes] == before
    with pytest.raises(ValueError, match="bucket_size"):
        bucket_collectives_pass(gm, None, bucket_size=0)
    gm = bucket_collectives_pass(gm, None, bucket_size=9)
    assert _count(gm, AG) == -(-n_params // 9)
    gm.graph.lint()
    assert_bitwise(run_no_grad(gm, inputs), ref)


def test_fsdp2_units_reduce_scatters_in_flight_and_not_torchs_bucketing(fsdp_step):
    """One reduce-scatter per FSDP2 unit, in order; one in flight hides more; torch's bucketing breaks the graph (or
    loses overlap), its ``_out`` all-gather has no cost formula."""
    traced, inputs, n_params = fsdp_step
    ref = run_no_grad(traced.gm, inputs)
    units = BlockLayout(params_before=1, params_per_block=9, n_blocks=2)
    assert n_params == 1 + 9 * 2 + 2
    gm = bucket_collectives_pass(_overlapped(traced), None, bucket_size=1, fsdp2_units=units)
    rs = [n for n in gm.graph.nodes if collective_kind(n) == RS]
    # the embedding alone stays one reduce-scatter; each block and the final norm + output merge
    assert len(rs) == 4 and _count(gm, AG) == 2 * n_params - 1  # all-gathers untouched at bucket_size 1
    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    merged = 0
    for n in rs:  # a merged bucket's cat (under its view) reads the members' gradients in parameter order
        src = n.args[0]
        while src.target in (aten.view.default, aten._unsafe_view.default):
            src = src.args[0]
        if src.target is aten.cat.default:
            merged += 1
            (wait,) = [u for u in n.users if is_wait(u)]
            grads, stack = [], list(wait.users)  # the graph outputs the bucket reaches, in the order it slices
            while stack:
                m = stack.pop(0)
                if m in outputs:
                    grads.append(outputs.index(m))
                else:
                    stack.extend(u for u in m.users if u.op != "output")
            assert grads == sorted(grads)
    assert merged == 3
    assert_bitwise(run_no_grad(gm, inputs), ref)
    plain = bucket_collectives_pass(_overlapped(traced), None, bucket_size=4)
    gm = bucket_collectives_pass(_overlapped(traced), None, bucket_size=4, reduce_scatter_in_flight=1, cpu_async=True)
    rs, deferred = [n for n in gm.graph.nodes if collective_kind(n) == RS], "reduce_scatter_waits_deferred"
    assert stats(plain)[deferred] == 0 < stats(gm)[deferred] and len(rs) > 2
    hidden = [[_mms_hidden(g, n) for n in g.graph.nodes if collective_kind(n) == RS] for g in (plain, gm)]
    assert all(b >= a for a, b in zip(*hidden)) and sum(hidden[1]) > sum(hidden[0])  # later, never earlier
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for i, (issue, nxt) in enumerate(zip(rs, rs[1:])):
        (wait,) = [u for u in issue.users if is_wait(u)]
        assert hidden[1][i] == hidden[0][i] or pos[wait] < pos[nxt]  # a moved wait: before the next issue
    for _ in range(2):
        assert_bitwise(run_no_grad(gm, inputs), ref)
    with pytest.raises(ValueError, match="reduce_scatter_in_flight must be >= 0"):
        bucket_collectives_pass(_overlapped(traced), None, reduce_scatter_in_flight=-1)
    gm = _overlapped(traced)
    bucketing.bucket_all_gather(gm, lambda bucket_idx: 2000.0)
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        gm.graph.lint()
    assert _count(gm, AG) == 0 and _count(gm, "all_gather_into_tensor_out") > 0
    with pytest.raises(ValueError, match="all_gather_into_tensor_out"):
        ring_bytes_on_wire("all_gather_into_tensor_out", 1.0, 2)
    gm = _overlapped(traced)
    bucketing.bucket_reduce_scatter(gm, lambda bucket_idx: 2000.0)
    try:
        gm.graph.lint()
    except RuntimeError as e:  # torch 2.11
        assert "used before it has been defined" in str(e)
    else:  # torch 2.13
        rs = [n for n in gm.graph.nodes if collective_kind(n) == RS]
        assert rs and all(_mms_hidden(gm, n) == 0 for n in rs)
    # the bucketer for placed graphs keeps every hiding interval: with windows of 2 it merges under half
    gm = _overlapped(traced)
    ag0, rs0 = _count(gm, AG), _count(gm, RS)
    nodes, info = list(gm.graph.nodes), {}
    for n in (n for n in nodes if collective_kind(n) in (AG, RS)):
        (wait,) = n.users
        hiding = OrderedSet(m for m in nodes[nodes.index(n):nodes.index(wait)] if m.target == aten.mm.default)
        size = n.meta["val"].numel() * n.meta["val"].element_size()
        info[n] = CollectiveInfo(n, wait, size, 1.0, 0.0 if hiding else 1.0, hiding)
    block_gib = 9 * max(i.size_bytes for i in info.values()) / 2**30  # room for a block's collectives
    OverlapPreservingBucketer(gm.graph, info, OrderedSet(gm.graph.nodes), block_gib).bucket_collectives()
    gm.graph.lint()
    assert _count(gm, AG) + _count(gm, "all_gather_into_tensor_out") > ag0 // 2 and _count(gm, RS) > rs0 // 2
    ours = bucket_collectives_pass(_overlapped(traced), None, bucket_size=9)
    assert _count(ours, AG) < ag0 // 4 and _count(ours, RS) < rs0 // 4
