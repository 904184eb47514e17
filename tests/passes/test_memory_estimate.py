"""memory_estimate (an analysis helper, not a pass): the static peak of a graph's
intermediate storages; views, waits and holds alias their input's buffer."""

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graph_trainer.compiler.common import hold
from graph_trainer.compiler.memory_estimate import estimate_peak_memory

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _node(g, target, args, val):
    n = g.call_function(target, args)
    n.meta["val"] = val
    return n


def test_peak_counts_views_waits_and_holds_once():
    """x -> all_reduce -> wait -> hold -> view -> sum: one 64-byte buffer (the wait's fake
    value is a separate tensor, but at run time it is the collective's buffer), then the
    4-byte sum while the buffer is still read: peak 68 bytes at the sum."""
    with FakeTensorMode():
        vx, vi, vw, vs = torch.empty(4, 4), torch.empty(4, 4), torch.empty(4, 4), torch.empty(())
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = vx
    ar = _node(g, c10d.all_reduce.default, (x, "sum", "0"), vi)
    w = _node(g, c10d.wait_tensor.default, (ar,), vw)
    h = _node(g, hold, (w, x), vw)
    v = _node(g, aten.view.default, (h, [16]), vw.view(16))
    s = _node(g, aten.sum.default, (v,), vs)
    g.output((s,))
    assert estimate_peak_memory(torch.fx.GraphModule(torch.nn.Module(), g)) == (68, s.name)
