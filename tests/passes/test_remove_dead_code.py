"""remove_dead_code_pass: unused pure nodes are erased, collectives kept."""

import pytest
import torch

from graph_trainer.compiler.passes.remove_dead_code import remove_dead_code_pass

from .conftest import aten, c10d, call, call_targets, fx_graph, module, stats


@pytest.mark.parametrize("case, ops, removed, dead_mutations", [
    ("collective", ["all_reduce", "cos"], 1, 0), ("dead_temporary", ["cos"], 3, 1), ("on_input", ["add_", "cos"], 0, 0),
    ("read_later", ["sin", "add_", "cos"], 0, 0), ("on_a_view", ["view", "add_", "cos"], 0, 0),
    ("random", ["sin", "uniform_", "cos"], 0, 0)])
def test_dead_code_goes_collectives_and_in_place_ops_that_can_be_observed_stay(case, ops, removed, dead_mutations):
    """``cos(y)`` of ``x``, and beside it the nodes under test."""
    g, (x,) = fx_graph("x")
    y = x
    if case == "collective":
        call(g, aten.sin.default, x)  # dead
        call(g, c10d.all_reduce.default, x, "sum", "0")  # dead but kept
    elif case == "dead_temporary":  # as the CPU RMSNorm copy in a TP trace: ``mean(pow(x)).add_(eps)`` read by nothing
        call(g, aten.add_.Scalar, call(g, aten.mean.dim, call(g, aten.pow.Tensor_Scalar, x, 2), [1], True), 1e-5)
    elif case == "on_input":  # mutates the graph's input
        call(g, aten.add_.Scalar, x, 1.0)
    elif case == "read_later":  # the temporary is read by another node too
        call(g, aten.add_.Scalar, y := call(g, aten.sin.default, x), 1.0)
    elif case == "on_a_view":  # the temporary is a view of the input
        call(g, aten.add_.Scalar, call(g, aten.view.default, x, [-1]), 1.0)
    else:  # advances the generator
        call(g, aten.uniform_.default, call(g, aten.sin.default, x))
    gm = remove_dead_code_pass(module(g, call(g, aten.cos.default, y)), None)
    assert [t._opname for t in call_targets(gm)] == ops
    assert (stats(gm)["removed"], stats(gm)["dead_mutations"]) == (removed, dead_mutations)
    if case == "dead_temporary":
        x = torch.randn(4, 8)
        assert torch.equal(gm(x)[0], x.cos())
