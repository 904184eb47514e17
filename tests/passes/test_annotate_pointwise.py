"""annotate_pointwise_for_regional_inductor: what it matches, the cycle cut, numerics."""

import pytest
import torch

from graph_trainer import MODULE_FQN_KEY, PHASE_KEY
from graph_trainer.config import Compile
from graph_trainer.compiler.collectives import is_collective
from graph_trainer.compiler.graph_values import split_acyclic
from graph_trainer.compiler.matching import find_pointwise_regions
from graph_trainer.compiler.node_meta import module_fqn_of, phase_of
from graph_trainer.compiler.passes.annotate_pointwise import annotate_pointwise_for_regional_inductor_pass
from graph_trainer.compiler.pipeline import build_pipeline, plan_pipeline, run_pipeline
from graph_trainer.model import build_model, model_args

from .conftest import (aten, assert_close, by_region, call, call_targets, fx_graph, inductor_tag, module, stats,
                       tagged_nodes, trace_step)


def test_swiglu_chains_tagged_heavy_ops_and_norm_regions_untouched(tiny_llama):
    gm, example_inputs, _ = trace_step(tiny_llama(2))
    run_pipeline(gm, example_inputs, ["annotate_rmsnorm_for_regional_inductor"])
    norm_tags = {n: inductor_tag(n) for n in tagged_nodes(gm)}
    gm = annotate_pointwise_for_regional_inductor_pass(gm, example_inputs)
    assert all(inductor_tag(n) == tag for n, tag in norm_tags.items())  # RMSNorm regions kept as they were
    regions = {rid: nodes for rid, nodes in by_region(gm).items() if rid.startswith("pointwise_")}
    assert stats(gm)["regions"] == len(regions) > 0 and stats(gm)["nodes"] == sum(map(len, regions.values()))
    targets = {}  # (phase, module): the targets of each of its regions
    for nodes in regions.values():
        (key,) = {(phase_of(n), module_fqn_of(n)) for n in nodes}  # one phase, one module
        targets.setdefault(key, []).append({n.target for n in nodes})
        assert not any(n.target in (aten.mm.default, aten.bmm.default) or is_collective(n) for n in nodes)
        assert sum(n.target not in (aten.view.default, aten._unsafe_view.default) for n in nodes) >= 2
        assert split_acyclic(nodes) == [nodes]
    for layer in ("layers.0.feed_forward", "layers.1.feed_forward"):  # SwiGLU: silu * w3, silu_backward
        assert any({aten.silu.default, aten.mul.Tensor} <= t for t in targets[("forward", layer)]), layer
        assert any(aten.silu_backward.default in t for t in targets[("backward", layer)]), layer


def _node(g, target, *args, phase="forward"):
    return call(g, target, *args, custom={PHASE_KEY: phase, MODULE_FQN_KEY: "block"}, val=torch.empty(4, 4))


def test_residual_cycle_is_cut_into_levels_and_mutating_and_random_ops_never_join():
    """h = x + relu(x); h2 = h * 2; out = h2 + h2 @ w: one region would be a cycle."""
    g, (x, w) = fx_graph("x", "w")
    r = _node(g, aten.relu.default, x)
    h = _node(g, aten.add.Tensor, x, r)
    h2 = _node(g, aten.mul.Tensor, h, 2.0)
    out = _node(g, aten.add.Tensor, h2, _node(g, aten.mm.default, h2, w))
    o2 = _node(g, aten.sigmoid.default, out)
    other = _node(g, aten.neg.default, o2, phase="backward")  # other phase: never joined
    g.output((other,))
    regions = find_pointwise_regions(g, min_ops=1)
    assert regions == [[r, h, h2], [out, o2], [other]] and all(split_acyclic(ns) == [ns] for ns in regions)
    assert find_pointwise_regions(g, min_ops=2) == regions[:2]
    with pytest.raises(ValueError, match="min_ops"):
        annotate_pointwise_for_regional_inductor_pass(module(g), None, min_ops=0)
    # in-place / out= ops and seeded random ops cut a chain
    g, (x,) = fx_graph("x")
    r = _node(g, aten.relu.default, x)
    m = _node(g, aten.mul.Tensor, _node(g, aten.add_.Tensor, r, 1.0), 2.0)
    n2 = _node(g, aten.neg.default, m)
    s = _node(g, aten.sigmoid.default, _node(g, aten.rand_like.default, n2))
    g.output((s,))
    assert find_pointwise_regions(g, min_ops=1) == [[r], [m, n2], [s]]


def test_the_memory_policy_leaves_out_what_the_regions_keep_inside():
    """The loss's fp32 buffers (vocab 2048) stay in their regions: the policy's graph estimate is lower."""
    model = build_model(model_args("debugmodel", n_layers=1, dim=32, n_heads=2, vocab_size=2048), seed=0)
    gm, _, _ = trace_step(model, seq=32, vocab=2048)
    peak = {p: plan_pipeline(Compile(numerics_changing_optim=True, passes=p), None, gm, budget_bytes=1 << 34,
                             state_bytes=0, has_fsdp=False)[1].graph_peak_bytes for p in ("", "pointwise")}
    assert peak["pointwise"] < 0.8 * peak[""]


def test_end_to_end_numerics(tiny_llama):
    gm, example_inputs, inputs = trace_step(tiny_llama(1))
    ref = gm(*inputs)
    steps = build_pipeline(Compile(numerics_changing_optim=True, passes="annotate_pointwise"))
    cgm = run_pipeline(gm, example_inputs, steps)
    remaining = set(call_targets(cgm))  # silu compiled away, matmuls eager
    assert {aten.silu.default, aten.silu_backward.default}.isdisjoint(remaining) and aten.mm.default in remaining
    assert_close(cgm(*inputs), ref)
