"""remove_dead_code_pass: unused pure nodes are erased, collectives kept."""

import pytest
import torch

from graph_trainer.compiler.passes.remove_dead_code import remove_dead_code_pass

from .conftest import aten, c10d, call, call_targets, fx_graph, module, stats


def _graph(build):
    """``cos(build(g, x))``, through the pass; ``build`` adds the nodes under test."""
    g, (x,) = fx_graph("x")
    gm = remove_dead_code_pass(module(g, call(g, aten.cos.default, build(g, x))), None)
    return gm, [t._opname for t in call_targets(gm)]


def test_dead_code_and_in_place_ops_on_dead_temporaries_go_collectives_stay():
    def collective(g, x):
        call(g, aten.sin.default, x)  # dead
        call(g, c10d.all_reduce.default, x, "sum", "0")  # dead but kept
        return x

    def dead_temporary(g, x):  # as the CPU RMSNorm copy in a TP trace: ``mean(pow(x)).add_(eps)`` read by nothing
        call(g, aten.add_.Scalar, call(g, aten.mean.dim, call(g, aten.pow.Tensor_Scalar, x, 2), [1], True), 1e-5)
        return x

    gm, ops = _graph(collective)
    assert ops == ["all_reduce", "cos"] and stats(gm)["removed"] == 1
    gm, ops = _graph(dead_temporary)
    assert ops == ["cos"] and stats(gm)["dead_mutations"] == 1
    x = torch.randn(4, 8)
    assert torch.equal(gm(x)[0], x.cos())


@pytest.mark.parametrize("case, ops", [
    ("on_input", ["add_", "cos"]), ("read_later", ["sin", "add_", "cos"]), ("on_a_view", ["view", "add_", "cos"]),
    ("random", ["sin", "uniform_", "cos"])])
def test_in_place_ops_that_can_be_observed_stay(case, ops):
    def build(g, x):
        if case == "on_input":  # mutates the graph's input
            call(g, aten.add_.Scalar, x, 1.0)
        elif case == "read_later":  # the temporary is read by another node too
            x = call(g, aten.sin.default, x)
            call(g, aten.add_.Scalar, x, 1.0)
        elif case == "on_a_view":  # the temporary is a view of the input
            call(g, aten.add_.Scalar, call(g, aten.view.default, x, [-1]), 1.0)
        else:  # advances the generator
            call(g, aten.uniform_.default, call(g, aten.sin.default, x))
        return x

    assert _graph(build)[1] == ops
