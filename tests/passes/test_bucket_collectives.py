"""bucket_collectives_pass on a traced FSDP step (1-rank gloo group, fixtures in
tests/conftest.py; the 2-rank layout is checked end to end in tests/test_fsdp.py)."""

import pytest
import torch

from graph_trainer.passes import bucket_collectives_pass, overlap_collectives_pass, reshard_after_forward_pass
from graph_trainer.passes.common import collective_kind, hold, is_wait


def _count(gm, kind):
    return sum(1 for n in gm.graph.nodes if collective_kind(n) == kind)


@pytest.mark.parametrize("bucket_size", [4, 9])
def test_buckets_bitwise(fsdp_step, bucket_size):
    traced, inputs, n_params = fsdp_step
    with torch.no_grad():
        ref = traced.gm(*inputs)
    gm = reshard_after_forward_pass(traced.gm, None, prefetch=2, cpu_async=True)
    gm = overlap_collectives_pass(gm, None, cpu_async=True, ag_window=2)
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
