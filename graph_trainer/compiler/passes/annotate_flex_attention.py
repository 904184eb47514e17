"""Tag FlexAttention higher-order ops for regional Inductor compilation (FlexAttention is only
fast with the kernel Inductor generates).

Tags each ``flex_attention`` / ``flex_attention_backward`` call, its ``getitem`` users and the ``get_attr`` nodes of
its sub-graphs (duplicated where shared) with ``compile_with_inductor = {"inductor_configs": {}, "inductor_region":
"flex_attention_<phase>_<i>"}``, one region per call."""

import torch

from graph_trainer.compiler.node_meta import set_pass_summary, tag_for_inductor
from graph_trainer.compiler.ops import is_call, is_getitem
from graph_trainer.compiler.registry import GraphPass


def annotate_flex_attention_for_regional_inductor_pass(gm: torch.fx.GraphModule,
                                                       example_inputs=None) -> torch.fx.GraphModule:
    """Tag every FlexAttention call as its own region. Stats: ``forward``, ``backward``, ``regions``."""
    hop = torch.ops.higher_order
    graph = gm.graph
    calls = [n for n in graph.nodes if is_call(n, (hop.flex_attention, hop.flex_attention_backward))]
    counts = {"forward": 0, "backward": 0}
    for node in calls:
        kind = "backward" if node.target is hop.flex_attention_backward else "forward"
        region = f"flex_attention_{kind}_{counts[kind]}"
        counts[kind] += 1
        configs: dict = {}
        for inp in list(node.all_input_nodes):
            if inp.op != "get_attr":
                continue
            if len(inp.users) > 1:  # shared sub-graph: this call gets its own get_attr
                with graph.inserting_before(node):
                    dup = graph.get_attr(inp.target)
                dup.meta = dict(inp.meta)
                node.replace_input_with(inp, dup)
                inp = dup
            tag_for_inductor(inp, configs, region)
        tag_for_inductor(node, configs, region)
        for user in node.users:
            if is_getitem(user):
                tag_for_inductor(user, configs, region)
    if calls:
        graph.lint()
        gm.recompile()
    set_pass_summary(gm, f"tagged {counts['forward']} forward + {counts['backward']} backward FlexAttention call(s) "
                     f"-> {len(calls)} region(s)", **counts, regions=len(calls))
    return gm


PASS = GraphPass(name="annotate_flex_attention_for_regional_inductor", requires=("regional_inductor",),
                 fn=annotate_flex_attention_for_regional_inductor_pass, enabled=lambda ctx: ctx.uses_flex_attention)
