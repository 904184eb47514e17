"""regional_inductor_pass: one region per id (never merged, cycles cut), timed candidate configs, numerics."""

import operator
from unittest import mock

import pytest
import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import create_op_support

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY
from graph_trainer.compiler.passes.annotate_rmsnorm import annotate_rmsnorm_for_regional_inductor_pass
from graph_trainer.compiler.passes.regional_inductor import (
    MIN_CANDIDATE_GAIN, propose_region_partitions, regional_inductor_pass, scoop_regions)

from .conftest import (D, aten, assert_close, by_region, call, call_targets, fake_prop, fused_norm_graph, fx_graph,
                       inductor_tag, module, stats, tagged_nodes)

CANDIDATES = [{"max_autotune_gemm": False}]


def _annotated_norms(n_norms, candidates=None):
    gm, fakes = fused_norm_graph(n_norms=n_norms)
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, inductor_configs={}, candidate_configs=candidates)
    return gm, fakes


def _check_numerics(gm, n_norms):  # gm of fused_norm_graph computes what F.rms_norm and autograd do
    torch.manual_seed(0)
    x, w, go = torch.randn(4, 8, D), torch.randn(D), torch.randn(4, 8, D)
    out, gi, gw = gm(x, w, go)  # same calling convention as before compilation
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    o0 = torch.nn.functional.rms_norm(xr, [D], wr, 1e-6)
    ref = o0.detach() * 2
    for _ in range(n_norms - 1):
        ref = torch.nn.functional.rms_norm(ref, [D], w, 1e-6) * 2
    assert_close([out, gi, gw], [ref, *torch.autograd.grad(o0, [xr, wr], go)])


@pytest.mark.parametrize("candidate_ms, chosen", [(2.0, 0), (0.5, 1), (0.99, 0), (0.97, 1)])
def test_candidate_configs_timed_and_a_clear_winner_kept(candidate_ms, chosen):
    """Distinct regions compiled once per config set, identical ones reuse the choice; 1 % faster is noise, 3 % wins."""
    assert 0.01 < MIN_CANDIDATE_GAIN < 0.03
    gm, fakes = _annotated_norms(3, CANDIDATES)
    calls = []

    def timer(fn, inputs):  # the variants of a region come in order: inductor_configs, candidate 1
        calls.append(fn)
        assert isinstance(fn(*inputs), (list, tuple))  # the variant runs on inputs of the region's shapes
        return 1.0 if len(calls) % 2 else candidate_ms

    gm = regional_inductor_pass(gm, fakes, select_candidates=True, timer=timer)
    sel = stats(gm)["selections"]
    # 4 regions (3 forward norms, 1 backward); norms 1 and 2 identical -> 3 distinct regions, 2 compiles each
    assert stats(gm)["regions"] == 4 and len(sel) == 3 and stats(gm)["distinct_compiles"] == 6 and len(calls) == 6
    assert all(s["chosen"] == chosen and s["ms"] == [1.0, candidate_ms] and s["configs"] == [{}, *CANDIDATES]
               for s in sel)
    assert sorted(s["region"] for s in sel) == ["rmsnorm_backward_0", "rmsnorm_forward_0", "rmsnorm_forward_1"]
    _check_numerics(gm, 3)


def test_candidates_not_timed_on_cpu_by_default():
    gm = regional_inductor_pass(*_annotated_norms(2, CANDIDATES), timer=(timer := mock.Mock()))
    s = stats(gm)
    assert not timer.called and s["selections"] == [] and s["regions"] == 3 and s["distinct_compiles"] == 3
    # one record per Inductor compile: ops, inputs, seconds, cache outcome (never bypassed: a ShapeEnv is set)
    compiles = s["compiles"]
    assert len(compiles) == 3 and all(c["s"] > 0 and c["cache"] in ("hit", "miss") for c in compiles)
    assert {o for c in compiles for o in c["ops"]} >= {"_fused_rms_norm", "_fused_rms_norm_backward"}
    assert all("float32[" in c["inputs"] for c in compiles)
    assert {aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default}.isdisjoint(call_targets(gm))
    _check_numerics(gm, 2)


def test_one_partition_per_region_never_merged_cycles_split():
    """Per region id one partition; independent norms (torch 2.11's partitioner merges them) apart; cycles split."""
    gm, _ = _annotated_norms(3)
    assert by_region(gm).keys() == {"rmsnorm_forward_0", "rmsnorm_forward_1", "rmsnorm_forward_2", "rmsnorm_backward_0"}
    parts = propose_region_partitions(gm)
    assert len(parts) == 4
    for p in parts:  # one region id per partition, each norm node with its getitems
        assert len({inductor_tag(n)["inductor_region"] for n in p}) == 1
        assert sum(n.target is not operator.getitem for n in p) == 1
    gm, n_regions = scoop_regions(gm)
    assert n_regions == 4 == sum(1 for name, _ in gm.named_children() if name.startswith("__marked_inductor_submod"))
    g, (x, y, w) = fx_graph("x", "y", "w")
    norms = [g.call_function(aten._fused_rms_norm.default, (inp, [D], w, 1e-6)) for inp in (x, y)]
    gm = module(g, *(g.call_function(operator.getitem, (n, 0)) for n in norms))
    annotate_rmsnorm_for_regional_inductor_pass(gm, fake_prop(gm, [(2, D), (2, D), (D,)]))
    assert len(propose_region_partitions(gm)) == 2
    support = create_op_support(lambda _m, n, tagged=set(tagged_nodes(gm)): n in tagged)
    assert len(CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True).propose_partitions()) == 1
    g, (x,) = fx_graph("x")  # a (tagged) -> cos (untagged) -> b (tagged), a -> b
    tag = {COMPILE_WITH_INDUCTOR_KEY: {"inductor_configs": {}, "inductor_region": "r"}}
    a = call(g, aten.sin.default, x, custom=tag)
    gm = module(g, call(g, aten.add.Tensor, a, call(g, aten.cos.default, a), custom=tag))
    fake_prop(gm, [(3,)])
    assert len(propose_region_partitions(gm)) == 2
