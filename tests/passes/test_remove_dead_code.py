"""remove_dead_code_pass: unused pure nodes are erased, collectives kept."""

import torch
import torch.fx

from graph_trainer.compiler.passes.remove_dead_code import remove_dead_code_pass

aten = torch.ops.aten


def _graph(build):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((build(g, x),))
    return remove_dead_code_pass(torch.fx.GraphModule(torch.nn.Module(), g), None)


def _ops(gm):
    return [n.target._opname for n in gm.graph.nodes if n.op == "call_function"]


def test_dead_code_and_in_place_ops_on_dead_temporaries_go_collectives_stay():
    def collective(g, x):
        g.call_function(aten.sin.default, (x,))  # dead
        g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))  # dead but kept
        return g.call_function(aten.cos.default, (x,))

    def dead_temporary(g, x):  # as the CPU RMSNorm copy in a TP trace: ``mean(pow(x)).add_(eps)`` read by nothing
        mean = g.call_function(aten.mean.dim, (g.call_function(aten.pow.Tensor_Scalar, (x, 2)), [1], True))
        g.call_function(aten.add_.Scalar, (mean, 1e-5))
        return g.call_function(aten.cos.default, (x,))

    gm = _graph(collective)
    assert _ops(gm) == ["all_reduce", "cos"] and gm.meta["graph_trainer_pass_stats"]["removed"] == 1
    gm = _graph(dead_temporary)
    assert _ops(gm) == ["cos"]
    assert gm.meta["graph_trainer_pass_stats"]["dead_mutations"] == 1
    x = torch.randn(4, 8)
    assert torch.equal(gm(x)[0], x.cos())


def test_in_place_ops_that_can_be_observed_stay():
    def on_input(g, x):  # mutates the graph's input
        g.call_function(aten.add_.Scalar, (x, 1.0))
        return g.call_function(aten.cos.default, (x,))

    def read_later(g, x):  # the temporary is read by another node too
        t = g.call_function(aten.sin.default, (x,))
        g.call_function(aten.add_.Scalar, (t, 1.0))
        return g.call_function(aten.cos.default, (t,))

    def on_a_view(g, x):  # the temporary is a view of the input
        g.call_function(aten.add_.Scalar, (g.call_function(aten.view.default, (x, [-1])), 1.0))
        return g.call_function(aten.cos.default, (x,))

    def random(g, x):  # advances the generator
        g.call_function(aten.uniform_.default, (g.call_function(aten.sin.default, (x,)),))
        return g.call_function(aten.cos.default, (x,))

    assert _ops(_graph(on_input)) == ["add_", "cos"]
    assert _ops(_graph(read_later)) == ["sin", "add_", "cos"]
    assert _ops(_graph(on_a_view)) == ["view", "add_", "cos"]
    assert _ops(_graph(random)) == ["sin", "uniform_", "cos"]
