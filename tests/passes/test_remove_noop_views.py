"""remove_noop_views_pass: no-op views / clones / detaches removed, the others kept."""

import torch
import torch.fx

from graph_trainer.passes import remove_noop_views_pass

from .conftest import assert_close, fake_prop

aten = torch.ops.aten


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
    fake_prop(gm, [(4, 6)])
    xin = torch.randn(4, 6)
    ref = gm(xin.clone())
    gm = remove_noop_views_pass(gm, None)
    stats = gm.meta["graph_trainer_pass_stats"]
    assert stats["removed_view"] == 1 and stats["removed__unsafe_view"] == 1
    assert stats["removed_clone"] == 1 and stats["removed_detach"] == 1
    assert stats["removed"] == 4
    remaining = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert remaining.count(aten.clone.default) == 3
    assert_close(gm(xin.clone()), ref)
