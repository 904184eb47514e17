"""sac_recompute: op-level selective AC under make_fx saves everything and only tags
nodes; the pass recomputes the tagged ops in the backward, as eager SAC does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graph_trainer import AC_REGION_KEY, MODULE_FQN_KEY
from graph_trainer.compiler.passes.remove_noop_views import remove_noop_views_pass
from graph_trainer.compiler.passes.sac_recompute import sac_recompute_pass
from graph_trainer.compiler.common import custom_meta, phase_of
from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.passes.sac_recompute import RECOMPUTED_FROM_KEY, saved_for_backward

MM = torch.ops.aten.mm.default
N_LAYERS = 3


def _traced(tiny_llama, tmp_path, mode, option="op", seq=16):
    from torchtitan.config import ActivationCheckpoint

    from graph_trainer.model import loss_fn
    from graph_trainer.distributed.parallelize import apply_ac_for_trace
    from graph_trainer.trace import trace_train_step

    model = tiny_llama(N_LAYERS)
    cfg = SimpleNamespace(
        activation_checkpoint=ActivationCheckpoint(mode=mode, selective_ac_option=option),
        job=SimpleNamespace(dump_folder=str(tmp_path)),
    )
    apply_ac_for_trace(model, cfg)
    torch.manual_seed(1)
    tokens, labels = torch.randint(0, 64, (2, seq)), torch.randint(0, 64, (2, seq))

    traced = trace_train_step(model, loss_fn, tokens, labels)
    flat = [p for p in model.parameters()] + [b for b in model.buffers()] + [tokens, labels]
    gm = remove_noop_views_pass(traced.gm, traced.example_inputs)  # the pipeline's order
    return gm, traced.example_inputs, flat


def _n_mm(gm, phase=None):
    return sum(n.target is MM and (phase is None or phase_of(n) == phase) for n in gm.graph.nodes)


def test_op_sac_recomputes_in_backward_and_keeps_numerics_bitwise(tiny_llama, tmp_path):
    gm_none, _, _ = _traced(tiny_llama, tmp_path / "none", "none")
    gm, example_inputs, flat = _traced(tiny_llama, tmp_path / "op", "selective")
    # as traced, op-level SAC recomputes nothing: the same matmuls as without AC
    assert _n_mm(gm) == _n_mm(gm_none)
    with torch.no_grad():
        ref = gm(*flat)
    peak_before, _ = estimate_peak_memory(gm)
    saved_before = len(saved_for_backward(gm.graph))

    gm = sac_recompute_pass(gm, example_inputs)
    stats = gm.meta["graph_trainer_pass_stats"]
    copies = [n for n in gm.graph.nodes if RECOMPUTED_FROM_KEY in n.meta]
    assert stats["recomputed"] == len(copies) > 0
    # torchtitan's policy saves every other mm of a block (wq, wv, w1, w2 of 7); the
    # backward needs wk, wo and w3 again (w2's output only feeds the saved residual add)
    assert stats["recomputed_mm"] == 3 * N_LAYERS == _n_mm(gm) - _n_mm(gm_none)
    assert all(phase_of(c) == "backward" for c in copies)
    assert not any("recompute" in n.meta for n in gm.graph.nodes)  # consumed: compile_fx must not remat again
    # only ops inside a checkpointed block; recursion never crosses a block boundary
    assert all(custom_meta(c).get(AC_REGION_KEY) for c in copies)
    assert not any(custom_meta(c).get(MODULE_FQN_KEY) in (None, "norm", "output") for c in copies)
    for c in copies:
        for a in c.all_input_nodes:
            if RECOMPUTED_FROM_KEY in a.meta:
                assert custom_meta(a)[AC_REGION_KEY] == custom_meta(c)[AC_REGION_KEY]
    # fewer activations kept for the backward, a lower static peak
    assert stats["saved_bytes_after"] < stats["saved_bytes_before"]
    assert len(saved_for_backward(gm.graph)) < saved_before
    assert estimate_peak_memory(gm)[0] < peak_before
    # same ops on the same inputs: loss and every gradient bit for bit
    with torch.no_grad():
        out = gm(*flat)
    assert len(out) == len(ref) and all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("mode, option", [("none", "op"), ("full", "op"), ("selective", "2")])
def test_no_op_without_op_level_sac(tiny_llama, tmp_path, mode, option):
    """Layer-level AC really recomputes under make_fx (no tags); no AC has nothing to do."""
    gm, example_inputs, _ = _traced(tiny_llama, tmp_path, mode, option)
    n = len(gm.graph.nodes)
    gm = sac_recompute_pass(gm, example_inputs)
    assert gm.meta["graph_trainer_pass_stats"]["recomputed"] == 0 and len(gm.graph.nodes) == n


def test_mutating_ops_and_ops_outside_blocks_are_never_recomputed():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")

    def node(target, args, phase, region="layers.0", policy=CheckpointPolicy.PREFER_RECOMPUTE):
        n = g.call_function(target, args)
        n.meta["custom"] = {"phase": phase, **({AC_REGION_KEY: region} if region else {})}
        n.meta["recompute"] = policy
        n.meta["val"] = torch.empty(4)
        return n

    a = node(aten.relu.default, (x,), "forward")
    b = node(aten.add_.Tensor, (a, a), "forward")  # in-place: saved
    c = node(aten.neg.default, (x,), "forward", region=None)  # outside any block: saved
    d = node(aten.sin.default, (x,), "forward", policy=CheckpointPolicy.MUST_SAVE)
    e = node(aten.cos.default, (d,), "forward", region="layers.1")
    out = node(aten.mul.Tensor, (b, c), "backward", region=None)
    out2 = node(aten.mul.Tensor, (e, out), "backward", region=None)
    g.output((out2,))
    gm = sac_recompute_pass(torch.fx.GraphModule(torch.nn.Module(), g))
    copies = {n.meta[RECOMPUTED_FROM_KEY]: n for n in gm.graph.nodes if RECOMPUTED_FROM_KEY in n.meta}
    assert set(copies) == {e.name}  # only cos; its MUST_SAVE input d is used as saved
    assert copies[e.name].args == (d,)
    assert out.args == (b, c) and out2.args == (copies[e.name], out)


def test_save_matmuls_recomputes_only_the_cheap_ops(tiny_llama, tmp_path):
    """--compile.sac.save_matmuls: no mm recomputed, the other tagged ops still are;
    it keeps more than plain op SAC and less than no recompute; numerics unchanged."""
    gm_sac, example_inputs, flat = _traced(tiny_llama, tmp_path / "a", "selective")
    with torch.no_grad():
        ref = gm_sac(*flat)
    gm_sac = sac_recompute_pass(gm_sac, example_inputs)
    gm, example_inputs, _ = _traced(tiny_llama, tmp_path / "b", "selective")
    gm = sac_recompute_pass(gm, example_inputs, save_ops=[MM])
    stats, sac = gm.meta["graph_trainer_pass_stats"], gm_sac.meta["graph_trainer_pass_stats"]
    assert stats["recomputed_mm"] == 0 and 0 < stats["recomputed"] < sac["recomputed"]
    assert sac["saved_bytes_after"] < stats["saved_bytes_after"] < stats["saved_bytes_before"]
    with torch.no_grad():
        out = gm(*flat)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.slow
def test_full_inductor_ignores_sac_tags_without_the_pass(tmp_path, monkeypatch):
    """With sac_recompute disabled the tags are still there; full_inductor drops them, so
    torch >= 2.12's own remat inside compile_fx does not run: it rejected this graph (the
    CPU flash-attention op is tagged for recompute and counts as a random op)."""
    from test_train import _train

    # a cached compile of the same graph would skip compile_fx's remat (the tags are not in the key)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    flags = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
             "--training.steps", "2", "--compile.inductor_compilation", "full"]
    off, _ = _train(tmp_path, "off", *flags, "--compile.disable_passes", "sac_recompute")
    on, _ = _train(tmp_path, "on", *flags)
    assert [r["loss"] for r in off] == pytest.approx([r["loss"] for r in on], rel=1e-5)
