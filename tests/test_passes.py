"""CPU tests for graph_trainer.passes (synthetic FX graphs + tiny make_fx traces)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import operator
import os

import pytest
import torch
import torch.fx
import torch.fx.traceback as fxtb
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY
from graph_trainer.passes import (
    DEFAULT_ORDER,
    DEFAULT_RMSNORM_CANDIDATE_CONFIGS,
    DEFAULT_RMSNORM_INDUCTOR_CONFIGS,
    PASSES,
    annotate_flex_attention_for_regional_inductor_pass,
    annotate_rmsnorm_for_regional_inductor_pass,
    cudagraph_pass,
    find_rmsnorm_instances,
    propose_region_partitions,
    regional_inductor_pass,
    remove_dead_code_pass,
    remove_noop_views_pass,
    resolve_pass_names,
    run_passes,
)
from graph_trainer.passes.regional_inductor import scoop_regions

aten = torch.ops.aten
D = 16


# --------------------------------------------------------------------------- helpers


def _tag(node):
    return (node.meta.get("custom") or {}).get(COMPILE_WITH_INDUCTOR_KEY)


def _tagged(gm):
    return [n for n in gm.graph.nodes if _tag(n) is not None]


def _region_ids(gm):
    return {_tag(n)["inductor_region"] for n in _tagged(gm)}


def _fake_prop(gm, shapes):
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(torch.empty(s)) for s in shapes]
    FakeTensorProp(gm, mode).propagate(*fakes)
    return fakes


def _fused_graph(n_norms=2, with_backward=True, meta=True):
    """x -> [fused rms norm -> mul]*n_norms; optional fused backward of norm 0.

    Every node gets custom {"phase", "module_fqn", "keep": i} metadata."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    go = g.placeholder("go")
    cur, first_rstd = x, None
    for i in range(n_norms):
        fqn = f"layers.{i}.attention_norm"
        n = g.call_function(aten._fused_rms_norm.default, (cur, [D], w, 1e-6))
        out = g.call_function(operator.getitem, (n, 0))
        rstd = g.call_function(operator.getitem, (n, 1))
        first_rstd = first_rstd if first_rstd is not None else rstd
        cur = g.call_function(aten.mul.Tensor, (out, 2.0))
        if meta:
            for node in (n, out, rstd):
                node.meta["custom"] = {"phase": "forward", "module_fqn": fqn, "keep": i}
            cur.meta["custom"] = {"phase": "forward", "module_fqn": f"layers.{i}.attention"}
    outs = [cur]
    if with_backward:
        b = g.call_function(aten._fused_rms_norm_backward.default, (go, x, [D], first_rstd, w, [True, True]))
        gi = g.call_function(operator.getitem, (b, 0))
        gw = g.call_function(operator.getitem, (b, 1))
        if meta:
            for node in (b, gi, gw):
                node.meta["custom"] = {"phase": "backward", "module_fqn": "layers.0.attention_norm"}
        outs += [gi, gw]
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    fakes = _fake_prop(gm, [(4, 8, D), (D,), (4, 8, D)])
    return gm, fakes


def _independent_norms_graph():
    """Two fused norms of independent inputs, no path between them: a single
    CapabilityBasedPartitioner (torch 2.11 regional_inductor) would merge them."""
    g = torch.fx.Graph()
    x, y, w = g.placeholder("x"), g.placeholder("y"), g.placeholder("w")
    outs = []
    for inp in (x, y):
        n = g.call_function(aten._fused_rms_norm.default, (inp, [D], w, 1e-6))
        outs.append(g.call_function(operator.getitem, (n, 0)))
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    fakes = _fake_prop(gm, [(2, D), (2, D), (D,)])
    return gm, fakes


def _small_llama(n_layers):
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    args = dataclasses.replace(
        llama3_args["debugmodel"], n_layers=n_layers, dim=32, n_heads=2, vocab_size=64, max_seq_len=32
    )
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


@contextlib.contextmanager
def _module_fqn_hooks(model):
    """Like graph_trainer.trace: annotate nodes with the innermost module FQN."""
    stacks: dict[str, list] = {}
    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def pre(_m, _a, name=name):
            cm = fxtb.annotate({"module_fqn": name})
            cm.__enter__()
            stacks.setdefault(name, []).append(cm)

        def post(_m, _a, _o, name=name):
            stacks[name].pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _make_fx_step(model, step, *args):
    """make_fx(step) with phase/module_fqn metadata; backward nodes inherit the
    module_fqn of the forward node with the same seq_nr (as graph_trainer.trace)."""
    with _module_fqn_hooks(model), fxtb.preserve_node_meta():
        gm = make_fx(step, tracing_mode="fake")(*args)
    fqn_by_seq = {}
    for n in gm.graph.nodes:
        c = n.meta.get("custom") or {}
        if c.get("phase") == "forward" and "module_fqn" in c:
            fqn_by_seq.setdefault(n.meta.get("seq_nr"), c["module_fqn"])
    for n in gm.graph.nodes:
        c = n.meta.get("custom") or {}
        if c.get("phase") == "backward" and n.meta.get("seq_nr") in fqn_by_seq:
            n.meta["custom"] = {**c, "module_fqn": fqn_by_seq[n.meta["seq_nr"]]}
    return gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _backward(loss, params):
    from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks

    with fxtb.annotate({"phase": "backward"}):
        setup_stacktrace_preservation_hooks([loss.grad_fn])
        return torch.autograd.grad(loss, params)


def _trace_step(model, batch=2, seq=8, vocab=64):
    """The lead's pattern: forward + loss + autograd.grad in one make_fx graph."""
    params = dict(model.named_parameters())
    bufs = dict(model.named_buffers())
    tokens = torch.randint(0, vocab, (batch, seq))
    labels = torch.randint(0, vocab, (batch, seq))

    def step(params, bufs, tokens, labels):
        with fxtb.annotate({"phase": "forward"}):
            out = torch.func.functional_call(model, {**params, **bufs}, (tokens,))
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten(0, 1))
        return (loss, *_backward(loss, list(params.values())))

    gm, example_inputs = _make_fx_step(model, step, params, bufs, tokens, labels)
    return gm, example_inputs, (params, bufs, tokens, labels)


def _assert_close(outs, refs, rtol=1e-4, atol=1e-5):
    assert len(outs) == len(refs)
    for a, b in zip(outs, refs):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- RMSNorm annotation (fused, synthetic)


def test_fused_norms_and_getitems_tagged_others_untouched():
    gm, fakes = _fused_graph(n_norms=2)
    gm = annotate_rmsnorm_for_regional_inductor_pass(gm, fakes)
    for n in gm.graph.nodes:
        is_norm = n.target in (aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default)
        is_norm_getitem = n.target is operator.getitem and n.args[0].target in (
            aten._fused_rms_norm.default,
            aten._fused_rms_norm_backward.default,
        )
        assert (_tag(n) is not None) == (is_norm or is_norm_getitem), n
    stats = gm.meta["graph_trainer_pass_stats"]
    assert (stats["forward"], stats["backward"], stats["regions"]) == (2, 1, 3)
    assert stats["getitems"] == 6
    assert "tagged 2 forward + 1 backward RMSNorms" in gm.meta["graph_trainer_pass_summary"]
    assert annotate_rmsnorm_for_regional_inductor_pass.last_stats["regions"] == 3


def test_existing_custom_preserved_and_not_aliased():
    gm, fakes = _fused_graph(n_norms=2, with_backward=False)
    shared = {"phase": "forward", "module_fqn": "layers.0.attention_norm", "keep": 0}
    norm_nodes = [n for n in gm.graph.nodes if n.target is aten._fused_rms_norm.default]
    for n in norm_nodes:  # same dict object on several nodes, as annotate() does
        n.meta["custom"] = shared
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, inductor_configs={"max_autotune": False})
    assert shared == {"phase": "forward", "module_fqn": "layers.0.attention_norm", "keep": 0}
    tagged = _tagged(gm)
    for n in tagged:
        c = n.meta["custom"]
        assert c["phase"] == "forward" and "module_fqn" in c and "keep" in c
    a, b = tagged[0], tagged[1]
    assert a.meta["custom"] is not b.meta["custom"]
    assert _tag(a) is not _tag(b)
    assert _tag(a)["inductor_configs"] is not _tag(b)["inductor_configs"]
    _tag(a)["inductor_configs"]["x"] = 1
    assert "x" not in _tag(b)["inductor_configs"]


def test_default_and_explicit_configs_reach_annotation():
    gm, fakes = _fused_graph(n_norms=1, with_backward=False)
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes)
    # default: Inductor's defaults, nothing timed (tuning is opt-in: its compile cost)
    assert DEFAULT_RMSNORM_INDUCTOR_CONFIGS == {}
    for n in _tagged(gm):
        assert _tag(n)["inductor_configs"] == {}
        assert set(_tag(n)) == {"inductor_configs", "inductor_region"}
    # tuning asked for: the measured candidates are stored to be timed against the defaults
    gm, fakes = _fused_graph(n_norms=1, with_backward=False)
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, candidate_configs=DEFAULT_RMSNORM_CANDIDATE_CONFIGS)
    assert DEFAULT_RMSNORM_CANDIDATE_CONFIGS
    for n in _tagged(gm):
        assert _tag(n)["candidate_inductor_configs"] == DEFAULT_RMSNORM_CANDIDATE_CONFIGS
    # explicit configs: exactly those, nothing timed
    gm, fakes = _fused_graph(n_norms=1, with_backward=False)
    cfg = {"max_autotune": True, "triton.cudagraphs": False}
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, inductor_configs=cfg)
    assert all(_tag(n)["inductor_configs"] == cfg for n in _tagged(gm))
    assert all(set(_tag(n)) == {"inductor_configs", "inductor_region"} for n in _tagged(gm))
    assert gm.meta["graph_trainer_pass_stats"]["inductor_configs"] == cfg
    with pytest.raises(ValueError, match="max_autotun"):
        annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, candidate_configs=[{"max_autotun": True}])


def _timed_fused_graph(n_norms, candidates):
    gm, _ = _fused_graph(n_norms=n_norms)
    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, inductor_configs={}, candidate_configs=candidates)
    return gm, fakes


@pytest.mark.parametrize("fastest", [0, 1])
def test_candidate_configs_timed_and_fastest_kept(fastest):
    """Each distinct region is compiled once per config set and the variant the
    timer calls fastest is kept; identical regions reuse it."""
    cands = [{"max_autotune_gemm": False}]
    gm, fakes = _timed_fused_graph(n_norms=3, candidates=cands)
    calls = []

    def timer(fn, inputs):
        # variants of one region arrive in order: inductor_configs, candidate 1
        i = len(calls) % 2
        calls.append(fn)
        out = fn(*inputs)  # the variant really runs on inputs of the region's shapes
        assert isinstance(out, (list, tuple))
        return 1.0 if i == fastest else 2.0

    gm = regional_inductor_pass(gm, fakes, select_candidates=True, timer=timer)
    stats = gm.meta["graph_trainer_pass_stats"]
    sel = stats["selections"]
    # 3 forward norms + 1 backward = 4 regions; norm 0 also returns rstd (used by the
    # backward), norms 1 and 2 are identical -> 3 distinct regions, 2 compiles each
    assert stats["regions"] == 4
    assert len(sel) == 3 and stats["distinct_compiles"] == 6 and len(calls) == 6
    assert all(s["chosen"] == fastest and s["ms"][fastest] == 1.0 for s in sel)
    assert all(s["configs"] == [{}, cands[0]] for s in sel)
    # each selection is named after its own region (not after a producer of an input)
    assert sorted(s["region"] for s in sel) == ["rmsnorm_backward_0", "rmsnorm_forward_0", "rmsnorm_forward_1"]
    # the kept artifact computes the same thing as the reference
    torch.manual_seed(0)
    x, w, go = torch.randn(4, 8, D), torch.randn(D), torch.randn(4, 8, D)
    out, gi, gw = gm(x, w, go)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    o0 = torch.nn.functional.rms_norm(xr, [D], wr, 1e-6)
    ref = o0.detach() * 2
    for _ in range(2):
        ref = torch.nn.functional.rms_norm(ref, [D], w, 1e-6) * 2
    _assert_close([out, gi, gw], [ref, *torch.autograd.grad(o0, [xr, wr], go)])


@pytest.mark.parametrize("candidate_ms,chosen", [(0.99, 0), (0.97, 1)])
def test_candidate_must_beat_defaults_by_the_guard_margin(candidate_ms, chosen):
    """A candidate 1 % faster than Inductor's defaults is noise (defaults kept); 3 % wins."""
    from graph_trainer.passes.regional_inductor import MIN_CANDIDATE_GAIN

    assert 0.01 < MIN_CANDIDATE_GAIN < 0.03
    gm, fakes = _timed_fused_graph(n_norms=1, candidates=[{"max_autotune_gemm": False}])
    calls = []

    def timer(fn, inputs):
        calls.append(fn)
        return 1.0 if len(calls) % 2 else candidate_ms

    gm = regional_inductor_pass(gm, fakes, select_candidates=True, timer=timer)
    sel = gm.meta["graph_trainer_pass_stats"]["selections"]
    assert sel and all(s["chosen"] == chosen for s in sel)


def test_candidates_not_timed_on_cpu_by_default():
    gm, fakes = _timed_fused_graph(n_norms=2, candidates=[{"max_autotune_gemm": False}])

    def timer(fn, inputs):
        raise AssertionError("CPU regions must not be timed unless asked")

    gm = regional_inductor_pass(gm, fakes, timer=timer)
    stats = gm.meta["graph_trainer_pass_stats"]
    assert stats["selections"] == [] and stats["regions"] == 3 and stats["distinct_compiles"] == 3


def test_unknown_inductor_config_key_rejected():
    gm, fakes = _fused_graph(n_norms=1)
    with pytest.raises(ValueError, match=r"max_autotun.*did you mean 'max_autotune'"):
        annotate_rmsnorm_for_regional_inductor_pass(gm, fakes, inductor_configs={"max_autotun": True})
    assert not _tagged(gm)


def test_empty_graph_is_noop():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((x,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    code = gm.code
    assert annotate_rmsnorm_for_regional_inductor_pass(gm, []) is gm
    assert gm.code == code and not _tagged(gm)
    assert gm.meta["graph_trainer_pass_stats"]["regions"] == 0
    # and the compile pass has nothing to do
    assert regional_inductor_pass(gm, []) is gm
    assert gm.meta["graph_trainer_pass_stats"]["regions"] == 0


def test_forward_and_backward_each_own_region():
    gm, fakes = _fused_graph(n_norms=3)
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes)
    ids = _region_ids(gm)
    assert ids == {"rmsnorm_forward_0", "rmsnorm_forward_1", "rmsnorm_forward_2", "rmsnorm_backward_0"}
    parts = propose_region_partitions(gm)
    assert len(parts) == 4
    for p in parts:  # one region id per partition, each norm node with its getitems
        assert len({_tag(n)["inductor_region"] for n in p}) == 1
        assert sum(n.target is not operator.getitem for n in p) == 1
    gm, n_regions = scoop_regions(gm)
    assert n_regions == 4
    assert sum(1 for name, _ in gm.named_children() if name.startswith("__marked_inductor_submod")) == 4


def test_independent_norms_not_merged():
    gm, fakes = _independent_norms_graph()
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes)
    assert len(propose_region_partitions(gm)) == 2
    # Without region ids a single partitioner (torch 2.11 regional_inductor)
    # merges the two independent norms: the reason region ids are needed.
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import create_op_support

    tagged = set(_tagged(gm))
    support = create_op_support(lambda _m, n: n in tagged)
    merged = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True).propose_partitions()
    assert len(merged) == 1
    # torch's own scooper agrees with ours when it understands region ids.
    from torch.fx.passes import regional_inductor as ri

    from graph_trainer.passes.regional_inductor import _supports_region_ids

    if _supports_region_ids():
        gm2, fakes2 = _independent_norms_graph()
        annotate_rmsnorm_for_regional_inductor_pass(gm2, fakes2)
        gm2 = ri._create_inductor_marked_regions(gm2)
        assert sum(1 for name, _ in gm2.named_children() if name.startswith("__marked_inductor_submod")) == 2


def test_region_with_cycle_is_split():
    # a (tagged) -> u (untagged) -> b (tagged), a -> b: one partition {a, b}
    # would be a cycle through u, so the region must be split in two.
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.sin.default, (x,))
    u = g.call_function(aten.cos.default, (a,))
    b = g.call_function(aten.add.Tensor, (a, u))
    g.output((b,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    _fake_prop(gm, [(3,)])
    for n in (a, b):
        n.meta["custom"] = {COMPILE_WITH_INDUCTOR_KEY: {"inductor_configs": {}, "inductor_region": "r"}}
    assert len(propose_region_partitions(gm)) == 2


def test_fused_regions_compile_and_match_reference():
    gm, _ = _fused_graph(n_norms=2)
    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    annotate_rmsnorm_for_regional_inductor_pass(gm, fakes)
    gm = regional_inductor_pass(gm, fakes)
    assert gm.meta["graph_trainer_pass_stats"]["regions"] == 3
    assert not any(n.target in (aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default) for n in gm.graph.nodes)
    torch.manual_seed(0)
    x, w, go = torch.randn(4, 8, D), torch.randn(D), torch.randn(4, 8, D)
    out, gi, gw = gm(x, w, go)  # same calling convention as before compilation
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    o0 = torch.nn.functional.rms_norm(xr, [D], wr, 1e-6)
    o1 = torch.nn.functional.rms_norm(o0.detach() * 2, [D], w, 1e-6) * 2
    gi_ref, gw_ref = torch.autograd.grad(o0, [xr, wr], go)
    _assert_close([out, gi, gw], [o1, gi_ref, gw_ref])


# --------------------------------------------------------------------------- decomposed norms (make_fx on CPU)


@pytest.fixture(scope="module")
def traced_llama2():
    return _trace_step(_small_llama(n_layers=2))


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
    for n in _tagged(gm):
        assert n.op == "call_function"
        assert n.target not in (aten.mm.default, aten.embedding.default)
        assert n.meta["custom"]["module_fqn"].endswith("norm")
        assert n.meta["custom"]["phase"] in ("forward", "backward")
    # each forward region computes an rsqrt; each backward region a reduction
    for rid in _region_ids(gm):
        targets = {n.target for n in _tagged(gm) if _tag(n)["inductor_region"] == rid}
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
    gm, example_inputs, _ = _trace_step_generic(model)
    instances = find_rmsnorm_instances(gm.graph)
    assert [(i["module_fqn"], i["phase"]) for i in instances] == [("pre", "forward"), ("pre", "backward")]


def _trace_step_generic(model):
    params = dict(model.named_parameters())
    x = torch.randn(2, 4, D)

    def step(params, x):
        with fxtb.annotate({"phase": "forward"}):
            loss = torch.func.functional_call(model, params, (x,)).square().mean()
        return (loss, *_backward(loss, list(params.values())))

    gm, example_inputs = _make_fx_step(model, step, params, x)
    return gm, example_inputs, (params, x)


# --------------------------------------------------------------------------- end to end on CPU (Inductor C++ backend)


def test_end_to_end_regional_rmsnorm_cpu(tmp_path, caplog):
    model = _small_llama(n_layers=1)
    gm, example_inputs, inputs = _trace_step(model)
    ref = gm(*inputs)
    names = resolve_pass_names(
        passes=None, disable_passes=[], numerics_changing_optim=True, inductor_compilation="regional"
    )
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
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        cgm = run_passes(gm, example_inputs, names, dump_folder=str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.name == "graph_trainer" and "graph pass" in r.getMessage()]
    assert len(lines) == 4
    assert "tagged 3 forward + 3 backward RMSNorms" in lines[2] and "-> 6 regions" in lines[2]
    assert "compiled 6 region(s)" in lines[3]
    out = cgm(*inputs)
    _assert_close(out, ref)
    graphs = tmp_path / "graphs"
    files = sorted(os.listdir(graphs))
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


def test_end_to_end_full_inductor_cpu():
    model = _small_llama(n_layers=1)
    gm, example_inputs, inputs = _trace_step(model)
    ref = gm(*inputs)
    names = resolve_pass_names(passes=None, disable_passes=[], numerics_changing_optim=False, inductor_compilation="full")
    assert names == [
        "remove_dead_code", "remove_noop_views", "sac_recompute", "reshard_after_forward", "overlap_collectives",
        "full_inductor",
    ]
    cgm = run_passes(gm, example_inputs, names)
    assert isinstance(cgm, torch.fx.GraphModule) and callable(cgm.compiled_fn)
    out = cgm(*inputs)  # same pytree calling convention as the traced graph
    assert isinstance(out, tuple) and len(out) == len(ref)
    _assert_close(out, ref)


# --------------------------------------------------------------------------- other passes


def test_remove_dead_code_keeps_collectives():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(aten.sin.default, (x,))  # dead
    g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))  # dead but kept
    y = g.call_function(aten.cos.default, (x,))
    g.output((y,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    gm = remove_dead_code_pass(gm, None)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops._c10d_functional.all_reduce.default, aten.cos.default]
    assert gm.meta["graph_trainer_pass_stats"]["removed"] == 1


def test_remove_noop_views():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    v_same = g.call_function(aten.view.default, (x, [4, 6]))  # removed
    v_diff = g.call_function(aten.view.default, (v_same, [24]))  # kept
    r_same = g.call_function(aten._unsafe_view.default, (v_diff, [24]))  # removed
    c_ok = g.call_function(aten.clone.default, (x,))  # removed
    s = g.call_function(aten.sin.default, (c_ok,))
    c_mut = g.call_function(aten.clone.default, (s,))  # kept: s is mutated later
    m = g.call_function(aten.mul.Tensor, (c_mut, 2.0))
    g.call_function(aten.add_.Tensor, (s, 1.0))
    d = g.call_function(aten.detach.default, (m,))  # removed
    e = g.call_function(aten.exp.default, (d,))
    c_out = g.call_function(aten.clone.default, (x,))  # kept: graph output
    ct = g.call_function(aten.clone.default, (g.call_function(aten.t.default, (x,)),), {"memory_format": torch.contiguous_format})  # kept: layout change
    rn = g.call_function(aten.neg.default, (r_same,))
    g.output((rn, e, c_out, s, ct))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    _fake_prop(gm, [(4, 6)])
    xin = torch.randn(4, 6)
    ref = gm(xin.clone())
    gm = remove_noop_views_pass(gm, None)
    stats = gm.meta["graph_trainer_pass_stats"]
    assert stats["removed_view"] == 1 and stats["removed__unsafe_view"] == 1
    assert stats["removed_clone"] == 1 and stats["removed_detach"] == 1
    assert stats["removed"] == 4
    remaining = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert remaining.count(aten.clone.default) == 3
    _assert_close(gm(xin.clone()), ref)


def _flex_graph():
    root = torch.nn.Module()
    sub = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    sub.graph.output(None)
    root.score0 = sub
    root.mask0 = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    root.mask0.graph.output(None)
    g = torch.fx.Graph()
    q, k, v = g.placeholder("q"), g.placeholder("k"), g.placeholder("v")
    score = g.get_attr("score0")
    mask = g.get_attr("mask0")
    fa0 = g.call_function(torch.ops.higher_order.flex_attention, (q, k, v, score, (mask,), 1.0, {}, (), ()))
    o0 = g.call_function(operator.getitem, (fa0, 0))
    fa1 = g.call_function(torch.ops.higher_order.flex_attention, (o0, k, v, score, (mask,), 1.0, {}, (), ()))
    o1 = g.call_function(operator.getitem, (fa1, 0))
    lse = g.call_function(operator.getitem, (fa1, 1))
    bwd = g.call_function(torch.ops.higher_order.flex_attention_backward, (q, k, v, o1, lse, score, (mask,)))
    gq = g.call_function(operator.getitem, (bwd, 0))
    other = g.call_function(aten.sin.default, (gq,))
    g.output((o1, other))
    for n in g.nodes:
        n.meta["custom"] = {"phase": "forward", "module_fqn": "layers.0.attention.inner_attention"}
    return torch.fx.GraphModule(root, g)


def test_annotate_flex_attention():
    gm = _flex_graph()
    gm = annotate_flex_attention_for_regional_inductor_pass(gm, None)
    stats = gm.meta["graph_trainer_pass_stats"]
    assert (stats["forward"], stats["backward"], stats["regions"]) == (2, 1, 3)
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.sin.default or n.op in ("placeholder", "output"):
            assert _tag(n) is None
        elif n.op == "call_function":
            assert _tag(n) is not None and n.meta["custom"]["module_fqn"].endswith("inner_attention")
    # shared get_attrs duplicated: every get_attr has exactly one user / region
    get_attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(get_attrs) == 6
    assert all(len(n.users) == 1 and _tag(n) is not None for n in get_attrs)
    for n in get_attrs:
        assert _tag(n)["inductor_region"] == _tag(next(iter(n.users)))["inductor_region"]
    assert len(propose_region_partitions(gm)) == 3


def test_cudagraph_pass_requires_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA available")
    gm, fakes = _fused_graph(n_norms=1)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cudagraph_pass(gm, fakes)


# --------------------------------------------------------------------------- pipeline


def test_registry_and_order():
    assert list(PASSES) == DEFAULT_ORDER
    assert DEFAULT_ORDER == [
        "remove_dead_code",
        "remove_noop_views",
        "sac_recompute",
        "reshard_after_forward",
        "overlap_collectives",
        "bucket_collectives",
        "annotate_flex_attention_for_regional_inductor",
        "annotate_rmsnorm_for_regional_inductor",
        "annotate_pointwise_for_regional_inductor",
        "regional_inductor",
        "full_inductor",
        "cudagraph",
    ]


def test_resolve_defaults():
    kw = dict(passes=None, disable_passes=[])
    assert resolve_pass_names(**kw, numerics_changing_optim=False, inductor_compilation="none") == [
        "remove_dead_code",
        "remove_noop_views",
        "sac_recompute",
        "reshard_after_forward",
        "overlap_collectives",
    ]
    assert resolve_pass_names(**kw, numerics_changing_optim=False, inductor_compilation="regional") == [
        "remove_dead_code",
        "remove_noop_views",
        "sac_recompute",
        "reshard_after_forward",
        "overlap_collectives",
        "regional_inductor",
    ]
    assert resolve_pass_names(
        **kw, numerics_changing_optim=True, inductor_compilation="regional", uses_flex_attention=True, cudagraphs=True
    ) == DEFAULT_ORDER[:5] + DEFAULT_ORDER[6:8] + ["regional_inductor", "cudagraph"]
    # bucketing only when asked for, right after overlap_collectives
    assert resolve_pass_names(**kw, numerics_changing_optim=False, inductor_compilation="full",
                              bucket_collectives=9)[-3:] == ["overlap_collectives", "bucket_collectives", "full_inductor"]
    assert "bucket_collectives" not in resolve_pass_names(
        **kw, numerics_changing_optim=False, inductor_compilation="full", bucket_collectives=1)
    assert resolve_pass_names(
        **kw, numerics_changing_optim=True, inductor_compilation="regional", pointwise_regions=True
    )[-3:] == ["annotate_rmsnorm_for_regional_inductor", "annotate_pointwise_for_regional_inductor", "regional_inductor"]
    # full inductor compiles every norm anyway: no annotation pass
    assert "annotate_rmsnorm_for_regional_inductor" not in resolve_pass_names(
        **kw, numerics_changing_optim=True, inductor_compilation="full"
    )


def test_resolve_replace_and_disable():
    names = resolve_pass_names(
        passes=["regional_inductor", "annotate_rmsnorm", "remove_dead_code_pass"],
        disable_passes=[],
        numerics_changing_optim=False,
        inductor_compilation="regional",
    )
    assert names == ["remove_dead_code", "annotate_rmsnorm_for_regional_inductor", "regional_inductor"]
    names = resolve_pass_names(
        passes=None,
        disable_passes=["remove_noop_views", "annotate_rmsnorm_for_regional_inductor", "overlap_collectives",
                        "reshard_after_forward"],
        numerics_changing_optim=True,
        inductor_compilation="regional",
    )
    assert names == ["remove_dead_code", "sac_recompute", "regional_inductor"]


def test_resolve_errors():
    with pytest.raises(ValueError, match="unknown graph pass 'nope'.*remove_dead_code"):
        resolve_pass_names(passes=["nope"], disable_passes=[], numerics_changing_optim=False, inductor_compilation="none")
    with pytest.raises(ValueError, match="unknown graph pass"):
        resolve_pass_names(passes=None, disable_passes=["nope"], numerics_changing_optim=False, inductor_compilation="none")
    with pytest.raises(ValueError, match="inductor_compilation must be one of"):
        resolve_pass_names(passes=None, disable_passes=[], numerics_changing_optim=False, inductor_compilation="max")
    with pytest.raises(ValueError, match="only has an effect when regional_inductor compiles"):
        resolve_pass_names(passes=None, disable_passes=[], numerics_changing_optim=True, inductor_compilation="none")
    with pytest.raises(ValueError, match="only has an effect when regional_inductor compiles"):
        resolve_pass_names(
            passes=None, disable_passes=["regional_inductor"], numerics_changing_optim=True, inductor_compilation="regional"
        )
    with pytest.raises(ValueError, match="mutually exclusive"):
        resolve_pass_names(
            passes=["regional_inductor", "full_inductor"], disable_passes=[], numerics_changing_optim=False,
            inductor_compilation="regional",
        )  # fmt: skip


def test_run_passes_dump_without_compile(tmp_path, caplog):
    gm, fakes = _fused_graph(n_norms=2)
    names = ["remove_dead_code", "remove_noop_views", "annotate_rmsnorm_for_regional_inductor"]
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        gm = run_passes(gm, fakes, names, rmsnorm_inductor_configs={"max_autotune": False}, dump_folder=str(tmp_path))
    assert all(_tag(n)["inductor_configs"] == {"max_autotune": False} for n in _tagged(gm))
    msgs = [r.getMessage() for r in caplog.records if "graph pass" in r.getMessage()]
    assert len(msgs) == 3 and all(" -> " in m and "s  nodes" in m for m in msgs)
    graphs = tmp_path / "graphs"
    assert (graphs / "00_input.py").read_text().strip()
    assert "_fused_rms_norm" in (graphs / "03_annotate_rmsnorm_for_regional_inductor.py").read_text()
    summary = json.loads((graphs / "summary.json").read_text())
    assert summary[3]["stats"]["regions"] == 3
    assert summary[3]["ops"]["aten._fused_rms_norm.default"] == 2


def test_activation_checkpointing_recomputed_norms_get_own_regions():
    """With AC the backward phase holds each block's recomputed forward norm next
    to the norm's backward: they must become separate regions (no cycle)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from graph_trainer.trace import trace_train_step

    model = _small_llama(n_layers=1)
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    tokens, labels = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))

    def loss_fn(logits, lab):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), lab.flatten(0, 1))

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
        _assert_close(gm(*flat), ref)
