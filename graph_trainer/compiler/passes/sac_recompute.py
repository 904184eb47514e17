"""Recompute in the backward what op-level selective activation checkpointing did not save.

Under make_fx SAC only tags the nodes (``meta["recompute"]``). Each backward use of a forward node tagged
``PREFER_RECOMPUTE`` / ``MUST_RECOMPUTE`` inside a checkpointed block (never an op that mutates an input, a random op
or a collective) is rewired to a copy placed before the first backward node that needs it, with the copy's tagged
inputs of the same block copied the same way; then the tags are removed. The same bits as eager SAC."""

import contextlib
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree

from graph_trainer import AC_REGION_KEY, PHASE_KEY
from graph_trainer.compiler.collectives import collective_kind, is_collective, is_wait, shard_chain
from graph_trainer.compiler.graph_values import storages
from graph_trainer.compiler.node_meta import (custom_meta, is_tagged_recompute, phase_of, set_pass_summary,
                                              strip_recompute_tags)
from graph_trainer.compiler.ops import is_getitem, returns_view
from graph_trainer.compiler.registry import GraphPass, PassContext

RECOMPUTED_FROM_KEY = "graph_trainer_recomputed_from"


def _region(node: torch.fx.Node):
    return custom_meta(node).get(AC_REGION_KEY)


def _is_recomputable(node: torch.fx.Node, save_ops=frozenset()) -> bool:
    if node.op != "call_function" or phase_of(node) != "forward" or not is_tagged_recompute(node):
        return False
    if node.target in save_ops or _region(node) is None:  # outside a block: SAC's left-over tag
        return False
    target = node.target
    if target is operator.getitem:
        return isinstance(node.args[0], torch.fx.Node) and _is_recomputable(node.args[0], save_ops)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return not (target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags or is_collective(node))


def _pointwise_or_cast(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target.overloadpacket is torch.ops.aten._to_copy)


def _gathers_activation(node: torch.fx.Node) -> bool:
    """A forward all-gather of an activation (not an FSDP parameter's) inside a checkpointed block."""
    return (collective_kind(node) == "all_gather_into_tensor" and phase_of(node) == "forward"
            and _region(node) is not None and shard_chain(node) is None)


#: Non-pointwise ops as cheap to recompute as a pointwise one (RMSNorm's forward reads what the backward keeps).
CHEAP_OPS = frozenset({torch.ops.aten._fused_rms_norm.default})


def cheap_to_recompute(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The forward values the backward may recompute from less than they hold (``--compile.sac.save all_but_cheap``): an
    activation's all-gather and its wait (:func:`_gathers_activation`); tagged (:func:`_is_recomputable`) pointwise ops,
    casts and :data:`CHEAP_OPS` whose every input is a graph input, such a value of the same block or a value whose
    storage the backward reads anyway; and the views and ``getitem`` s of such values."""
    read = {ref for n in saved_for_backward(graph) for ref, _ in storages(n.meta.get("val"))}

    def storage_read(n: torch.fx.Node) -> bool:  # the backward reads n's storage (n, a view of it, its base)
        return any(ref in read for ref, _ in storages(n.meta.get("val")))

    cheap: set[torch.fx.Node] = set()
    for n in graph.nodes:  # topological: inputs are decided first
        if is_wait(n) and _gathers_activation(n.args[0]):
            cheap.update((n.args[0], n))
        elif n.op != "call_function" or not _is_recomputable(n):
            continue
        elif returns_view(n.target) or is_getitem(n):
            if n.all_input_nodes and n.all_input_nodes[0] in cheap:
                cheap.add(n)
        elif (_pointwise_or_cast(n) or n.target in CHEAP_OPS) and all(
                a.op in ("placeholder", "get_attr") or (a in cheap and _region(a) == _region(n)) or storage_read(a)
                for a in n.all_input_nodes):
            cheap.add(n)
    return cheap


def _saved_bytes(graph: torch.fx.Graph) -> int:
    """Bytes of the distinct storages (graph inputs excluded) of :func:`saved_for_backward`."""
    inputs = {ref for n in graph.nodes if n.op == "placeholder" for ref, _ in storages(n.meta.get("val"))}
    seen: dict = {}
    for n in saved_for_backward(graph):
        for ref, nbytes in storages(n.meta.get("val")):
            if ref not in inputs:
                seen[ref] = max(seen.get(ref, 0), nbytes)
    return sum(seen.values())


def _fresh_val(node: torch.fx.Node, copies: dict) -> object:
    """``meta["val"]`` of a copy of ``node``: a fake tensor of the same shape and strides on its own storage, or for
    a view of an input, that view of the input's copy."""

    def fresh(v):
        if not isinstance(v, torch.Tensor):
            return v
        own = storages(v)  # empty for tensor subclasses without storage
        for a in node.all_input_nodes:
            av = a.meta.get("val")
            if isinstance(av, torch.Tensor) and own and (sa := storages(av)) and sa[0][0] == own[0][0]:
                base = copies.get(a, a).meta.get("val")
                with getattr(base, "fake_mode", None) or contextlib.nullcontext():
                    return base.as_strided(v.shape, v.stride(), v.storage_offset())
        with getattr(v, "fake_mode", None) or contextlib.nullcontext():
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)

    return pytree.tree_map(fresh, node.meta.get("val"))


def saved_for_backward(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Forward ``call_function`` nodes a backward node uses (the saved activations)."""
    return [n for n in graph.nodes
            if n.op == "call_function" and phase_of(n) == "forward" and any(phase_of(u) == "backward" for u in n.users)]


def sac_recompute_pass(gm: torch.fx.GraphModule, example_inputs=None, save_ops=(), save_all: bool = False,
                       cheap_only: bool = False) -> torch.fx.GraphModule:
    """Recompute SAC's ``PREFER/MUST_RECOMPUTE`` forward ops in the backward (module docstring).

    ``save_ops``: OpOverloads kept even where tagged; ``save_all``: recompute nothing, only remove the tags;
    ``cheap_only``: recompute only :func:`cheap_to_recompute`'s values. Stats: ``recomputed`` (copies),
    ``recomputed_mm``, ``tags_removed``, ``saved_bytes_before`` / ``_after`` (:func:`_saved_bytes`)."""
    graph = gm.graph
    save_ops = frozenset(save_ops)
    saved_before = _saved_bytes(graph)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    recomputable = cheap_to_recompute(graph).__contains__ if cheap_only else lambda n: _is_recomputable(n, save_ops)

    def copy_of(node: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node:
        if node in copies:
            return copies[node]
        for a in node.all_input_nodes:  # tagged inputs of the same block first, so they precede the copy
            if recomputable(a) and _region(a) == _region(node):
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
        for a in [a for a in user.all_input_nodes if recomputable(a)]:
            user.replace_input_with(a, copy_of(a, user))
    n_tags = strip_recompute_tags(graph)
    if copies:
        graph.lint()
        gm.recompile()
    saved_after = _saved_bytes(graph)
    n_mm = sum(n.target is torch.ops.aten.mm.default for n in copies)
    set_pass_summary(gm, f"recomputed {len(copies)} op(s) in the backward ({n_mm} mm) that selective AC tagged; "
                     f"forward values kept for the backward {saved_before / 2**30:.2f} -> {saved_after / 2**30:.2f} GiB"
                     if copies else ("kept every value selective AC tagged for recompute" if save_all and n_tags else
                                     "nothing tagged for recompute (no op-level selective AC)"),
                     recomputed=len(copies), tags_removed=n_tags, recomputed_mm=n_mm,
                     saved_bytes_before=saved_before, saved_bytes_after=saved_after)
    return gm


def _kwargs(options: None, ctx: PassContext) -> dict[str, Any]:
    """``[compile.sac] save`` as the memory policy resolved it (``ctx.levers.save``)."""
    save = ctx.levers.save if ctx.levers is not None else "recompute"
    return {"matmuls": {"save_ops": [torch.ops.aten.mm.default]}, "all_but_cheap": {"cheap_only": True},
            "all": {"save_all": True}}.get(save, {})


PASS = GraphPass(name="sac_recompute", fn=sac_recompute_pass, enabled=lambda ctx: True, kwargs=_kwargs,
                 in_memory_trial=True)
