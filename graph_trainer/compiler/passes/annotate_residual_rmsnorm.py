"""Grow every RMSNorm region by its residual add: one fused add + RMSNorm kernel.

Runs after ``annotate_rmsnorm_for_regional_inductor`` and tags into a ``rmsnorm_forward_*`` region its input when
exactly one input is an untagged ``aten.add.Tensor`` of two tensors, and into a ``rmsnorm_backward_*`` region each
such add reading a region node with the shape of one of the region's activation inputs (2-D or more). Changes
numerics like the RMSNorm pass."""

import torch

from graph_trainer.compiler.graph_values import shape_of
from graph_trainer.compiler.node_meta import inductor_tag, region_of, set_pass_summary, tag_for_inductor
from graph_trainer.compiler.registry import GraphPass


def _is_residual_add(node: torch.fx.Node) -> bool:
    """``aten.add.Tensor`` of two tensors, not tagged for any region."""
    return (node.op == "call_function" and node.target is torch.ops.aten.add.Tensor and region_of(node) is None
            and sum(isinstance(a, torch.fx.Node) for a in node.args[:2]) == 2)


def annotate_residual_rmsnorm_for_regional_inductor_pass(gm: torch.fx.GraphModule,
                                                         example_inputs=None) -> torch.fx.GraphModule:
    """Tag each RMSNorm region's residual add into it. Stats: ``forward``, ``backward``, ``regions``."""
    regions: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if (region := region_of(node)) is not None and region.startswith("rmsnorm_"):
            regions.setdefault(region, []).append(node)
    joined = {"forward": 0, "backward": 0}
    for region, nodes in regions.items():
        members = set(nodes)
        tag = inductor_tag(nodes[0])
        if region.startswith("rmsnorm_forward_"):
            adds = {a for n in nodes for a in n.all_input_nodes if a not in members and _is_residual_add(a)}
            if len(adds) == 1:
                (add,) = adds
                _tag(add, tag)
                joined["forward"] += 1
        elif region.startswith("rmsnorm_backward_"):
            grad_shapes = {shape_of(a) for n in nodes for a in n.all_input_nodes if a not in members}
            for user in {u for n in nodes for u in n.users if u not in members}:
                if _is_residual_add(user) and shape_of(user) in grad_shapes and len(shape_of(user)) >= 2:
                    _tag(user, tag)
                    joined["backward"] += 1
    set_pass_summary(gm, f"joined {joined['forward']} forward and {joined['backward']} backward residual adds "
                         f"to {len(regions)} RMSNorm regions", **joined, regions=len(regions))
    return gm


def _tag(node: torch.fx.Node, annotation: dict) -> None:
    tag_for_inductor(node, annotation.get("inductor_configs", {}), annotation["inductor_region"],
                     annotation.get("candidate_inductor_configs"))


PASS = GraphPass(name="annotate_residual_rmsnorm_for_regional_inductor",
                 fn=annotate_residual_rmsnorm_for_regional_inductor_pass, changes_numerics=True,
                 requires=("regional_inductor",), aliases=("residual_rmsnorm",))
