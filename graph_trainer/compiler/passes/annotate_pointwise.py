"""Tag chains of pointwise ops as Inductor regions: SwiGLU, residual adds, casts, the loss.

Matches the regions of :func:`graph_trainer.compiler.matching.find_pointwise_regions` and tags them
``compile_with_inductor = {"inductor_configs": {}, "inductor_region": "pointwise_<phase>_<i>"}``. Changes numerics
(fused bf16 chains in fp32): opt-in."""

from typing import Any

import torch.fx

from graph_trainer.compiler.matching import find_pointwise_regions, tag_regions
from graph_trainer.compiler.node_meta import set_pass_summary
from graph_trainer.compiler.registry import GraphPass


def annotate_pointwise_for_regional_inductor_pass(gm: torch.fx.GraphModule, example_inputs: Any = None,
                                                  inductor_configs: dict[str, Any] | None = None,
                                                  min_ops: int = 2) -> torch.fx.GraphModule:
    """Tag each region of :func:`find_pointwise_regions` for ``regional_inductor`` with
    ``inductor_configs`` (default ``{}``); ``ValueError`` for ``min_ops < 1``. Stats: those of
    :func:`~graph_trainer.compiler.matching.tag_regions`."""
    if min_ops < 1:
        raise ValueError(f"min_ops must be >= 1, got {min_ops}")
    st = tag_regions(find_pointwise_regions(gm.graph, min_ops), dict(inductor_configs or {}), "pointwise")
    set_pass_summary(gm, f"tagged {st['nodes']} pointwise/cast/reduction node(s) into {st['regions']} region(s) "
                     f"({st['forward_regions']} forward, {st['backward_regions']} backward; largest {st['largest']} "
                     "nodes)", **st)
    return gm


PASS = GraphPass(name="annotate_pointwise_for_regional_inductor", fn=annotate_pointwise_for_regional_inductor_pass,
                 changes_numerics=True, requires=("regional_inductor",), aliases=("pointwise",), in_memory_trial=True)
