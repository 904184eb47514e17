"""Dead code elimination for the traced training-step graph.

Matches: ``call_function`` / ``call_module`` / ``get_attr`` nodes whose result
is never used (directly or transitively) by the graph output.

Changes: erases them, except impure nodes: ops that mutate their inputs, random
ops, effectful ops (``Node.is_impure``) and every collective / communication op
(``_c10d_functional``, ``c10d_functional``, ``c10d`` namespaces), which are kept
even when unused so ranks stay in lock-step. Placeholders are never removed.
"""

from __future__ import annotations

import torch
import torch.fx

from graph_trainer.compiler.common import is_collective, num_nodes, set_pass_summary
from graph_trainer.compiler.registry import GraphPass


def _is_impure(node: torch.fx.Node) -> bool:
    return is_collective(node) or node.is_impure()


def remove_dead_code_pass(gm: torch.fx.GraphModule, example_inputs=None) -> torch.fx.GraphModule:
    """Remove unused pure nodes from ``gm`` (in place) and recompile.

    Keeps placeholders, the output, mutating / random / effectful ops and
    collectives. Records ``removed`` (number of nodes erased) in the pass stats.
    """
    before = num_nodes(gm)
    changed = gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
    gm.graph.lint()
    gm.recompile()
    removed = before - num_nodes(gm)
    set_pass_summary(
        gm,
        f"removed {removed} dead node(s)" if changed else "no dead code",
        removed=removed,
    )
    return gm


PASS = GraphPass(
    name="remove_dead_code", fn=remove_dead_code_pass, enabled=lambda ctx: True, in_memory_trial=True, aliases=("dce",),
)
