"""Dead code elimination for the traced training-step graph: torch.fx's
``Graph.eliminate_dead_code``, which keeps impure nodes (``Node.is_impure``: mutating, random,
effectful ops), with every collective kept too (unused or not) so that ranks stay in lock-step."""

from __future__ import annotations

import torch
import torch.fx

from graph_trainer.compiler.common import is_collective, num_nodes, set_pass_summary
from graph_trainer.compiler.registry import GraphPass


def remove_dead_code_pass(gm: torch.fx.GraphModule, example_inputs=None) -> torch.fx.GraphModule:
    """Remove unused pure nodes from ``gm`` (in place) and recompile. Stats: ``removed``."""
    before = num_nodes(gm)
    changed = gm.graph.eliminate_dead_code(is_impure_node=lambda n: is_collective(n) or n.is_impure())
    gm.graph.lint()
    gm.recompile()
    removed = before - num_nodes(gm)
    set_pass_summary(gm, f"removed {removed} dead node(s)" if changed else "no dead code", removed=removed)
    return gm


PASS = GraphPass(
    name="remove_dead_code", fn=remove_dead_code_pass, enabled=lambda ctx: True, in_memory_trial=True, aliases=("dce",),
)
