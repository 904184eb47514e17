"""annotate_rmsnorm_for_regional_inductor_pass: fused norms (synthetic graphs) and
decomposed ones (make_fx traces of a tiny Llama on CPU), one region per norm instance,
and the regional RMSNorm pipeline end to end (Inductor's C++ backend)."""

from __future__ import annotations

import json
import logging
import operator
import os

import pytest
import torch
import torch.fx

from graph_trainer.config import Compile
from graph_trainer.model import loss_fn
from graph_trainer.compiler.passes.annotate_rmsnorm import DEFAULT_RMSNORM_CANDIDATE_CONFIGS, DEFAULT_RMSNORM_INDUCTOR_CONFIGS, annotate_rmsnorm_for_regional_inductor_pass, find_rmsnorm_instances
from graph_trainer.compiler.pipeline import build_pipeline, run_pipeline
from graph_trainer.compiler.passes.regional_inductor import propose_region_partitions, regional_inductor_pass

from .conftest import (
    D,
    assert_close,
    fused_norm_graph,
    inductor_tag,
    region_ids,
    tagged_nodes,
    trace_step,
    trace_step_generic,
)

aten = torch.ops.aten


# --------------------------------------------------------------------------- fused norms (synthetic)


def test_fused_norms_and_getitems_tagged_others_untouched():
    gm, fakes = fused_norm_graph(n_norms=2)
    gm = annotate_rmsnorm_for_regional_inductor_pass(gm, fakes)
    for n in gm.graph.nodes:
        is_norm = n.target in (aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default)
        is_norm_getitem = n.target is operator.getitem and n.args[0].target in (
            aten._fused_rms_norm.default,
            aten._fused_rms_norm_backward.default,
        )
        assert (inductor_tag(n) is not None) == (is_norm or is_norm_getitem), n
    stats = gm.meta["graph_trainer_pass_stats"]
    assert (stats["forward"], stats["backward"], stats["regions"]) == (2, 1, 3)
    assert stats["getitems"] == 6
    assert "tagged 2 forward + 1 backward RMSNorms" in gm.meta["graph_trainer_pass_summary"]
    assert annotate_rmsnorm_for_regional_inductor_pass.last_stats["regions"] == 3


def test_existing_custom_preserved_and_not_aliased():
    gm, fakes = fused_norm_graph(n_norms=2, with_backward=False)
    shared = {"phase": "forward", "module_fqn": "layers.0.attention_norm", "keep": 0}
    norm_nodes = [n for n in gm.graph.nodes if n.target is aten._fused_rms_norm.default]
    for n in norm_nodes:  # same dict object on several nodes, as annotate() does
        n.meta["custom"] = shared
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, inductor_configs={"max_autotune": False})
    assert shared == {"phase": "forward", "module_fqn": "layers.0.attention_norm", "keep": 0}
    tagged = tagged_nodes(gm)
    for n in tagged:
        c = n.meta["custom"]
        assert c["phase"] == "forward" and "module_fqn" in c and "keep" in c
    a, b = tagged[0], tagged[1]
    assert a.meta["custom"] is not b.meta["custom"]
    assert inductor_tag(a) is not inductor_tag(b)
    assert inductor_tag(a)["inductor_configs"] is not inductor_tag(b)["inductor_configs"]
    inductor_tag(a)["inductor_configs"]["x"] = 1
    assert "x" not in inductor_tag(b)["inductor_configs"]


def test_default_and_explicit_configs_reach_annotation():
    gm, fakes = fused_norm_graph(n_norms=1, with_backward=False)
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes)
    # default: Inductor's defaults, nothing timed (tuning is opt-in: its compile cost)
    assert DEFAULT_RMSNORM_INDUCTOR_CONFIGS == {}
    for n in tagged_nodes(gm):
        assert inductor_tag(n)["inductor_configs"] == {}
        assert set(inductor_tag(n)) == {"inductor_configs", "inductor_region"}
    # tuning asked for: the measured candidates are stored to be timed against the defaults
    gm, fakes = fused_norm_graph(n_norms=1, with_backward=False)
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, candidate_configs=DEFAULT_RMSNORM_CANDIDATE_CONFIGS)
    assert DEFAULT_RMSNORM_CANDIDATE_CONFIGS
    for n in tagged_nodes(gm):
        assert inductor_tag(n)["candidate_inductor_configs"] == DEFAULT_RMSNORM_CANDIDATE_CONFIGS
    # explicit configs: exactly those, nothing timed
    gm, fakes = fused_norm_graph(n_norms=1, with_backward=False)
    cfg = {"max_autotune": True, "triton.cudagraphs": False}
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, inductor_configs=cfg)
    assert all(inductor_tag(n)["inductor_configs"] == cfg for n in tagged_nodes(gm))
    assert all(set(inductor_tag(n)) == {"inductor_configs", "inductor_region"} for n in tagged_nodes(gm))
    assert gm.meta["graph_trainer_pass_stats"]["inductor_configs"] == cfg
    with pytest.raises(ValueError, match="max_autotun"):
        annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, candidate_configs=[{"max_autotun": True}])


def test_unknown_inductor_config_key_rejected():
    gm, fakes = fused_norm_graph(n_norms=1)
    with pytest.raises(ValueError, match=r"max_autotun.*did you mean 'max_autotune'"):
        annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, inductor_configs={"max_autotun": True})
    assert not tagged_nodes(gm)


def test_empty_graph_is_noop():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((x,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    code = gm.code
    assert annotate_rmsnorm_for_regional_inductor_pass(gm, []) is gm
    assert gm.code == code and not tagged_nodes(gm)
    assert gm.meta["graph_trainer_pass_stats"]["regions"] == 0
    # and the compile pass has nothing to do
    assert regional_inductor_pass(gm, []) is gm
    assert gm.meta["graph_trainer_pass_stats"]["regions"] == 0


# --------------------------------------------------------------------------- decomposed norms (make_fx on CPU)


@pytest.fixture(scope="module")
def traced_llama2(tiny_llama):
    return trace_step(tiny_llama(2))


def test_decomposed_norms_found_in_llama(traced_llama2):
    gm, example_inputs, _ = traced_llama2
    n_layers = 2
    instances = find_rmsnorm_instances(gm.graph)
    fwd = [i for i in instances if i["phase"] == "forward"]
    bwd = [i for i in instances if i["phase"] == "backward"]
    assert len(fwd) == len(bwd) == 2 * n_layers + 1
    assert {i["module_fqn"] for i in fwd} == {i["module_fqn"] for i in bwd} == {
        "layers.0.attention_norm",
        "layers.0.ffn_norm",
        "layers.1.attention_norm",
        "layers.1.ffn_norm",
        "norm",
    }
    assert all(i["form"] == "decomposed" for i in instances)


def test_decomposed_norms_tagged_as_separate_regions(traced_llama2):
    gm, example_inputs, _ = traced_llama2
    gm = torch.fx.GraphModule(gm, _copy_graph(gm))
    annotate_rmsnorm_for_regional_inductor_pass(gm, example_inputs)
    stats = gm.meta["graph_trainer_pass_stats"]
    assert (stats["forward"], stats["backward"], stats["regions"]) == (5, 5, 10)
    for n in tagged_nodes(gm):
        assert n.op == "call_function"
        assert n.target not in (aten.mm.default, aten.embedding.default)
        assert n.meta["custom"]["module_fqn"].endswith("norm")
        assert n.meta["custom"]["phase"] in ("forward", "backward")
    # each forward region computes an rsqrt; each backward region a reduction
    for rid in region_ids(gm):
        targets = {n.target for n in tagged_nodes(gm) if inductor_tag(n)["inductor_region"] == rid}
        if rid.startswith("rmsnorm_forward"):
            assert aten.rsqrt.default in targets
        else:
            assert aten.sum.dim_IntList in targets
    assert len(propose_region_partitions(gm)) == 10


def _copy_graph(gm):
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    g._codegen = gm.graph._codegen
    return g


def test_pattern_matched_norm_without_norm_name():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = torch.nn.RMSNorm(D)  # name does not end with "norm"
            self.proj = torch.nn.Linear(D, D)

        def forward(self, x):
            return self.proj(self.pre(x))

    model = Block()
    gm, example_inputs, _ = trace_step_generic(model)
    instances = find_rmsnorm_instances(gm.graph)
    assert [(i["module_fqn"], i["phase"]) for i in instances] == [("pre", "forward"), ("pre", "backward")]


# --------------------------------------------------------------------------- end to end on CPU (Inductor C++ backend)


def test_end_to_end_regional_rmsnorm_cpu(tmp_path, caplog, tiny_llama):
    model = tiny_llama(1)
    gm, example_inputs, inputs = trace_step(model)
    ref = gm(*inputs)
    steps = build_pipeline(Compile(numerics_changing_optim=True, inductor_compilation="regional"))
    names = [s.name for s in steps]
    assert names == [
        "remove_dead_code",
        "remove_noop_views",
        "sac_recompute",
        "reshard_after_forward",
        "overlap_collectives",
        "annotate_rmsnorm_for_regional_inductor",
        "regional_inductor",
    ]
    names.remove("overlap_collectives")  # no collectives on one rank; keeps file numbers below
    names.remove("reshard_after_forward")
    names.remove("sac_recompute")  # no AC here (a no-op)
    steps = [s for s in steps if s.name in names]
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        cgm = run_pipeline(gm, example_inputs, steps, dump_folder=str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.name == "graph_trainer" and "graph pass" in r.getMessage()]
    assert len(lines) == 4
    assert "tagged 3 forward + 3 backward RMSNorms" in lines[2] and "-> 6 regions" in lines[2]
    assert "compiled 6 region(s)" in lines[3]
    out = cgm(*inputs)
    assert_close(out, ref)
    graphs = tmp_path / "graphs"
    files = sorted(f for f in os.listdir(graphs) if not f.endswith(".diff"))  # diffs: tests/test_pass_report.py
    assert files == [
        "00_input.py",
        "01_remove_dead_code.py",
        "02_remove_noop_views.py",
        "03_annotate_rmsnorm_for_regional_inductor.py",
        "04_regional_inductor.py",
        "summary.json",
    ]
    summary = json.loads((graphs / "summary.json").read_text())
    assert [r["pass"] for r in summary] == ["input"] + names
    assert summary[3]["stats"]["regions"] == 6
    assert summary[0]["ops"]["aten.rsqrt.default"] == 3
    assert "aten.rsqrt.default" not in summary[4]["ops"]  # all inside compiled regions
    assert "aten.mm.default" in summary[4]["ops"]  # matmuls stay eager


def test_activation_checkpointing_recomputed_norms_get_own_regions(tiny_llama):
    """With AC the backward phase holds each block's recomputed forward norm next
    to the norm's backward: they must become separate regions (no cycle)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from graph_trainer.trace import trace_train_step

    model = tiny_llama(1)
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    tokens, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))

    traced = trace_train_step(model, loss_fn, tokens, labels)
    gm = traced.gm
    flat = [p for _, p in model.named_parameters()] + [b for _, b in model.named_buffers()] + [tokens, labels]
    with torch.no_grad():
        ref = gm(*flat)
    gm = annotate_rmsnorm_for_regional_inductor_pass(gm, traced.example_inputs)
    stats = gm.meta["graph_trainer_pass_stats"]
    assert (stats["forward"], stats["backward"], stats["recompute"], stats["regions"]) == (3, 3, 2, 8)
    assert "+ 2 recomputed" in gm.meta["graph_trainer_pass_summary"]
    assert len(propose_region_partitions(gm)) == 8
    gm = regional_inductor_pass(gm, traced.example_inputs)
    assert gm.meta["graph_trainer_pass_stats"]["regions"] == 8
    with torch.no_grad():
        assert_close(gm(*flat), ref)
