"""Tag each transformer block's forward and backward as Inductor regions: whole-block fusion
like ``full_inductor``, compiled once per distinct region instead of once per block.

Matches: every :func:`compilable` node. Its region is its block (:func:`block_of`) and phase; a node without a module
FQN joins the run before it. Changes: ``compile_with_inductor = {"inductor_configs": {}, "inductor_region":
"block_<block>_<phase>_<run>"}``, replacing the tags (and eager-rounding marks) of the annotation passes before it.
Changes numerics as the whole-graph compile does."""

from dataclasses import dataclass
from typing import Any

import torch

from graph_trainer.compiler.collectives import hold, is_collective, is_wait, sole_wait, strip_holds
from graph_trainer.compiler.graph_values import accelerator_of
from graph_trainer.compiler.node_meta import (
    module_fqn_of, phase_of, set_pass_summary, tag_for_inductor, untag_for_inductor,
)
from graph_trainer.compiler.ops import is_getitem, mutated_args
from graph_trainer.compiler.registry import GraphPass

#: Module FQN prefix of the transformer blocks (Llama3: ``layers.<i>``).
BLOCKS_PREFIX = "layers"


def block_of(node: torch.fx.Node) -> str | None:
    """``"layers.<i>"`` for a node of block ``i``, ``"rest"`` for another module, None without a module FQN."""
    if (fqn := module_fqn_of(node)) is None:
        return None
    parts = fqn.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[0] == BLOCKS_PREFIX else "rest"


def _tensors(val: Any) -> list[torch.Tensor]:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def compilable(node: torch.fx.Node, device: torch.device | None, region: set[torch.fx.Node] = frozenset(),
               collectives: set[torch.fx.Node] = frozenset()) -> bool:
    """Whether ``node`` may join a block region: an aten op producing tensors, not a collective or a wait unless in
    ``collectives``, mutating nothing but nodes of ``region``, and (with ``device`` an accelerator) none of its
    tensors on the CPU."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if is_collective(node) and node not in collectives:
        return False
    if target._schema.is_mutable and not all(a in region for a in mutated_args(node)):
        return False
    outs = _tensors(node.meta.get("val"))
    if not outs or device is None or device.type == "cpu":
        return bool(outs)
    ins = [v for u in node.all_input_nodes for v in _tensors(u.meta.get("val"))]
    return not any(t.device.type == "cpu" for t in outs + ins)


def _tag_runs(gm: torch.fx.GraphModule, device: torch.device | None,
              collectives: set[torch.fx.Node]) -> dict[torch.fx.Node, str]:
    """One pass of tagging (:func:`annotate_blocks_pass`); returns ``{node: run id}`` of the tagged nodes."""
    current, run, n_runs, broken = None, "", 0, False  # the run's block and phase, its region id
    members: set[torch.fx.Node] = set()  # the run's nodes, their getitems and holds
    downstream: set[torch.fx.Node] = set()  # nodes outside the run computed from it
    run_of: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        untag_for_inductor(node)
        if (is_getitem(node) or node.target is hold) and node.args[0] in members:
            members.add(node)
            continue
        block = block_of(node)
        region = f"block_{block}_{phase_of(node) or 'forward'}" if block is not None else current
        if region is None or not compilable(node, device, members if region == current else set(), collectives):
            if any(u in members or u in downstream for u in node.all_input_nodes):
                downstream.add(node)
            if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
                broken = True  # the run's reads must not move past an eager in-place op
            continue
        if region != current or broken or any(u in downstream for u in node.all_input_nodes):
            broken = False
            current, run, n_runs = region, f"{region}_{n_runs}", n_runs + 1
            members, downstream = set(), set()
        tag_for_inductor(node, {}, run)
        members.add(node)
        run_of[node] = run
    return run_of


def annotate_blocks_pass(gm: torch.fx.GraphModule, example_inputs: Any = None,
                         collectives: bool = False) -> torch.fx.GraphModule:
    """Tag ``gm``'s nodes into regions of one block and phase each (module docstring): runs of consecutive matched
    nodes, cut where a node would read a value computed from the run outside it and after an eager in-place op.
    ``collectives``: a collective and its ``wait_tensor`` join a region when both land in the same one (the ``hold``
    after the wait is removed). Stats: ``nodes``, ``regions``, ``blocks``, ``collectives``."""
    device = accelerator_of(gm)
    pairs = {node: wait for node in gm.graph.nodes if collectives and is_collective(node) and not is_wait(node)
             and (wait := sole_wait(node)) is not None}
    while True:
        run_of = _tag_runs(gm, device, {n for pair in pairs.items() for n in pair})
        split = [c for c, w in pairs.items() if c not in run_of or run_of.get(w) != run_of[c]]
        if not split:
            break
        for c in split:
            del pairs[c]
    strip_holds(gm, run_of)  # a wait inside a region needs no keep-alive
    runs = set(run_of.values())
    blocks = {r.split("_")[1] for r in runs}
    inside = f"; {len(pairs)} collective(s) inside them" if collectives else ""
    set_pass_summary(gm, f"tagged {len(run_of)} node(s) into {len(runs)} region(s) of {len(blocks)} blocks and the "
                     f"rest, forward and backward{inside}",
                     nodes=len(run_of), regions=len(runs), blocks=len(blocks), collectives=len(pairs))
    return gm


@dataclass
class AnnotateBlocksOptions:
    """``[compile.annotate_blocks]``: options of ``annotate_blocks``."""

    collectives: bool = False
    """Compile a collective and its wait inside a block's region where both fall in it (TP's
    all-gathers and reduce-scatters), so they no longer cut the block into several regions."""


PASS = GraphPass(
    name="annotate_blocks", fn=annotate_blocks_pass, options=AnnotateBlocksOptions, changes_numerics=True,
    requires=("regional_inductor",), aliases=("blocks",),
)
