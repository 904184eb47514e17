"""Grow every RMSNorm region by its residual add: one fused add + RMSNorm kernel.

The fused residual-add + RMSNorm kernel of TransformerEngine and Megatron: Llama3's blocks
compute ``h = x + attention(attention_norm(x))`` and ``out = h + feed_forward(ffn_norm(h))``,
so every norm but the first reads the output of a residual add. Compiled with the norm, the
add's output is written once and read by the norm's reduction in the same kernel instead
of going through memory twice. In the backward, the gradient of ``h`` is the norm
backward's input gradient plus the gradient of the residual path; that add joins the norm
backward's region.

Runs after ``annotate_rmsnorm_for_regional_inductor`` and reads only its annotations
(``meta["custom"]["compile_with_inductor"]["inductor_region"]`` = ``rmsnorm_<kind>_<i>``).

Matches, per RMSNorm region:

* **forward** (``rmsnorm_forward_*``): the region's input when exactly one input is produced
  by ``aten.add.Tensor`` of two tensors, untagged (the weight, gathered or not, is no add).
  The first block's attention norm reads the embedding: no add, the region stays as it is.
* **backward** (``rmsnorm_backward_*``): each untagged ``aten.add.Tensor`` user of a region
  node whose value has the shape of one of the region's activation inputs (2-D or more):
  the residual-gradient sum.

Changes: the matched add gets the region's ``compile_with_inductor`` annotation (same
region id and Inductor configs), so ``regional_inductor`` compiles add and norm as one
region; no node is added, removed or rewired. Numerics change like the RMSNorm pass's
(the add's bf16 result is computed in the fused kernel), so it needs
``--compile.numerics_changing_optim``; opt-in with ``--compile.passes residual_rmsnorm``.
"""

from __future__ import annotations

import torch
import torch.fx

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY
from graph_trainer.compiler.node_meta import custom_meta, set_pass_summary, tag_for_inductor
from graph_trainer.compiler.registry import GraphPass

aten = torch.ops.aten


def _annotation(node: torch.fx.Node) -> dict:
    return custom_meta(node).get(COMPILE_WITH_INDUCTOR_KEY) or {}


def _region(node: torch.fx.Node) -> str | None:
    return _annotation(node).get("inductor_region")


def _is_residual_add(node: torch.fx.Node) -> bool:
    """``aten.add.Tensor`` of two tensors, not tagged for any region."""
    return (node.op == "call_function" and node.target is aten.add.Tensor and _region(node) is None
            and sum(isinstance(a, torch.fx.Node) for a in node.args[:2]) == 2)


def _shape(node: torch.fx.Node) -> tuple | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def annotate_residual_rmsnorm_for_regional_inductor_pass(
    gm: torch.fx.GraphModule, example_inputs=None
) -> torch.fx.GraphModule:
    """Tag each RMSNorm region's residual add into the region (see the module docstring).

    Stats: ``forward`` / ``backward`` (adds joined), ``regions`` (norm regions seen).

    Returns:
        ``gm``, annotations changed in place.
    """
    regions: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        region = _region(node)
        if region is not None and region.startswith("rmsnorm_"):
            regions.setdefault(region, []).append(node)
    joined = {"forward": 0, "backward": 0}
    for region, nodes in regions.items():
        members = set(nodes)
        tag = _annotation(nodes[0])
        if region.startswith("rmsnorm_forward_"):
            adds = {a for n in nodes for a in n.all_input_nodes if a not in members and _is_residual_add(a)}
            if len(adds) == 1:
                (add,) = adds
                _tag(add, tag)
                joined["forward"] += 1
        elif region.startswith("rmsnorm_backward_"):
            grad_shapes = {_shape(a) for n in nodes for a in n.all_input_nodes if a not in members}
            for user in {u for n in nodes for u in n.users if u not in members}:
                if _is_residual_add(user) and _shape(user) in grad_shapes and len(_shape(user)) >= 2:
                    _tag(user, tag)
                    joined["backward"] += 1
    set_pass_summary(gm, f"joined {joined['forward']} forward and {joined['backward']} backward residual adds "
                         f"to {len(regions)} RMSNorm regions", **joined, regions=len(regions))
    return gm


def _tag(node: torch.fx.Node, annotation: dict) -> None:
    tag_for_inductor(node, annotation.get("inductor_configs", {}), annotation["inductor_region"],
                     annotation.get("candidate_inductor_configs"))


PASS = GraphPass(
    name="annotate_residual_rmsnorm_for_regional_inductor", fn=annotate_residual_rmsnorm_for_regional_inductor_pass,
    changes_numerics=True, requires=("regional_inductor",), aliases=("residual_rmsnorm",),
)
