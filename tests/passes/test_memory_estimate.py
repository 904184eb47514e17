"""memory_estimate: the static peak of a graph's storages; views, waits and holds alias their input."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graph_trainer.compiler.collectives import hold
from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.node_meta import tag_for_inductor

from .conftest import aten, c10d, call, fx_graph, module


def test_peak_counts_views_waits_and_holds_once():
    """x -> all_reduce -> wait -> hold -> view -> sum: one 64-byte buffer, peak 68 bytes at the sum."""
    g, (x,) = fx_graph("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4, 4)
        ar = call(g, c10d.all_reduce.default, x, "sum", "0", val=torch.empty(4, 4))
        w = call(g, c10d.wait_tensor.default, ar, val=(waited := torch.empty(4, 4)))
        v = call(g, aten.view.default, call(g, hold, w, x, val=waited), [16], val=waited.view(16))
        s = call(g, aten.sum.default, v, val=torch.empty(()))
    assert estimate_peak_memory(module(g, s)) == (68, s.name)


def test_fused_estimate_leaves_out_what_inductor_keeps_in_its_kernels():
    """Unfused peak: mul + add (256 B each); fused: sum, exp and mm output (4 + 64 + 64 B) at the mm; mul and add
    in one regional_inductor region: add + sum (256 + 4 B)."""
    g, (x, y) = fx_graph("x", "y")
    with FakeTensorMode():
        x.meta["val"], y.meta["val"] = torch.empty(4, 4), torch.empty(8, 8)
        add = call(g, aten.add.Tensor, call(g, aten.mul.Tensor, y, y, val=torch.empty(8, 8)), y, val=torch.empty(8, 8))
        s = call(g, aten.sum.default, add, val=torch.empty(()))
        mm = call(g, aten.mm.default, call(g, aten.exp.default, x, val=torch.empty(4, 4)), x, val=torch.empty(4, 4))
    gm = module(g, s, mm)
    assert estimate_peak_memory(gm) == (512, add.name) and estimate_peak_memory(gm, fused=True) == (132, mm.name)
    for n, region in ((add.args[0], "r"), (add, "r"), (s, "other")):  # mul only read inside its region: no buffer
        tag_for_inductor(n, {}, region)
    assert estimate_peak_memory(gm) == (260, s.name)
