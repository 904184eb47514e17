"""overlap_collectives_pass on a traced FSDP step (1-rank gloo group: the collectives
really run, so numerics before/after the pass are compared bit for bit), and why it is not
torch's ``schedule_overlap_bucketing`` (``torch._inductor.fx_passes.overlap_scheduling``)."""

import copy
import inspect

import pytest
import torch

from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass
from graph_trainer.compiler.common import collective_kind, hold, is_wait, strip_holds


def _pending_max(gm, kind):
    """Largest number of issued-but-not-yet-waited collectives of ``kind`` at any point."""
    pending, worst = set(), 0
    for n in gm.graph.nodes:
        if collective_kind(n) == kind:
            pending.add(n)
            worst = max(worst, len(pending))
        elif is_wait(n):
            pending.discard(n.args[0])
    return worst


def test_waits_sunk_numerics_bitwise(fsdp_step):
    traced, inputs, n_params = fsdp_step
    gm = traced.gm
    with torch.no_grad():
        ref = gm(*inputs)
    waits = [n for n in gm.graph.nodes if is_wait(n)]
    assert len(waits) == 2 * n_params
    # as traced, every wait directly follows its collective: nothing overlaps; and
    # autograd ran all reduce-scatters after the last matmul of the backward
    assert all(w.prev is w.args[0] for w in waits)
    assert _pending_max(gm, "reduce_scatter_tensor") == 1
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_mm = max(pos[n] for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    rs = [n for n in gm.graph.nodes if collective_kind(n) == "reduce_scatter_tensor"]
    assert min(pos[n] for n in rs) > last_mm

    gm = overlap_collectives_pass(gm, None, max_in_flight=2, cpu_async=True, ag_window=2)
    stats = gm.meta["graph_trainer_pass_stats"]
    assert stats["all_gather"] == n_params and stats["other"] == n_params
    assert stats["moved"] > n_params  # every all-gather wait and most reduce-scatter waits
    assert stats["hoisted"] > n_params // 2
    gm.graph.lint()
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    # most reduce-scatters are now issued while backward matmuls remain to run
    last_mm = max(pos[n] for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    rs = [n for n in gm.graph.nodes if collective_kind(n) == "reduce_scatter_tensor"]
    assert sum(pos[n] < last_mm for n in rs) > n_params // 2
    for w in gm.graph.nodes:
        if is_wait(w) and collective_kind(w.args[0]) == "all_gather_into_tensor":
            # the wait, the keep-alive hold, its slice -> view chain, the first real use
            assert w.next.target is hold and w.next.args == (w, w.args[0].args[0])
            end = w.next
            while len(end.users) == 1 and end.next in end.users and end.next.target in (
                torch.ops.aten.slice.Tensor, torch.ops.aten.view.default
            ):
                end = end.next
            assert end is not w and end.next in end.users
            assert w.args[0].next is not w  # no longer right after its all-gather
    # parameter all-gathers are prefetched a window ahead of their use: 2 + the one in use
    assert stats["windowed"] > n_params // 2
    assert 2 <= _pending_max(gm, "all_gather_into_tensor") <= 3
    # pending reduce-scatters are bounded by max_in_flight (+1 just issued)
    assert 2 <= _pending_max(gm, "reduce_scatter_tensor") <= 3
    # every moved wait keeps its collective's input alive until it (gloo frees otherwise)
    assert sum(1 for n in gm.graph.nodes if n.target is hold) == stats["moved"]
    with torch.no_grad():
        for _ in range(3):  # repeated runs: freed-buffer reuse would show up here
            out = gm(*inputs)
            assert len(out) == len(ref)
            for a, b in zip(out, ref):
                assert torch.equal(a, b)
    assert strip_holds(gm) == stats["moved"]
    gm.graph.lint()


def test_no_window_gathers_everything_up_front(fsdp_step):
    traced, _, n_params = fsdp_step
    gm = overlap_collectives_pass(traced.gm, None, cpu_async=True, ag_window=None)
    assert _pending_max(gm, "all_gather_into_tensor") == n_params  # all issued before the first wait


def test_max_in_flight_one_and_validation(fsdp_step):
    traced, _, _ = fsdp_step
    gm = overlap_collectives_pass(traced.gm, None, max_in_flight=1, cpu_async=True)
    assert _pending_max(gm, "reduce_scatter_tensor") <= 2
    with pytest.raises(ValueError, match="max_in_flight"):
        overlap_collectives_pass(gm, None, max_in_flight=0)
    with pytest.raises(ValueError, match="ag_window"):
        overlap_collectives_pass(gm, None, ag_window=-1)


def test_no_collectives_is_noop():
    def f(x):
        return (x.sin() * 2).sum()

    gm = torch.fx.symbolic_trace(f)
    before = [n.name for n in gm.graph.nodes]
    gm = overlap_collectives_pass(gm)
    assert [n.name for n in gm.graph.nodes] == before
    assert gm.meta["graph_trainer_pass_stats"]["moved"] == 0


def test_cpu_collectives_never_left_in_flight_by_default(fsdp_step):
    """Default on CPU: reduce-scatters still issued early, but each wait follows its issue."""
    traced, inputs, n_params = fsdp_step
    gm = overlap_collectives_pass(traced.gm)
    assert gm.meta["graph_trainer_pass_stats"]["hoisted"] > n_params // 2
    waits = [n for n in gm.graph.nodes if is_wait(n)]
    assert waits and all(w.prev is w.args[0] for w in waits)
    assert not any(n.target is hold for n in gm.graph.nodes)


def _torch_scheduler():
    """torch's ``schedule_overlap_bucketing`` and the keyword arguments that keep it to
    scheduling: torch 2.13 buckets FSDP collectives first unless told not to."""
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    params = inspect.signature(schedule_overlap_bucketing).parameters
    kwargs = {"pre_bucketing_fsdp_collectives": False} if "pre_bucketing_fsdp_collectives" in params else {}
    return schedule_overlap_bucketing, kwargs


@pytest.mark.skipif(torch.cuda.is_available(), reason="what torch's scheduler does without a GPU")
def test_torch_scheduler_needs_a_gpu(fsdp_step):
    """torch's scheduler estimates compute nodes from the GPU (benchmarks, or a roofline of
    its bandwidth, computed even with ``custom_runtime_estimation``): without one (the dry
    run, these tests, CI) it cannot schedule the traced step."""
    schedule, kwargs = _torch_scheduler()
    traced, _, _ = fsdp_step

    def one_ms(node, override_size=None):
        return 1.0

    for extra in ({}, {"custom_runtime_estimation": one_ms}):
        with pytest.raises((RuntimeError, AssertionError)):
            schedule(copy.deepcopy(traced.gm), **kwargs, **extra)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's scheduler needs a GPU")
def test_torch_scheduler_leaves_every_reduce_scatter_in_flight(fsdp_step):
    """With a GPU, torch's scheduler bounds what is in flight by bytes and peak memory, not
    by count: on the traced step every reduce-scatter stays in flight to the end of the
    backward, each keeping its unsharded gradient alive; this pass keeps ``max_in_flight``."""
    from torch.utils.flop_counter import flop_registry

    schedule, kwargs = _torch_scheduler()
    traced, _, n_params = fsdp_step

    def one_ms(node, override_size=None):  # deterministic: 1 ms per matmul-like op and collective
        return 1.0 if collective_kind(node) or getattr(node.target, "overloadpacket", None) in flop_registry else None

    gm = schedule(copy.deepcopy(traced.gm), custom_runtime_estimation=one_ms, **kwargs)
    gm.graph.lint()
    assert _pending_max(gm, "reduce_scatter_tensor") == n_params
    ours = overlap_collectives_pass(traced.gm, None, max_in_flight=2, cpu_async=True)
    assert _pending_max(ours, "reduce_scatter_tensor") <= 3
