"""annotate_flex_attention_for_regional_inductor_pass on a synthetic FlexAttention graph."""

import operator

import torch

from graph_trainer.compiler.passes.annotate_flex_attention import annotate_flex_attention_for_regional_inductor_pass
from graph_trainer.compiler.passes.regional_inductor import propose_region_partitions

from .conftest import aten, fx_graph, inductor_tag, stats, tagged_nodes


def test_annotate_flex_attention():
    root = torch.nn.Module()
    for name in ("score0", "mask0"):
        setattr(root, name, torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
        getattr(root, name).graph.output(None)
    g, (q, k, v) = fx_graph("q", "k", "v")
    score, mask = g.get_attr("score0"), g.get_attr("mask0")
    fa0 = g.call_function(torch.ops.higher_order.flex_attention, (q, k, v, score, (mask,), 1.0, {}, (), ()))
    o0 = g.call_function(operator.getitem, (fa0, 0))
    fa1 = g.call_function(torch.ops.higher_order.flex_attention, (o0, k, v, score, (mask,), 1.0, {}, (), ()))
    o1, lse = (g.call_function(operator.getitem, (fa1, i)) for i in (0, 1))
    bwd = g.call_function(torch.ops.higher_order.flex_attention_backward, (q, k, v, o1, lse, score, (mask,)))
    other = g.call_function(aten.sin.default, (g.call_function(operator.getitem, (bwd, 0)),))
    g.output((o1, other))
    for n in g.nodes:
        n.meta["custom"] = {"phase": "forward", "module_fqn": "layers.0.attention.inner_attention"}
    gm = annotate_flex_attention_for_regional_inductor_pass(torch.fx.GraphModule(root, g), None)
    assert (stats(gm)["forward"], stats(gm)["backward"], stats(gm)["regions"]) == (2, 1, 3)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not aten.sin.default]
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]  # shared ones duplicated: one user / region each
    assert set(tagged_nodes(gm)) == {*calls, *attrs}  # not the placeholders, the output, sin
    assert all(n.meta["custom"]["module_fqn"].endswith("inner_attention") for n in calls)
    assert len(attrs) == 6 and all(len(a.users) == 1 and inductor_tag(a) == inductor_tag(*a.users) for a in attrs)
    assert len(propose_region_partitions(gm)) == 3
