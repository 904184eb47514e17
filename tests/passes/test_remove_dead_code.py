"""remove_dead_code_pass: unused pure nodes are erased, collectives kept."""

import torch
import torch.fx

from graph_trainer.compiler.passes.remove_dead_code import remove_dead_code_pass

aten = torch.ops.aten


def test_remove_dead_code_keeps_collectives():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(aten.sin.default, (x,))  # dead
    g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))  # dead but kept
    g.output((g.call_function(aten.cos.default, (x,)),))
    gm = remove_dead_code_pass(torch.fx.GraphModule(torch.nn.Module(), g), None)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        torch.ops._c10d_functional.all_reduce.default, aten.cos.default]
    assert gm.meta["graph_trainer_pass_stats"]["removed"] == 1
