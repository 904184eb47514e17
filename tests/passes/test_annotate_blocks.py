"""annotate_blocks: one region per block phase, no collectives in regions, no cycles, compiled once, close."""

import pytest
import torch
import torch.fx

from graph_trainer.compiler.collectives import hold, is_collective, is_wait
from graph_trainer.compiler.passes.annotate_blocks import annotate_blocks_pass, block_of
from graph_trainer.compiler.passes.regional_inductor import propose_region_partitions, scoop_regions
from graph_trainer.compiler.pipeline import build_pipeline, run_pipeline
from graph_trainer.config import Compile

from .conftest import assert_close, fake_prop, inductor_tag, region_ids, tagged_nodes, trace_step

aten = torch.ops.aten


def test_regions_follow_blocks_and_phases(tiny_llama):
    gm, example_inputs, _ = trace_step(tiny_llama(2))
    steps = build_pipeline(Compile(numerics_changing_optim=True, passes="annotate_blocks"))
    records = []
    gm = run_pipeline(gm, example_inputs, steps[:-1], quiet=True, records=records)  # the RMSNorm pass ran first
    ids = region_ids(gm)
    assert {r.rsplit("_", 1)[0] for r in ids} == {f"block_{b}_{p}" for b in ("layers.0", "layers.1", "rest")
                                                  for p in ("forward", "backward")}
    for n in tagged_nodes(gm):
        region = inductor_tag(n)["inductor_region"]
        assert inductor_tag(n)["inductor_configs"] == {}
        if block_of(n) is not None:
            assert region.startswith(f"block_{block_of(n)}_")
    untagged_ops = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                    and inductor_tag(n) is None]
    assert untagged_ops == []  # a plain traced step: every aten op is in a block region
    assert records[-1]["stats"]["regions"] == len(ids)


def test_in_place_ops_join_only_on_their_own_intermediates():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.mul.Tensor, (x, 2.0))
    b = g.call_function(aten.add_.Tensor, (a, 1.0))  # an intermediate of the region: joins
    c = g.call_function(aten.add_.Tensor, (x, 1.0))  # a graph input: stays eager
    d = g.call_function(aten.mul.Tensor, (b, c))
    for n in (a, b, c, d):
        n.meta["custom"] = {"phase": "forward", "module_fqn": "layers.0.feed_forward"}
    g.output((d,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    fake_prop(gm, [(4, 4)])
    annotate_blocks_pass(gm)
    assert tagged_nodes(gm) == [a, b, d]
    assert len(region_ids(gm)) == 2  # a new run after the eager in-place op


def test_fsdp_step_collectives_stay_out_or_join_a_region_with_their_wait(fsdp_trace):
    traced, inputs, _ = fsdp_trace(param_dtype=torch.bfloat16)
    plain = annotate_blocks_pass(traced.gm, traced.example_inputs)
    assert not any(is_collective(n) for n in tagged_nodes(plain))
    assert len(propose_region_partitions(plain)) == len(region_ids(plain))  # each run is one cycle-free region
    n_plain = len(region_ids(plain))
    scoop_regions(plain)  # raises on a dependency cycle between regions
    traced, inputs, _ = fsdp_trace(param_dtype=torch.bfloat16)
    gm = annotate_blocks_pass(traced.gm, traced.example_inputs, collectives=True)
    inside = [n for n in tagged_nodes(gm) if is_collective(n)]
    assert inside and len(region_ids(gm)) <= n_plain
    for n in inside:  # each issue in the region of its wait, and no keep-alive left on a compiled wait
        if not is_wait(n):
            (wait,) = n.users
            assert inductor_tag(wait)["inductor_region"] == inductor_tag(n)["inductor_region"]
        assert all(u.target is not hold for u in n.users)
    scoop_regions(gm)


@pytest.mark.slow
def test_identical_blocks_compile_once_and_the_step_stays_close(tiny_llama):
    stats = {}
    for n_layers in (1, 2):
        gm, example_inputs, inputs = trace_step(tiny_llama(n_layers))
        ref = gm(*inputs)
        records = []
        gm = run_pipeline(gm, example_inputs, build_pipeline(Compile(numerics_changing_optim=True,
                                                                     passes="annotate_blocks")), records=records)
        assert_close(gm(*inputs), ref)
        stats[n_layers] = records[-1]["stats"]
    # one more block: two more regions (its forward, its backward), no more compiles
    assert stats[2]["regions"] == stats[1]["regions"] + 2
    assert stats[2]["distinct_compiles"] == stats[1]["distinct_compiles"]
