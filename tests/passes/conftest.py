"""Helpers shared by the pass tests (``from .conftest import ...``)."""

import operator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graph_trainer.compiler.node_meta import inductor_tag  # noqa: F401  (re-exported to the pass tests)
from graph_trainer.model import loss_fn
from graph_trainer.trace import trace_train_step

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
D = 16  # hidden size of the synthetic norm graphs
AG, RS = "all_gather_into_tensor", "reduce_scatter_tensor"  # ``collective_kind`` of FSDP's gathers and scatters


def fx_graph(*placeholders):
    """A new FX graph and its placeholders of these names."""
    g = torch.fx.Graph()
    return g, [g.placeholder(name) for name in placeholders]


def module(g, *outputs):
    """``g`` as a GraphModule without attributes; ``outputs``, when given, become its output tuple."""
    if outputs:
        g.output(outputs)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def call(g, target, *args, custom=None, val=None, **kwargs):
    """``g.call_function(target, args, kwargs)``; a copy of ``custom`` and ``val``, when given, in its meta."""
    n = g.call_function(target, args, kwargs)
    if custom is not None:
        n.meta["custom"] = dict(custom)
    if val is not None:
        n.meta["val"] = val
    return n


def stats(gm):
    return gm.meta["graph_trainer_pass_stats"]


def call_targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def tagged_nodes(gm):
    return [n for n in gm.graph.nodes if inductor_tag(n) is not None]


def by_region(gm):
    """``{region id: its tagged nodes in graph order}``."""
    regions = {}
    for n in tagged_nodes(gm):
        regions.setdefault(inductor_tag(n)["inductor_region"], []).append(n)
    return regions


def fake_prop(gm, shapes):
    """Fill ``meta["val"]`` of ``gm`` from fakes of ``shapes`` (fp32) or of tensors; returns the fakes."""
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(s if isinstance(s, torch.Tensor) else torch.empty(s)) for s in shapes]
    FakeTensorProp(gm, mode).propagate(*fakes)
    return fakes


def fused_norm_graph(n_norms=2, with_backward=True):
    """``(gm, fakes)``: x -> [fused rms norm -> mul(2)] * n_norms, optionally norm 0's fused backward."""
    g, (x, w, go) = fx_graph("x", "w", "go")
    cur, rstds = x, []
    for i in range(n_norms):
        meta = {"phase": "forward", "module_fqn": f"layers.{i}.attention_norm", "keep": i}
        n = call(g, aten._fused_rms_norm.default, cur, [D], w, 1e-6, custom=meta)
        out, rstd = (call(g, operator.getitem, n, j, custom=meta) for j in (0, 1))
        rstds.append(rstd)
        cur = call(g, aten.mul.Tensor, out, 2.0, custom={"phase": "forward", "module_fqn": f"layers.{i}.attention"})
    outs = [cur]
    if with_backward:
        meta = {"phase": "backward", "module_fqn": "layers.0.attention_norm"}
        b = call(g, aten._fused_rms_norm_backward.default, go, x, [D], rstds[0], w, [True, True], custom=meta)
        outs += [call(g, operator.getitem, b, i, custom=meta) for i in (0, 1)]
    gm = module(g, *outs)
    return gm, fake_prop(gm, [(4, 8, D), (D,), (4, 8, D)])


def trace_step(model, batch=2, seq=8, vocab=64):
    """A Llama ``model``'s traced step: ``(gm, fake example inputs, flat real inputs)``."""
    tokens, labels = (torch.randint(0, vocab, (batch, seq)) for _ in range(2))
    traced = trace_train_step(model, loss_fn, tokens, labels)
    return traced.gm, traced.example_inputs, [*model.parameters(), *model.buffers(), tokens, labels]


def run_no_grad(gm, inputs):
    with torch.no_grad():
        return gm(*inputs)


def assert_bitwise(outs, refs):
    assert len(outs) == len(refs) and all(torch.equal(a, b) for a, b in zip(outs, refs))


def assert_close(outs, refs, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(list(outs), list(refs), rtol=rtol, atol=atol)  # and the same length
