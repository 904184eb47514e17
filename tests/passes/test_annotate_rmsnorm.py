"""annotate_rmsnorm_for_regional_inductor_pass: fused and decomposed norms, one region each, end to end."""

import contextlib
import json
import operator
from collections import OrderedDict

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from graph_trainer.config import Compile
from graph_trainer.compiler.matching import find_rmsnorm_instances
from graph_trainer.compiler.passes.annotate_rmsnorm import DEFAULT_RMSNORM_CANDIDATE_CONFIGS as DEFAULTS
from graph_trainer.compiler.passes.annotate_rmsnorm import annotate_rmsnorm_for_regional_inductor_pass as annotate
from graph_trainer.compiler.pipeline import build_pipeline, run_pipeline
from graph_trainer.compiler.passes.regional_inductor import propose_region_partitions, regional_inductor_pass
from graph_trainer.trace import trace_train_step

from .conftest import (D, aten, assert_close, by_region, fused_norm_graph, inductor_tag, module, run_no_grad, stats,
                       tagged_nodes, trace_step)

FUSED = (aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default)


def test_fused_norms_and_getitems_tagged_others_untouched():
    gm = annotate(*fused_norm_graph(n_norms=2))
    getitems = {n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0].target in FUSED}
    assert set(tagged_nodes(gm)) == {n for n in gm.graph.nodes if n.target in FUSED} | getitems
    assert [stats(gm)[k] for k in ("forward", "backward", "regions", "getitems")] == [2, 1, 3, 6]
    assert "tagged 2 forward + 1 backward RMSNorms" in gm.meta["graph_trainer_pass_summary"]


def test_empty_graph_is_noop():
    g = torch.fx.Graph()
    gm = module(g, g.placeholder("x"))
    code = gm.code
    assert annotate(gm, []) is gm and gm.code == code and not tagged_nodes(gm) and stats(gm)["regions"] == 0
    assert regional_inductor_pass(gm, []) is gm and stats(gm)["regions"] == 0  # nothing to compile


def test_existing_custom_preserved_and_not_aliased():
    gm, fakes = fused_norm_graph(n_norms=2, with_backward=False)
    shared = {"phase": "forward", "module_fqn": "layers.0.attention_norm", "keep": 0}
    for n in gm.graph.nodes:  # one dict object on several nodes, as annotate() does
        if n.target is aten._fused_rms_norm.default:
            n.meta["custom"] = shared
    annotate(gm, fakes, inductor_configs={"max_autotune": False})
    assert shared == {"phase": "forward", "module_fqn": "layers.0.attention_norm", "keep": 0}
    a, b, *_ = tagged = tagged_nodes(gm)
    assert all({"phase", "module_fqn", "keep"} <= set(n.meta["custom"]) for n in tagged)
    assert a.meta["custom"] is not b.meta["custom"] and inductor_tag(a) is not inductor_tag(b)
    inductor_tag(a)["inductor_configs"]["x"] = 1
    assert "x" not in inductor_tag(b)["inductor_configs"]


@pytest.mark.parametrize("kwargs, configs, candidates", [
    ({}, {}, None), ({"candidate_configs": DEFAULTS}, {}, DEFAULTS),  # default: Inductor's defaults, nothing timed
    ({"inductor_configs": {"max_autotune": True, "triton.cudagraphs": False}},
     {"max_autotune": True, "triton.cudagraphs": False}, None),
    ({"inductor_configs": {"max_autotun": True}}, ValueError, None),  # an unknown key: refused, nothing tagged
    ({"candidate_configs": [{"max_autotun": True}]}, ValueError, None),
])
def test_configs_reach_the_annotation_unknown_keys_refused(kwargs, configs, candidates):
    gm, fakes = fused_norm_graph(n_norms=1)
    refused = pytest.raises(ValueError, match=r"max_autotun.*did you mean 'max_autotune'")
    with refused if configs is ValueError else contextlib.nullcontext():
        annotate(gm, fakes, **kwargs)
    assert configs is ValueError or stats(gm)["inductor_configs"] == configs
    assert len(tagged_nodes(gm)) == (0 if configs is ValueError else 6)
    for n in tagged_nodes(gm):
        assert inductor_tag(n)["inductor_configs"] == configs
        assert inductor_tag(n).get("candidate_inductor_configs") == candidates


def test_decomposed_norms_of_llama_tagged_as_separate_regions(tiny_llama):
    gm, example_inputs, _ = trace_step(tiny_llama(2))
    instances = find_rmsnorm_instances(gm.graph)
    assert all(i["form"] == "decomposed" for i in instances)
    norms = {"layers.0.attention_norm", "layers.0.ffn_norm", "layers.1.attention_norm", "layers.1.ffn_norm", "norm"}
    for phase in ("forward", "backward"):
        assert sorted(i["module_fqn"] for i in instances if i["phase"] == phase) == sorted(norms)
    annotate(gm, example_inputs)
    assert [stats(gm)[k] for k in ("forward", "backward", "regions")] == [5, 5, 10]
    for n in tagged_nodes(gm):
        assert n.op == "call_function" and n.target not in (aten.mm.default, aten.embedding.default)
        assert n.meta["custom"]["module_fqn"].endswith("norm")
    for rid, nodes in by_region(gm).items():  # each forward region computes an rsqrt, each backward one a reduction
        targets = {n.target for n in nodes}
        assert (aten.rsqrt.default if rid.startswith("rmsnorm_forward") else aten.sum.dim_IntList) in targets
    assert len(propose_region_partitions(gm)) == 10


def test_pattern_matched_norm_without_norm_name():
    model = torch.nn.Sequential(OrderedDict(pre=torch.nn.RMSNorm(D), proj=torch.nn.Linear(D, D)))  # no "norm" name
    gm = trace_train_step(model, lambda out, _labels: out.square().mean(), torch.randn(2, 4, D), torch.zeros(1)).gm
    instances = find_rmsnorm_instances(gm.graph)
    assert [(i["module_fqn"], i["phase"]) for i in instances] == [("pre", "forward"), ("pre", "backward")]


def test_end_to_end_regional_rmsnorm_cpu(tmp_path, log_lines, tiny_llama):
    gm, example_inputs, inputs = trace_step(tiny_llama(1))
    ref = gm(*inputs)
    names = ["remove_dead_code", "remove_noop_views", "annotate_rmsnorm_for_regional_inductor", "regional_inductor"]
    steps = build_pipeline(Compile(numerics_changing_optim=True, inductor_compilation="regional"))
    steps = [s for s in steps if s.name in names]  # no collectives or AC on one rank: the rest are no-ops
    assert [s.name for s in steps] == names
    cgm = run_pipeline(gm, example_inputs, steps, dump_folder=str(tmp_path))
    lines = [m for m in log_lines if "graph pass" in m]
    assert len(lines) == 4 and "tagged 3 forward + 3 backward RMSNorms" in lines[2] and "-> 6 regions" in lines[2]
    assert "compiled 6 region(s)" in lines[3]
    assert_close(cgm(*inputs), ref)
    summary = json.loads((tmp_path / "graphs" / "summary.json").read_text())
    assert [r["pass"] for r in summary] == ["input"] + names
    assert summary[3]["stats"]["regions"] == 6 and summary[0]["ops"]["aten.rsqrt.default"] == 3
    assert "aten.rsqrt.default" not in summary[4]["ops"]  # all inside compiled regions
    assert "aten.mm.default" in summary[4]["ops"]  # matmuls stay eager


def test_activation_checkpointing_recomputed_norms_get_own_regions(tiny_llama):
    """With AC, recomputed forward norms and norm backwards become separate regions (no cycle)."""
    model = tiny_llama(1)
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    gm, example_inputs, inputs = trace_step(model)
    ref = run_no_grad(gm, inputs)
    gm = annotate(gm, example_inputs)
    assert [stats(gm)[k] for k in ("forward", "backward", "recompute", "regions")] == [3, 3, 2, 8]
    assert "+ 2 recomputed" in gm.meta["graph_trainer_pass_summary"] and len(propose_region_partitions(gm)) == 8
    gm = regional_inductor_pass(gm, example_inputs)
    assert stats(gm)["regions"] == 8
    assert_close(run_no_grad(gm, inputs), ref)
