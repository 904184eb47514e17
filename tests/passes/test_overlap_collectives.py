"""overlap_collectives_pass on a traced 1-rank gloo FSDP step (bitwise numerics), and why not torch's."""

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

from graph_trainer.compiler.collectives import collective_kind, hold, is_wait, strip_holds
from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass

from .conftest import AG, RS, aten, assert_bitwise, c10d, call, fx_graph, module, run_no_grad, stats

_VIEWS = (aten.slice.Tensor, aten.view.default)


def _pending_max(gm, kind):
    """Most issued-but-not-yet-waited collectives of ``kind`` at any point."""
    pending, worst = set(), 0
    for n in gm.graph.nodes:
        if collective_kind(n) == kind:
            pending.add(n)
            worst = max(worst, len(pending))
        elif is_wait(n):
            pending.discard(n.args[0])
    return worst


def _rs_before_last_mm(gm):
    nodes = list(gm.graph.nodes)
    last_mm = max(i for i, n in enumerate(nodes) if n.target == aten.mm.default)
    return sum(collective_kind(n) == RS for n in nodes[:last_mm])


def test_waits_sunk_numerics_bitwise_options_and_not_torchs_scheduler(fsdp_step):
    traced, inputs, n_params = fsdp_step
    gm = copy.deepcopy(traced.gm)
    ref = run_no_grad(gm, inputs)
    waits = [n for n in gm.graph.nodes if is_wait(n)]
    # as traced, every wait follows its collective and every reduce-scatter the last matmul
    assert len(waits) == 2 * n_params and all(w.prev is w.args[0] for w in waits)
    assert _pending_max(gm, RS) == 1 and _rs_before_last_mm(gm) == 0
    gm = overlap_collectives_pass(gm, None, max_in_flight=2, cpu_async=True, ag_window=2)
    s = stats(gm)
    assert s["all_gather"] == n_params and s["other"] == n_params
    assert s["moved"] > n_params and s["hoisted"] > n_params // 2 and s["windowed"] > n_params // 2
    gm.graph.lint()
    assert _rs_before_last_mm(gm) > n_params // 2  # issued while backward matmuls remain
    for w in (w for w in gm.graph.nodes if is_wait(w) and collective_kind(w.args[0]) == AG):
        # the wait, the keep-alive hold, its slice -> view chain, the first real use
        assert w.next.target is hold and w.next.args == (w, w.args[0].args[0])
        end = w.next
        while len(end.users) == 1 and end.next in end.users and end.next.target in _VIEWS:
            end = end.next
        assert end is not w and end.next in end.users and w.args[0].next is not w
    # the window of 2 (all-gathers) or max_in_flight (reduce-scatters), + the one in use
    assert 2 <= _pending_max(gm, AG) <= 3 and 2 <= _pending_max(gm, RS) <= 3
    assert sum(1 for n in gm.graph.nodes if n.target is hold) == s["moved"]
    for _ in range(3):  # repeated runs: freed-buffer reuse would show up here
        assert_bitwise(run_no_grad(gm, inputs), ref)
    assert strip_holds(gm) == s["moved"]
    gm.graph.lint()
    gm = overlap_collectives_pass(copy.deepcopy(traced.gm))  # default on CPU: hoisted, never left in flight
    waits = [n for n in gm.graph.nodes if is_wait(n)]
    assert stats(gm)["hoisted"] > n_params // 2 and waits and all(w.prev is w.args[0] for w in waits)
    assert not any(n.target is hold for n in gm.graph.nodes)
    gm = overlap_collectives_pass(copy.deepcopy(traced.gm), None, cpu_async=True, ag_window=None)
    assert _pending_max(gm, AG) == n_params  # no window: all issued before the first wait
    gm = overlap_collectives_pass(copy.deepcopy(traced.gm), None, max_in_flight=1, cpu_async=True)
    assert _pending_max(gm, RS) <= 2
    with pytest.raises(ValueError, match="max_in_flight"):
        overlap_collectives_pass(gm, None, max_in_flight=0)
    with pytest.raises(ValueError, match="ag_window"):
        overlap_collectives_pass(gm, None, ag_window=-1)
    gm = torch.fx.symbolic_trace(lambda x: (x.sin() * 2).sum())
    before = [n.name for n in gm.graph.nodes]
    gm = overlap_collectives_pass(gm)
    assert [n.name for n in gm.graph.nodes] == before and stats(gm)["moved"] == 0
    if not torch.cuda.is_available():  # torch's scheduler needs a GPU, even with ``custom_runtime_estimation``
        params = inspect.signature(schedule_overlap_bucketing).parameters  # torch 2.13 buckets FSDP first
        kwargs = {"pre_bucketing_fsdp_collectives": False} if "pre_bucketing_fsdp_collectives" in params else {}
        for extra in ({}, {"custom_runtime_estimation": lambda node, override_size=None: 1.0}):
            with pytest.raises((RuntimeError, AssertionError)):
                schedule_overlap_bucketing(copy.deepcopy(traced.gm), **kwargs, **extra)


def test_tp_collectives_lead_the_matmuls_they_do_not_read_with_what_they_read(gloo1):
    """TP reduce-scatters (with what they read) and all-gathers go ``tp_lead`` matmuls they do not read earlier, never
    past a wait they read; without a TP group nothing moves; the same bits."""
    g, (x, w, go) = fx_graph("x", "w", "go")
    group = dist.group.WORLD.group_name
    param_ag = call(g, c10d.all_gather_into_tensor.default, w, 1, group)  # a parameter's, issued early
    mm0 = call(g, aten.mm.default, go, w)
    act = call(g, aten.relu.default, x)
    mm1 = call(g, aten.mm.default, x, w)
    mm2 = call(g, aten.mm.default, go, go)
    param = call(g, c10d.wait_tensor.default, param_ag)
    total = call(g, aten.add.Tensor, mm1, param)
    rs = call(g, c10d.reduce_scatter_tensor.default, total, "sum", 1, group)
    rs_w = call(g, c10d.wait_tensor.default, rs)
    ag = call(g, c10d.all_gather_into_tensor.default, act, 1, group)
    late = call(g, aten.relu.default, rs_w)  # reads a wait: its gather stays
    late_ag = call(g, c10d.all_gather_into_tensor.default, late, 1, group)
    outs = (call(g, aten.mm.default, call(g, c10d.wait_tensor.default, ag), rs_w), mm0, mm2,
            call(g, c10d.wait_tensor.default, late_ag))
    gm = module(g, *outs)
    inputs = [torch.randn(4, 4) for _ in range(3)]
    ref = gm(*inputs)
    for lead, group_name, expected in ((1, group, [mm0, act, mm1, param, total, rs, ag, mm2]),
                                       (2, group, [mm1, param, total, rs, act, ag, mm0, mm2]),
                                       (2, None, [mm0, act, mm1, mm2, param, total, rs, ag])):  # rs: hoisted
        out = overlap_collectives_pass(copy.deepcopy(gm), None, cpu_async=True, ag_window=None, tp_lead=lead,
                                       tp_group_name=group_name)
        order = [n.name for n in out.graph.nodes]
        assert [n for n in order if n in {e.name for e in expected}] == [e.name for e in expected]
        assert stats(out)["led"] == (2 if group_name else 0) and order.index(late_ag.name) == order.index(late.name) + 1
        assert_bitwise(out(*inputs), ref)
    with pytest.raises(ValueError, match="tp_lead"):
        overlap_collectives_pass(gm, None, tp_lead=-1)
