"""Tag FlexAttention higher-order ops for regional Inductor compilation.

FlexAttention only runs fast when Inductor generates its kernel, so in a graph
that is otherwise run eagerly the FlexAttention calls must be compiled regions.

Matches: ``torch.ops.higher_order.flex_attention`` and
``torch.ops.higher_order.flex_attention_backward`` nodes.

Changes: sets ``node.meta["custom"]["compile_with_inductor"] =
{"inductor_configs": {}, "inductor_region": "flex_attention_<phase>_<i>"}`` on
each matched node, on its ``operator.getitem`` users and on the ``get_attr``
nodes that feed it (the score_mod / mask_mod / joint sub-graphs: a region input
must be a tensor with a fake value, a sub-graph must live inside the region). A
``get_attr`` shared by several FlexAttention calls is duplicated so each call
owns its copy. Every call gets its own region id, so regional_inductor compiles
each FlexAttention forward / backward separately. Other ``custom`` entries are
preserved; no other node is touched.
"""

from __future__ import annotations

import torch
import torch.fx

from graph_trainer.compiler.common import is_getitem, set_pass_summary, tag_for_inductor
from graph_trainer.compiler.registry import GraphPass


def _flex_targets() -> tuple:
    hop = torch.ops.higher_order
    targets = []
    for name in ("flex_attention", "flex_attention_backward"):
        try:
            targets.append(getattr(hop, name))
        except (AttributeError, RuntimeError):  # pragma: no cover - very old torch
            pass
    return tuple(targets)


def annotate_flex_attention_for_regional_inductor_pass(
    gm: torch.fx.GraphModule, example_inputs=None
) -> torch.fx.GraphModule:
    """Tag every FlexAttention forward/backward call (+ its getitems and sub-graph
    get_attrs) with ``compile_with_inductor``, one region per call."""
    targets = _flex_targets()
    graph = gm.graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target in targets]
    counts = {"forward": 0, "backward": 0}
    for node in calls:
        is_bwd = node.target is getattr(torch.ops.higher_order, "flex_attention_backward", None)
        kind = "backward" if is_bwd else "forward"
        region = f"flex_attention_{kind}_{counts[kind]}"
        counts[kind] += 1
        configs: dict = {}
        for inp in list(node.all_input_nodes):
            if inp.op != "get_attr":
                continue
            if len(inp.users) > 1:
                # Shared sub-graph: give this call its own get_attr node.
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
    set_pass_summary(
        gm,
        f"tagged {counts['forward']} forward + {counts['backward']} backward FlexAttention call(s) "
        f"-> {len(calls)} region(s)",
        forward=counts["forward"],
        backward=counts["backward"],
        regions=len(calls),
    )
    return gm


PASS = GraphPass(
    name="annotate_flex_attention_for_regional_inductor", fn=annotate_flex_attention_for_regional_inductor_pass,
    enabled=lambda ctx: ctx.uses_flex_attention, requires=("regional_inductor",),
)
