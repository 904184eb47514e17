"""sac_recompute: op-level SAC under make_fx only tags nodes; the pass recomputes them in the backward."""

import copy
import dataclasses
import functools
import operator
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy
from torchtitan.config import ActivationCheckpoint

from _runs import train_debug  # tests/ is on sys.path
from graph_trainer import AC_REGION_KEY, MODULE_FQN_KEY
from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.node_meta import custom_meta, phase_of
from graph_trainer.compiler.passes.remove_noop_views import remove_noop_views_pass
from graph_trainer.compiler.passes.sac_recompute import RECOMPUTED_FROM_KEY, sac_recompute_pass, saved_for_backward
from graph_trainer.distributed.parallelize import apply_ac_for_trace
from graph_trainer.llama3 import llama3_args

from .conftest import aten, assert_bitwise, c10d, call_targets, fx_graph, module, run_no_grad, stats, trace_step

MM, N_LAYERS = aten.mm.default, 3


def _traced(tiny_llama, tmp_path, mode, option="op"):
    model = tiny_llama(N_LAYERS)
    cfg = SimpleNamespace(activation_checkpoint=ActivationCheckpoint(mode=mode, selective_ac_option=option),
                          job=SimpleNamespace(dump_folder=str(tmp_path)))
    apply_ac_for_trace(model, cfg)
    torch.manual_seed(1)
    gm, example_inputs, flat = trace_step(model, seq=16)
    return remove_noop_views_pass(gm, example_inputs), example_inputs, flat  # the pipeline's order


def _node(g, target, args, val=None, phase="forward", region="layers.0", policy=CheckpointPolicy.PREFER_RECOMPUTE):
    """A node of ``g`` in AC region ``region`` (None: outside any block) with its SAC policy and ``val``."""
    n = g.call_function(target, args)
    n.meta.update(custom={"phase": phase, **({AC_REGION_KEY: region} if region else {})}, recompute=policy,
                  val=torch.empty(4) if val is None else val)
    return n


def _copies(gm):
    """``{name of the recomputed node: its copy}``."""
    return {n.meta[RECOMPUTED_FROM_KEY]: n for n in gm.graph.nodes if RECOMPUTED_FROM_KEY in n.meta}


def test_op_sac_recomputes_in_backward_bitwise_save_matmuls_and_cheap_only(tiny_llama, tmp_path):
    """Copies in the backward; saving matmuls keeps in between; all_but_cheap recomputes silu, mul; each bitwise."""
    n_mm_none = call_targets(_traced(tiny_llama, tmp_path / "none", "none")[0]).count(MM)
    gm, example_inputs, flat = _traced(tiny_llama, tmp_path / "op", "selective")
    assert call_targets(gm).count(MM) == n_mm_none  # as traced, op-level SAC recomputes nothing
    ref = run_no_grad(gm, flat)
    peak_before, _ = estimate_peak_memory(gm)
    saved_before = {n.name for n in saved_for_backward(gm.graph)}
    gm_mm = sac_recompute_pass(copy.deepcopy(gm), example_inputs, save_ops=[MM])
    gm_cheap = sac_recompute_pass(copy.deepcopy(gm), example_inputs, cheap_only=True)
    gm = sac_recompute_pass(gm, example_inputs)
    s, mm_s, cheap = stats(gm), stats(gm_mm), stats(gm_cheap)
    copies = [n for n in gm.graph.nodes if RECOMPUTED_FROM_KEY in n.meta]
    assert s["recomputed"] == len(copies) > 0
    # torchtitan's policy saves wq, wv, w1, w2 of a block's 7 mms; the backward needs wk, wo, w3 again
    assert s["recomputed_mm"] == 3 * N_LAYERS == call_targets(gm).count(MM) - n_mm_none
    assert not any("recompute" in n.meta for n in gm.graph.nodes)  # consumed: compile_fx must not remat again
    # backward copies of ops inside a checkpointed block; recursion never crosses a block boundary
    for c in copies:
        assert phase_of(c) == "backward" and custom_meta(c)[AC_REGION_KEY]
        assert custom_meta(c).get(MODULE_FQN_KEY) not in (None, "norm", "output")
        assert all(custom_meta(a)[AC_REGION_KEY] == custom_meta(c)[AC_REGION_KEY]
                   for a in c.all_input_nodes if RECOMPUTED_FROM_KEY in a.meta)
    assert s["saved_bytes_after"] < s["saved_bytes_before"]  # fewer activations kept, a lower peak
    assert len(saved_for_backward(gm.graph)) < len(saved_before) and estimate_peak_memory(gm)[0] < peak_before
    # save matmuls: no mm recomputed, the other tagged ops still are; it keeps in between
    assert mm_s["recomputed_mm"] == 0 and 0 < mm_s["recomputed"] < s["recomputed"]
    assert s["saved_bytes_after"] < mm_s["saved_bytes_after"] < mm_s["saved_bytes_before"]
    # all_but_cheap: silu and mul recomputed from the kept matmuls, nothing new kept
    copies = [n for n in gm_cheap.graph.nodes if RECOMPUTED_FROM_KEY in n.meta]
    targets = {c.target for c in copies}
    assert cheap["recomputed_mm"] == 0 and cheap["recomputed"] == len(copies) > 0
    assert {aten.silu.default, aten.mul.Tensor} <= targets
    assert all(torch.Tag.pointwise in t.tags or t is aten._to_copy.default
               or t._schema.returns[0].alias_info is not None for t in targets)  # or a view of one
    assert {n.name for n in saved_for_backward(gm_cheap.graph)} < saved_before  # fewer values kept, none added
    assert cheap["saved_bytes_after"] < cheap["saved_bytes_before"]
    for g in (gm, gm_mm, gm_cheap):  # same ops on the same inputs: loss and every gradient bit for bit
        assert_bitwise(run_no_grad(g, flat), ref)


def test_mutating_ops_and_ops_outside_blocks_are_never_recomputed():
    g, (x,) = fx_graph("x")
    node, bwd = functools.partial(_node, g), functools.partial(_node, g, phase="backward", region=None)
    a = node(aten.relu.default, (x,))
    b = node(aten.add_.Tensor, (a, a))  # in-place: saved
    c = node(aten.neg.default, (x,), region=None)  # outside any block: saved
    d = node(aten.sin.default, (x,), policy=CheckpointPolicy.MUST_SAVE)
    e = node(aten.cos.default, (d,), region="layers.1")
    out = bwd(aten.mul.Tensor, (b, c))
    out2 = bwd(aten.mul.Tensor, (e, out))
    copies = _copies(sac_recompute_pass(module(g, out2)))
    assert set(copies) == {e.name}  # only cos; its MUST_SAVE input d is used as saved
    assert copies[e.name].args == (d,) and out.args == (b, c) and out2.args == (copies[e.name], out)


def test_cheap_only_gathers_activations_again_and_leaves_parameter_gathers():
    """``all_but_cheap``: a TP activation all-gather is redone in the backward; parameter gathers stay."""
    g, (x, w) = fx_graph("x", "w")
    node, bwd = functools.partial(_node, g), functools.partial(_node, g, phase="backward", region=None)
    half, full, rows = torch.empty(4, 8), torch.empty(8, 8), torch.empty(4, 1)
    h = node(aten.relu.default, (x,), half, policy=CheckpointPolicy.MUST_SAVE)
    norm = node(aten._fused_rms_norm.default, (h, [8], None, 1e-5), (half, rows))
    act, rstd = (node(operator.getitem, (norm, i), v) for i, v in ((0, half), (1, rows)))
    ag = node(c10d.all_gather_into_tensor.default, (act, 2, "0"), full)
    wait = node(c10d.wait_tensor.default, (ag,), full)
    gathered = node(aten.view.default, (wait, [8, 8]), full)
    wag = node(c10d.all_gather_into_tensor.default, (node(aten._to_copy.default, (w,), half), 2, "1"), full)
    wgathered = node(c10d.wait_tensor.default, (wag,), full)
    out = node(aten.mm.default, (gathered, wgathered), full)
    grad = bwd(aten.mm.default, (gathered, out), full)
    grad_w = bwd(aten.mm.default, (wgathered, grad), full)
    grad_h = bwd(aten.mul.Tensor, (h, rstd), half)  # the norm's backward reads both
    gm = sac_recompute_pass(module(g, out, grad_w, grad_h), cheap_only=True)
    copies = _copies(gm)
    assert set(copies) == {n.name for n in (norm, act, rstd, ag, wait, gathered)}
    assert copies[ag.name].args[0] is copies[act.name] and copies[norm.name].args[0] is h
    assert phase_of(copies[ag.name]) == "backward"
    assert grad.args[0] is copies[gathered.name] and grad_w.args[0] is wgathered  # the parameter's stays
    assert set(saved_for_backward(gm.graph)) == {h, out, wgathered}


@pytest.mark.parametrize("mode, option", [("none", "op"), ("full", "op"), ("selective", "2")])
def test_no_op_without_op_level_sac(tiny_llama, tmp_path, mode, option):
    """Layer-level AC really recomputes under make_fx (no tags); no AC has nothing to do."""
    gm, example_inputs, _ = _traced(tiny_llama, tmp_path, mode, option)
    n = len(gm.graph.nodes)
    gm = sac_recompute_pass(gm, example_inputs)
    assert stats(gm)["recomputed"] == 0 and len(gm.graph.nodes) == n


@pytest.mark.slow
def test_full_inductor_ignores_sac_tags_without_the_pass(tmp_path, monkeypatch):
    """Without sac_recompute, full_inductor drops the SAC tags (compile_fx's remat rejected this graph)."""
    monkeypatch.setitem(llama3_args, "debugmodel", dataclasses.replace(llama3_args["debugmodel"], n_layers=1))
    flags = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
             "--training.steps", "2", "--compile.inductor_compilation", "full", "--compile.graph_cache_dir", "off"]
    # no cached compile (it would skip compile_fx's remat); the configs' own patch: pytest >= 9.2's monkeypatch
    # undoes such a module attribute with delattr, hiding a torch config for every later test
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        off, _ = train_debug(tmp_path, "off", *flags, "--compile.disable_passes", "sac_recompute")
        on, _ = train_debug(tmp_path, "on", *flags)
    assert [r["loss"] for r in off] == pytest.approx([r["loss"] for r in on], rel=1e-5)
