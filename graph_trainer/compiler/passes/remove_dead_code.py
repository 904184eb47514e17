"""Dead code elimination for the traced training-step graph: torch.fx's ``Graph.eliminate_dead_code``, which keeps
impure nodes (mutating, random, effectful ops), with every collective kept too so that ranks stay in lock-step.

An unused in-place op on fresh temporaries nothing else reads (:func:`mutates_only_dead_temporaries`) goes too."""

import torch

from graph_trainer.compiler.collectives import is_collective
from graph_trainer.compiler.node_meta import set_pass_summary
from graph_trainer.compiler.ops import mutated_args, num_nodes
from graph_trainer.compiler.registry import GraphPass


def _fresh(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an aten op whose outputs are new storage (no alias of an input)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and all(r.alias_info is None for r in target._schema.returns)
            and not any(a.alias_info is not None for a in target._schema.arguments))


def mutates_only_dead_temporaries(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an unused in-place aten op, not random, whose mutated arguments are each a :func:`_fresh`
    node's output read by ``node`` alone (so removing it changes no value the graph returns or mutates)."""
    target = node.target
    if node.users or node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
            or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    mutated = [m for m in mutated_args(node) if m is not None]
    return bool(mutated) and all(isinstance(m, torch.fx.Node) and _fresh(m) and set(m.users) == {node} for m in mutated)


def remove_dead_code_pass(gm: torch.fx.GraphModule, example_inputs=None) -> torch.fx.GraphModule:
    """Remove unused pure nodes and in-place ops on dead temporaries. Stats: ``removed``, ``dead_mutations``."""
    before = num_nodes(gm)
    dead_mutations: set[torch.fx.Node] = set()

    def impure(n: torch.fx.Node) -> bool:
        if is_collective(n):
            return True
        if not n.is_impure():
            return False
        if mutates_only_dead_temporaries(n):
            dead_mutations.add(n)
            return False
        return True

    changed = gm.graph.eliminate_dead_code(is_impure_node=impure)
    gm.graph.lint()
    gm.recompile()
    removed = before - num_nodes(gm)
    extra = f" ({len(dead_mutations)} in-place op(s) on dead temporaries)" if dead_mutations else ""
    set_pass_summary(gm, f"removed {removed} dead node(s){extra}" if changed else "no dead code", removed=removed,
                     dead_mutations=len(dead_mutations))
    return gm


PASS = GraphPass(name="remove_dead_code", fn=remove_dead_code_pass, enabled=lambda ctx: True, in_memory_trial=True,
                 aliases=("dce",))
