"""remove_noop_views_pass: no-op views / clones / detaches removed, the others kept; what
Inductor's remove_noop_ops does on the same graphs."""

import copy

import torch
import torch.fx

from graph_trainer.compiler.passes.remove_noop_views import remove_noop_views_pass

from .conftest import assert_close, fake_prop, trace_step

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


def _mutation_graph():
    """A copy taken before its source is updated in place and read after, then a same-shape
    ``view`` written with -1, an ``_unsafe_view`` and a ``detach`` of its product."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    s = g.call_function(aten.sin.default, (x,))
    c = g.call_function(aten.clone.default, (s,))  # the value of s before add_
    g.call_function(aten.add_.Tensor, (s, 1.0))
    m = g.call_function(aten.mul.Tensor, (c, 2.0))
    v = g.call_function(aten.view.default, (m, [-1, 6]))
    u = g.call_function(aten._unsafe_view.default, (v, [4, 6]))
    d = g.call_function(aten.detach.default, (u,))
    g.output((g.call_function(aten.exp.default, (d,)), s))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    fake_prop(gm, [(4, 6)])
    return gm


def test_inductor_remove_noop_ops_on_this_graph(tiny_llama):
    """Why the pass is not Inductor's ``post_grad.remove_noop_ops``: it is written for a
    functional graph and this one keeps in-place ops, so it removes the clone whose source
    is later updated in place (the result changes); it has no rule for ``detach`` or
    ``_unsafe_view`` and compares ``view``'s size argument literally (-1 stays). On a traced
    training step it removes none of the detaches; ours removes them all."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    def targets(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    xin = torch.randn(4, 6)
    ref = _mutation_graph()(xin.clone())

    theirs = _mutation_graph()
    remove_noop_ops(theirs.graph)
    theirs.recompile()
    assert aten.clone.default not in targets(theirs)
    assert {aten.view.default, aten._unsafe_view.default, aten.detach.default} <= set(targets(theirs))
    assert not torch.allclose(theirs(xin.clone())[0], ref[0])

    ours = remove_noop_views_pass(_mutation_graph(), None)
    stats = ours.meta["graph_trainer_pass_stats"]
    assert (stats["removed_view"], stats["removed__unsafe_view"], stats["removed_detach"]) == (1, 1, 1)
    assert targets(ours).count(aten.clone.default) == 1
    assert_close(ours(xin.clone()), ref)

    gm, _, _ = trace_step(tiny_llama(2))
    detaches = targets(gm).count(aten.detach.default)
    assert detaches > 0
    theirs = copy.deepcopy(gm)
    remove_noop_ops(theirs.graph)
    assert targets(theirs).count(aten.detach.default) == detaches
    assert remove_noop_views_pass(gm, None).meta["graph_trainer_pass_stats"]["removed_detach"] == detaches
