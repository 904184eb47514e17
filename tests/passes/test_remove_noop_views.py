"""remove_noop_views_pass against Inductor's ``remove_noop_ops`` on the same graphs."""

import copy
import operator

import pytest
import torch
from torch._inductor.fx_passes.post_grad import remove_noop_ops

from graph_trainer.compiler import graph_cache
from graph_trainer.compiler.passes.remove_noop_views import remove_noop_views_pass

from .conftest import aten, assert_close, call, call_targets, fake_prop, fx_graph, module, stats, trace_step


def _graph():
    g, (x,) = fx_graph("x")
    v_same = g.call_function(aten.view.default, (x, [4, 6]))  # removed
    v_diff = g.call_function(aten.view.default, (v_same, [24]))  # kept
    r_same = g.call_function(aten._unsafe_view.default, (v_diff, [24]))  # removed
    c_ok = g.call_function(aten.clone.default, (x,))  # removed
    s = g.call_function(aten.sin.default, (c_ok,))
    c = g.call_function(aten.clone.default, (s,))  # kept: the value of s before add_
    g.call_function(aten.add_.Tensor, (s, 1.0))
    m = g.call_function(aten.mul.Tensor, (c, 2.0))
    v = g.call_function(aten.view.default, (m, [-1, 6]))  # removed
    d = g.call_function(aten.detach.default, (v,))  # removed
    e = g.call_function(aten.exp.default, (d,))
    c_out = g.call_function(aten.clone.default, (x,))  # kept: graph output
    t = g.call_function(aten.t.default, (x,))
    ct = g.call_function(aten.clone.default, (t,), {"memory_format": torch.contiguous_format})  # kept: layout
    gm = module(g, g.call_function(aten.neg.default, (r_same,)), e, c_out, s, ct)
    fake_prop(gm, [(4, 6)])
    return gm


def test_remove_noop_views_and_inductors_remove_noop_ops(tiny_llama):
    """Inductor's pass breaks a clone before an in-place update and keeps detaches; ours does neither."""
    xin = torch.randn(4, 6)
    ref = _graph()(xin.clone())
    ours = remove_noop_views_pass(_graph(), None)
    assert stats(ours) == {"removed": 5, "removed_view": 2, "removed__unsafe_view": 1, "removed_clone": 1,
                           "removed_detach": 1} and call_targets(ours).count(aten.clone.default) == 3
    assert_close(ours(xin.clone()), ref)
    theirs = _graph()
    remove_noop_ops(theirs.graph)
    theirs.recompile()
    assert call_targets(theirs).count(aten.clone.default) == 2
    assert {aten.view.default, aten._unsafe_view.default, aten.detach.default} <= set(call_targets(theirs))
    assert not torch.allclose(theirs(xin.clone())[1], ref[1])
    gm, _, _ = trace_step(tiny_llama(2))
    detaches = call_targets(gm).count(aten.detach.default)
    theirs = copy.deepcopy(gm)
    remove_noop_ops(theirs.graph)
    assert detaches > 0 and call_targets(theirs).count(aten.detach.default) == detaches
    assert stats(remove_noop_views_pass(gm, None))["removed_detach"] == detaches


@pytest.mark.parametrize("shape, order, dim, removed", [
    ((1, 8, 3), (0, 1), 0, True),    # a sequence-parallel reduce-scatter's input: x's bytes in order
    ((1, 8, 3), (0, 1), 1, True),    # cat along the split dimension: x itself
    ((2, 8, 3), (0, 1), 0, False),   # batch 2: each piece is two runs of memory
    ((1, 8, 3), (1, 0), 0, False),   # pieces out of order
    ((1, 12, 3), (0, 1), 0, False),  # a piece left out
])
def test_a_cat_of_a_tensors_pieces_in_memory_order_becomes_a_view(shape, order, dim, removed):
    g = torch.fx.Graph()  # cat([split(x, 4, dim=1)[i] for i in order], dim) * 2
    s = g.call_function(aten.split.Tensor, (g.placeholder("x"), 4, 1))
    c = g.call_function(aten.cat.default, ([g.call_function(operator.getitem, (s, i)) for i in order], dim))
    gm = module(g, g.call_function(aten.mul.Tensor, (c, 2.0)))
    fake_prop(gm, [shape])
    x = torch.randn(shape)
    ref = gm(x)
    remove_noop_views_pass(gm, None)
    assert (aten.cat.default not in call_targets(gm)) == removed and stats(gm).get("removed_cat", 0) == removed
    assert torch.equal(gm(x)[0], ref[0])


def test_the_graph_with_a_cat_made_a_view_goes_into_the_graph_cache(tiny_llama, tmp_path):
    gm, _, _ = trace_step(tiny_llama(1), batch=1)
    x = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.embedding.default)
    out = gm.graph.output_node()
    g, xv = gm.graph, x.meta["val"]
    with g.inserting_before(out), xv.fake_mode:
        split = call(g, aten.split.Tensor, x, 4, 1, val=aten.split.Tensor(xv, 4, 1))
        pieces = [call(g, operator.getitem, split, i, val=split.meta["val"][i]) for i in range(2)]
        cat = call(g, aten.cat.default, pieces, 0, val=torch.empty(2, 4, xv.shape[-1]))
        doubled = call(g, aten.mul.Tensor, cat, 2.0, val=cat.meta["val"] * 2.0)
    out.args = ((*out.args[0], doubled),)
    assert stats(remove_noop_views_pass(gm, None))["removed_cat"] == 1
    assert split not in gm.graph.nodes and not set(pieces) & set(gm.graph.nodes)  # gone with the cat
    assert graph_cache.save(tmp_path / "g.pkl", gm, [], [], [], {})
