"""Helpers shared by the pass tests: synthetic graphs, make_fx traces of tiny models with
the tracer's node metadata, and checks. Test modules import them (``from .conftest
import ...``); the tiny models come from the ``tiny_llama`` fixture of tests/conftest.py."""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
import torch.fx.traceback as fxtb
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY
from graph_trainer.model import loss_fn

aten = torch.ops.aten
#: Hidden size of the synthetic norm graphs.
D = 16


# --------------------------------------------------------------------------- Inductor tags


def inductor_tag(node):
    """The ``compile_with_inductor`` annotation of ``node``, or None."""
    return (node.meta.get("custom") or {}).get(COMPILE_WITH_INDUCTOR_KEY)


def tagged_nodes(gm):
    """The nodes of ``gm`` tagged for Inductor, in graph order."""
    return [n for n in gm.graph.nodes if inductor_tag(n) is not None]


def region_ids(gm):
    """The set of ``inductor_region`` ids of ``gm``'s tagged nodes."""
    return {inductor_tag(n)["inductor_region"] for n in tagged_nodes(gm)}


# --------------------------------------------------------------------------- synthetic graphs


def fake_prop(gm, shapes):
    """Fill ``meta["val"]`` of ``gm`` from fake inputs of ``shapes``; returns the fakes."""
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(torch.empty(s)) for s in shapes]
    FakeTensorProp(gm, mode).propagate(*fakes)
    return fakes


def fused_norm_graph(n_norms=2, with_backward=True, meta=True):
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
    fakes = fake_prop(gm, [(4, 8, D), (D,), (4, 8, D)])
    return gm, fakes


# --------------------------------------------------------------------------- make_fx traces


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


def trace_step(model, batch=2, seq=8, vocab=64):
    """Forward + loss + autograd.grad of a Llama ``model`` in one make_fx graph (the
    tracer's pattern): ``(gm, fake example inputs, (params, bufs, tokens, labels))``."""
    params = dict(model.named_parameters())
    bufs = dict(model.named_buffers())
    tokens = torch.randint(0, vocab, (batch, seq))
    labels = torch.randint(0, vocab, (batch, seq))

    def step(params, bufs, tokens, labels):
        with fxtb.annotate({"phase": "forward"}):
            out = torch.func.functional_call(model, {**params, **bufs}, (tokens,))
            loss = loss_fn(out, labels)
        return (loss, *_backward(loss, list(params.values())))

    gm, example_inputs = _make_fx_step(model, step, params, bufs, tokens, labels)
    return gm, example_inputs, (params, bufs, tokens, labels)


def trace_step_generic(model):
    """Like :func:`trace_step` for any ``model`` of hidden size :data:`D`, loss
    ``mean(out ** 2)``: ``(gm, fake example inputs, (params, x))``."""
    params = dict(model.named_parameters())
    x = torch.randn(2, 4, D)

    def step(params, x):
        with fxtb.annotate({"phase": "forward"}):
            loss = torch.func.functional_call(model, params, (x,)).square().mean()
        return (loss, *_backward(loss, list(params.values())))

    gm, example_inputs = _make_fx_step(model, step, params, x)
    return gm, example_inputs, (params, x)


# --------------------------------------------------------------------------- checks


def assert_close(outs, refs, rtol=1e-4, atol=1e-5):
    """Same number of outputs, each close to its reference."""
    assert len(outs) == len(refs)
    for a, b in zip(outs, refs):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
