"""memory_estimate: the static peak of a graph's storages; views, waits and holds alias their input."""

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graph_trainer.compiler.collectives import hold
from graph_trainer.compiler.memory_estimate import estimate_peak_memory

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _node(g, target, args, val):
    n = g.call_function(target, args)
    n.meta["val"] = val
    return n


def test_peak_counts_views_waits_and_holds_once():
    """x -> all_reduce -> wait -> hold -> view -> sum: one 64-byte buffer, peak 68 bytes at the sum."""
    g = torch.fx.Graph()
    with FakeTensorMode():
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(4, 4)
        ar = _node(g, c10d.all_reduce.default, (x, "sum", "0"), torch.empty(4, 4))
        w = _node(g, c10d.wait_tensor.default, (ar,), waited := torch.empty(4, 4))
        v = _node(g, aten.view.default, (_node(g, hold, (w, x), waited), [16]), waited.view(16))
        s = _node(g, aten.sum.default, (v,), torch.empty(()))
    g.output((s,))
    assert estimate_peak_memory(torch.fx.GraphModule(torch.nn.Module(), g)) == (68, s.name)


def test_fused_estimate_leaves_out_what_inductor_keeps_in_its_kernels():
    """Unfused peak: mul + add (256 B each); fused: sum, exp and mm output (4 + 64 + 64 B) at the mm."""
    g = torch.fx.Graph()
    with FakeTensorMode():
        x, y = g.placeholder("x"), g.placeholder("y")
        x.meta["val"], y.meta["val"] = torch.empty(4, 4), torch.empty(8, 8)
        mul = _node(g, aten.mul.Tensor, (y, y), torch.empty(8, 8))
        add = _node(g, aten.add.Tensor, (mul, y), torch.empty(8, 8))
        s = _node(g, aten.sum.default, (add,), torch.empty(()))
        e = _node(g, aten.exp.default, (x,), torch.empty(4, 4))
        mm = _node(g, aten.mm.default, (e, x), torch.empty(4, 4))
    g.output((s, mm))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert estimate_peak_memory(gm) == (512, add.name)
    assert estimate_peak_memory(gm, fused=True) == (132, mm.name)
