"""Recompute in the backward what selective activation checkpointing did not save.

Matches: forward-phase nodes whose ``node.meta["recompute"]`` is
``CheckpointPolicy.PREFER_RECOMPUTE`` or ``MUST_RECOMPUTE`` -- the tag op-level SAC
(``--activation_checkpoint.mode selective``, ``selective_ac_option = "op"``, torchtitan's
policy: save every other ``mm``, the attention outputs, ...) writes on each op of a
checkpointed block -- and that a backward-phase node uses.

Why it is needed: under make_fx ``torch.utils.checkpoint``'s SAC sees a tracing
("compiling") dispatch mode and does not recompute; it saves every op's output and
only tags the nodes, leaving recomputation to a partitioner (AOTAutograd's min-cut
partitioner does it for torch.compile). The traced joint graph has no partitioner, so
without this pass op-level SAC keeps all activations, like no AC at all (the traced
graph has as many ``mm`` as with ``mode = "none"``; a test checks it).
Layer-level AC (``full``, or ``selective`` with an integer option) really recomputes
under make_fx and carries no tags: this pass then does nothing.

Changes: every backward use of a matched node is rewired to a copy of it, placed just
before the first backward node that needs it; the copy's tagged inputs from the same
checkpointed block (``custom["ac_region"]``, set at trace time on every node inside a
``CheckpointWrapper``) are copied the same way (recursively), and its other inputs --
``MUST_SAVE`` / ``PREFER_SAVE`` outputs and the block's inputs, which eager
checkpointing saves -- are used as saved. Nodes outside any block are never matched
(SAC's last tag stays set after the block: the final norm, output projection and loss
carry it). The forward node then dies after its last forward use. Copies are in the
``backward`` phase and keep the module FQN (like a layer-level AC recompute), so the
annotation passes treat them as recomputed forward ops. Not recomputed even when
tagged: ops that mutate an input, random ops, and collectives. Numerics: the copies run
the same ops on the same inputs, so every value equals the forward's bit for bit, and
the step equals eager op-level SAC (which recomputes the same ops). Afterwards the tags
are removed from every node (:func:`~graph_trainer.compiler.common.strip_recompute_tags`).

torch >= 2.12 has the same idea upstream for Inductor-compiled forward-loss-backward graphs
(``remat_using_tags_for_fwd_loss_bwd_graph``, run inside ``compile_fx``); torch 2.11, the GPU
machines' version, does not, and regional / uncompiled graphs never reach it: this pass does
it for every torch version and compilation mode.
"""

from __future__ import annotations

import contextlib
import operator

from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from graph_trainer import AC_REGION_KEY, PHASE_KEY
from graph_trainer.compiler.common import (
    custom_meta,
    is_collective,
    phase_of,
    set_pass_summary,
    storages,
    strip_recompute_tags,
)
from graph_trainer.compiler.registry import GraphPass, PassContext

RECOMPUTED_FROM_KEY = "graph_trainer_recomputed_from"


def _recompute_policies():
    from torch.utils.checkpoint import CheckpointPolicy

    return (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def _region(node: torch.fx.Node):
    return custom_meta(node).get(AC_REGION_KEY)


def _is_recomputable(node: torch.fx.Node, policies, save_ops=frozenset()) -> bool:
    if node.op != "call_function" or phase_of(node) != "forward" or node.meta.get("recompute") not in policies:
        return False
    if node.target in save_ops:
        return False
    if _region(node) is None:  # SAC leaves its last tag in place after the block: ignore it there
        return False
    target = node.target
    if target is operator.getitem:
        src = node.args[0]
        return isinstance(src, torch.fx.Node) and _is_recomputable(src, policies, save_ops)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not is_collective(node)


def _saved_bytes(graph: torch.fx.Graph) -> int:
    """Bytes of the distinct storages (not views, not graph inputs) that the forward
    nodes used by the backward hold."""
    inputs = {ref for n in graph.nodes if n.op == "placeholder" for ref, _ in storages(n.meta.get("val"))}
    seen: dict = {}
    for n in saved_for_backward(graph):
        for ref, nbytes in storages(n.meta.get("val")):
            if ref not in inputs:
                seen[ref] = max(seen.get(ref, 0), nbytes)
    return sum(seen.values())


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = storages(a), storages(b)  # empty for tensor subclasses without storage
    return bool(sa and sb) and sa[0][0] == sb[0][0]


def _fresh_val(node: torch.fx.Node, copies: dict) -> object:
    """``node.meta["val"]`` for a copy of ``node``: a new fake tensor of the same shape and
    strides (its own storage, so memory estimates see the recomputed buffer apart from the
    forward one), or, for a view of an input, the same view of that input's copy."""

    def fresh(v):
        if not isinstance(v, torch.Tensor):
            return v
        for a in node.all_input_nodes:
            av = a.meta.get("val")
            if isinstance(av, torch.Tensor) and _same_storage(av, v):
                base = copies.get(a, a).meta.get("val")
                mode = getattr(base, "fake_mode", None)
                with mode if mode is not None else contextlib.nullcontext():
                    return base.as_strided(v.shape, v.stride(), v.storage_offset())
        mode = getattr(v, "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)

    return pytree.tree_map(fresh, node.meta.get("val"))


def saved_for_backward(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Forward-phase non-placeholder nodes that a backward-phase node uses (the saved
    activations; graph inputs such as parameters are not counted)."""
    return [
        n for n in graph.nodes
        if n.op == "call_function" and phase_of(n) == "forward" and any(phase_of(u) == "backward" for u in n.users)
    ]  # fmt: skip


def sac_recompute_pass(
    gm: torch.fx.GraphModule, example_inputs=None, save_ops=(), save_all: bool = False
) -> torch.fx.GraphModule:
    """Recompute SAC's ``PREFER/MUST_RECOMPUTE`` forward ops in the backward (module docstring).

    ``save_ops``: OpOverloads kept as saved even where tagged for recompute (e.g.
    ``aten.mm.default``: ``--compile.sac.save matmuls``, no matmul recompute).
    ``save_all``: recompute nothing, only remove the tags (``--compile.sac.save all``).

    Stats: ``recomputed`` (copies made), ``recomputed_mm`` (of them ``aten.mm``),
    ``saved_bytes_before`` / ``saved_bytes_after`` (bytes of the distinct storages the
    forward nodes used by the backward hold, graph inputs excluded: activations, and
    under FSDP the gathered parameters until ``reshard_after_forward`` re-gathers them).
    """
    graph = gm.graph
    policies = _recompute_policies()
    save_ops = frozenset(save_ops)
    saved_before = _saved_bytes(graph)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def copy_of(node: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
        if node in copies:
            return copies[node]
        for a in node.all_input_nodes:  # tagged inputs of the same block first, so they precede the copy
            if _is_recomputable(a, policies, save_ops) and _region(a) == _region(node):
                copy_of(a, before)
        with graph.inserting_before(before):
            new = graph.node_copy(node, lambda a: copies.get(a, a))
        new.meta["custom"] = {**custom_meta(node), PHASE_KEY: "backward"}
        if "val" in node.meta:
            new.meta["val"] = _fresh_val(node, copies)
        new.meta[RECOMPUTED_FROM_KEY] = node.name
        copies[node] = new
        return new

    for user in [n for n in graph.nodes if phase_of(n) == "backward" and not save_all]:
        tagged = [a for a in user.all_input_nodes if _is_recomputable(a, policies, save_ops)]
        if not tagged:
            continue
        for a in tagged:
            copy_of(a, user)
        user.args = torch.fx.node.map_arg(user.args, lambda a: copies.get(a, a))
        user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: copies.get(a, a))
    n_tags = strip_recompute_tags(graph)
    if copies:
        graph.lint()
        gm.recompile()
    saved_after = _saved_bytes(graph)
    n_mm = sum(n.target is torch.ops.aten.mm.default for n in copies)
    gib = 2**30
    set_pass_summary(
        gm,
        f"recomputed {len(copies)} op(s) in the backward ({n_mm} mm) that selective AC tagged; "
        f"forward values kept for the backward {saved_before / gib:.2f} -> {saved_after / gib:.2f} GiB"
        if copies else ("kept every value selective AC tagged for recompute" if save_all and n_tags else
                        "nothing tagged for recompute (no op-level selective AC)"),
        recomputed=len(copies),
        tags_removed=n_tags,
        recomputed_mm=n_mm,
        saved_bytes_before=saved_before,
        saved_bytes_after=saved_after,
    )
    return gm


def _kwargs(options: None, ctx: PassContext) -> dict[str, Any]:
    """``[compile.sac] save`` as the memory policy resolved it (``ctx.levers.save``)."""
    save = ctx.levers.save if ctx.levers is not None else "recompute"
    if save == "matmuls":
        return {"save_ops": [torch.ops.aten.mm.default]}
    return {"save_all": True} if save == "all" else {}


PASS = GraphPass(
    name="sac_recompute", fn=sac_recompute_pass, enabled=lambda ctx: True, kwargs=_kwargs, in_memory_trial=True,
)
