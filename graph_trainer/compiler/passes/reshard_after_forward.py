"""FSDP2's ``reshard_after_forward=True`` for the traced step: free gathered parameters after
the forward and all-gather them again for the backward.

Matches: FSDP parameter all-gathers (:func:`~graph_trainer.compiler.collectives.shard_chain`) and their view
closure: the wait, its ``hold`` and every view / cast of the gathered value.

Changes: backward-phase uses of the closure are rewired to a copy of it (the shard's cast, a second all-gather, its
wait and the views they need), placed before the first backward use, the all-gather ``prefetch`` re-gathers earlier
in backward order. Same bits, one more all-gather per parameter and step."""

import contextlib
from typing import Any

import torch

from graph_trainer import PHASE_KEY
from graph_trainer.compiler.collectives import collective_kind, is_wait, read_through, shard_chain
from graph_trainer.compiler.graph_values import positions
from graph_trainer.compiler.node_meta import custom_meta, phase_of, set_pass_summary
from graph_trainer.compiler.ops import CAST_OPS, VIEW_OPS
from graph_trainer.compiler.registry import GraphPass, PassContext

_VIEW_OR_CAST = VIEW_OPS | CAST_OPS


def _fresh_val(new: torch.fx.Node, val):
    """The fake value of a copied node on its own storage (views: of the copied base)."""
    if not isinstance(val, torch.Tensor):
        return val
    args, kwargs = torch.fx.node.map_arg((new.args, new.kwargs), lambda a: a.meta.get("val"))
    if is_wait(new) and isinstance(args[0], torch.Tensor):
        return args[0]  # a wait returns its collective's buffer
    if new.target in _VIEW_OR_CAST:
        with contextlib.suppress(Exception):  # views / casts of the copied parent, computed by the fake mode
            return new.target(*args, **kwargs)
    with getattr(val, "fake_mode", None) or contextlib.nullcontext():
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def _refresh_views(node: torch.fx.Node) -> None:
    """Recompute the fake values of the views from ``node`` on (after rewiring they alias the old buffer)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.op == "call_function" and n.target in _VIEW_OR_CAST and isinstance(val := n.meta.get("val"), torch.Tensor):
            n.meta["val"] = _fresh_val(n, val)
            stack.extend(n.users)


def reshard_after_forward_pass(gm: torch.fx.GraphModule, example_inputs=None, prefetch: int = 9,
                               cpu_async: bool = False, first_params: int | None = None) -> torch.fx.GraphModule:
    """Re-gather FSDP parameters for the backward instead of keeping the forward's copies.

    ``prefetch`` (>= 0): re-gathers issued that many ahead in backward order (0 on CPU unless ``cpu_async``).
    ``first_params``: only the first N FSDP parameters in forward order; None: all. Stats: ``resharded``,
    ``fsdp_all_gathers``, ``rewired_uses``. Raises ``ValueError`` for ``prefetch < 0`` or ``first_params < 0``."""
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if first_params is not None and first_params < 0:
        raise ValueError(f"first_params must be >= 0 (or None for all), got {first_params}")
    graph = gm.graph
    pos = positions(graph)
    groups, n_fsdp = [], 0
    for ag in [n for n in graph.nodes if collective_kind(n) == "all_gather_into_tensor"]:
        if (chain := shard_chain(ag)) is None:
            continue
        n_fsdp += 1
        if first_params is not None and n_fsdp > first_params:
            continue
        closure = dict.fromkeys(read_through(ag, _VIEW_OR_CAST, lambda u: phase_of(u) != "backward"))
        bwd_users = sorted({u for c in closure for u in c.users if u not in closure and phase_of(u) == "backward"},
                           key=pos.__getitem__)
        if bwd_users:
            groups.append((ag, chain, closure, bwd_users))
    groups.sort(key=lambda g: pos[g[3][0]])  # backward order

    rewired = 0
    first_use = [g[3][0] for g in groups]
    for i, (ag, chain, closure, bwd_users) in enumerate(groups):
        cpu = isinstance(ag.meta.get("val"), torch.Tensor) and ag.meta["val"].device.type == "cpu"
        issue_at = first_use[max(i - (0 if cpu and not cpu_async else prefetch), 0)]
        copies: dict[torch.fx.Node, torch.fx.Node] = {}

        def copy_node(n, at):
            with graph.inserting_before(at):
                new = graph.node_copy(n, lambda a: copies.get(a, a))
            new.meta = dict(n.meta)
            new.meta["custom"] = {**custom_meta(n), PHASE_KEY: "backward", "reshard": "regather"}
            new.meta["val"] = _fresh_val(new, n.meta.get("val"))
            copies[n] = new
            return new

        for n in chain + [ag]:  # cast of the shard + the all-gather: issued early
            copy_node(n, issue_at)
        # every closure node on a path from the all-gather to a backward user
        keep, stack = set(), list({a for u in bwd_users for a in u.all_input_nodes if a in closure})
        while stack:
            m = stack.pop()
            if m not in keep and m is not ag:
                keep.add(m)
                stack.extend(a for a in m.all_input_nodes if a in closure)
        for n in sorted(keep, key=pos.__getitem__):
            copy_node(n, bwd_users[0])
        for u in bwd_users:
            before = u.args, u.kwargs
            u.args = torch.fx.node.map_arg(u.args, lambda a: copies.get(a, a))
            u.kwargs = torch.fx.node.map_arg(u.kwargs, lambda a: copies.get(a, a))
            rewired += (u.args, u.kwargs) != before
            _refresh_views(u)
    graph.lint()
    gm.recompile()
    set_pass_summary(gm, f"re-gather {len(groups)} of {n_fsdp} FSDP parameters for the backward ({rewired} backward "
                     f"uses rewired, prefetch {prefetch})" if n_fsdp else "no FSDP all-gathers",
                     resharded=len(groups), fsdp_all_gathers=n_fsdp, rewired_uses=rewired)
    return gm


def _kwargs(options: None, ctx: PassContext) -> dict[str, Any]:
    """``keep_last_blocks`` (as the memory policy resolved it) in parameters; ``ValueError`` without a layout."""
    keep = ctx.levers.keep_last_blocks if ctx.levers is not None else 0
    if keep <= 0:
        return {}
    if ctx.layout is None:
        raise ValueError("--compile.fsdp.keep_last_blocks needs the model's block layout")
    return {"first_params": ctx.layout.params_of_first_blocks(ctx.layout.n_blocks - keep)}


PASS = GraphPass(name="reshard_after_forward", fn=reshard_after_forward_pass, enabled=lambda ctx: True, kwargs=_kwargs,
                 in_memory_trial=True)
