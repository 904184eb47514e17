"""Async TP: fuse TP's all-gather -> matmul and matmul -> reduce-scatter pairs into torch's
micro-pipelined symmetric-memory ops, on the TP process group only.

* **all-gather -> matmul**: the all-gather, its wait and the layout ops that rebuild the gathered ``A``
  (:func:`_rebuild_layout`); every same-phase ``aten.mm`` reading ``A`` as left operand joins one
  ``fused_all_gather_matmul``.
* **matmul -> reduce-scatter**: Inductor's ``find_reduce_scatter_patterns`` of one ``mm`` nothing else reads.

Everything else stays, with the reason in the summary. Not Inductor's ``micro_pipeline_tp_pass``: it matches
``aten.reshape`` (make_fx records ``view``), fuses across phases and leaves no fake values. Rewrites on a fake process
group (the dry run) or on CUDA with symmetric memory; else (CPU, ``COMM_MODE=fake_collectives``) skips. On by default on
CUDA. Numerics: not changed where checked, eager == traced bitwise with it under NCCL at TP degree 2 (the GPU tier,
``docs/perf.md``; there a reduce-scatter sums two terms, in either order the same); larger TP degrees are unchecked."""

import functools
import math
import operator
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from graph_trainer import NUMERICS_KEY
from graph_trainer.compiler.collectives import collective_kind, group_name_of, shard_chain, sole_wait
from graph_trainer.compiler.graph_values import detect_graph_fake_mode, positions, shape_of, tensor_val
from graph_trainer.compiler.node_meta import add_process_setup, custom_meta, phase_of, set_pass_summary
from graph_trainer.compiler.ops import RESHAPE_OPS, arg_of, aten, is_call, is_getitem, only_user
from graph_trainer.compiler.registry import GraphPass
from graph_trainer.distributed.fake_pg import BACKEND as FAKE_COLLECTIVES

#: Values of ``--compile.async_tp.fuse``: both kinds of pair, or one.
FUSE_CHOICES = ("all", "all_gather_matmul", "matmul_reduce_scatter")
_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default})
_NOOPS = RESHAPE_OPS | {aten.alias.default, aten.slice.Tensor}
_MM_OPS = frozenset({aten.mm.default})


@dataclass
class Matmul:
    """``post(mm(pre(A), B))``: ``pre`` / ``post`` reshape to and from 2-D (None: none)."""

    mm: torch.fx.Node
    a: torch.fx.Node
    b: torch.fx.Node
    pre: torch.fx.Node | None = None
    post: torch.fx.Node | None = None


@dataclass
class AllGatherMatch:
    """A TP all-gather, its gathered tensor ``res`` and its matmuls; ``reason``: why it stays unfused."""

    ag: torch.fx.Node
    wait: torch.fx.Node | None = None
    res: torch.fx.Node | None = None
    gather_dim: int = 0
    layout: list[torch.fx.Node] = field(default_factory=list)  # wait .. res
    copies: list[tuple[torch.fx.Node, list[torch.fx.Node]]] = field(default_factory=list)  # SAC's layout copies
    matmuls: list[Matmul] = field(default_factory=list)
    other_phase: int = 0  # matmuls reading A in another phase, left unfused
    reason: str | None = None


@dataclass
class ReduceScatterMatch:
    """A TP reduce-scatter of a matmul's output; ``reason``: why it stays unfused."""

    rs: torch.fx.Node
    wait: torch.fx.Node | None = None
    scatter_dim: int = 0
    reduce_op: str = "sum"
    layout: list[torch.fx.Node] = field(default_factory=list)  # split/slice .. cat
    matmul: Matmul | None = None
    reason: str | None = None


@dataclass
class AsyncTPPlan:
    """The TP group (None: ``group_reason`` says why) and every TP all-gather / reduce-scatter."""

    group_name: str | None
    group_reason: str | None
    all_gathers: list[AllGatherMatch]
    reduce_scatters: list[ReduceScatterMatch]


def _matmul_of(x: torch.fx.Node) -> Matmul | None:
    """``x`` as a matmul: ``mm(A, B)`` (2-D), or ``view(mm(view(A, [M, K]), B), [*A.shape[:-1], N])``
    whose ``mm`` only the outer view reads (``M = prod(A.shape[:-1])``); else None."""
    if is_call(x, _MM_OPS):
        return Matmul(x, x.args[0], x.args[1])
    if not is_call(x, RESHAPE_OPS) or not is_call(x.args[0], _MM_OPS) or len(x.args[0].users) != 1:
        return None
    mm, pre = x.args[0], x.args[0].args[0]
    a_shape = shape_of(pre.args[0]) if is_call(pre, RESHAPE_OPS) else None
    if a_shape is None or len(a_shape) < 2 or shape_of(pre) != (math.prod(a_shape[:-1]), a_shape[-1]):
        return None
    if shape_of(x) != (*a_shape[:-1], shape_of(mm)[1]):
        return None
    return Matmul(mm, pre.args[0], mm.args[1], pre=pre, post=x)


def _call_like(graph: torch.fx.Graph, target, args, like: torch.fx.Node, val: Any = None, key_from=None,
               kwargs=None) -> torch.fx.Node:
    """A new node ``target(*args, **kwargs)`` with ``like``'s metadata, ``val`` and ``key_from``'s numerics key."""
    new = graph.call_function(target, args, kwargs or {})
    new.meta["custom"] = dict(custom_meta(like))
    new.meta.update({k: like.meta[k] for k in ("stack_trace", "seq_nr") if k in like.meta})
    if val is not None:
        new.meta["val"] = val
    if key_from is not None and NUMERICS_KEY in key_from.meta:
        new.meta[NUMERICS_KEY] = key_from.meta[NUMERICS_KEY]
    return new


def _fake_call(fake_mode, op, args, kwargs=None) -> Any:
    """The fake value of ``op`` on its node arguments' fake values (None without a fake mode)."""
    if fake_mode is None:
        return None
    vals = torch.fx.node.map_arg((args, kwargs or {}), lambda a: a.meta.get("val"))
    with fake_mode:
        return op(*vals[0], **vals[1])


def _rebuild_layout(wait: torch.fx.Node, user: torch.fx.Node, shard: tuple[int, ...], g: int):
    """``(gathered tensor, gather dim, nodes)`` when ``user`` starts rebuilding the gathered tensor; else None."""
    found = None
    if user.op != "call_function":
        return None
    if user.target in _SPLITS and arg_of(user, 2, "dim", 0) == 0:  # split -> getitem 0..g-1 -> cat on d
        items = sorted(user.users, key=lambda u: u.args[1] if is_getitem(u) else -1)
        if len(items) == g and all(is_getitem(u) and u.args[1] == i and shape_of(u) == shard
                                   for i, u in enumerate(items)):
            cats = {only_user(u) for u in items}
            cat = cats.pop() if len(cats) == 1 else None
            if cat is not None and cat.target is aten.cat.default and list(cat.args[0]) == items:
                found = cat, arg_of(cat, 1, "dim", 0) % len(shard), [user, *items, cat]
    elif user.target is aten.slice.Tensor:  # slices of dim 0 (the narrow form) -> cat on d
        cat = only_user(user)
        parts = list(cat.args[0]) if cat is not None and cat.target is aten.cat.default else []
        if len(parts) == g and all(isinstance(p, torch.fx.Node) and p.target is aten.slice.Tensor and p.args[0] is wait
                                   and len(p.users) == 1 and arg_of(p, 1, "dim", 0) == 0
                                   and arg_of(p, 2, "start") == i * shard[0] for i, p in enumerate(parts)):
            found = cat, arg_of(cat, 1, "dim", 0) % len(shard), [*parts, cat]
    elif is_call(user, RESHAPE_OPS):  # one view moving the rank dimension into d (dimensions before d of size 1)
        out = shape_of(user)
        d = next((d for d in range(1, len(shard)) if out == shard[:d] + (shard[d] * g,) + shard[d + 1:]
                  and math.prod(shard[:d]) == 1), None)
        found = None if d is None else (user, d, [user])
    if found is None:
        return None
    res, d, nodes = found
    while (nxt := only_user(res)) is not None and _is_noop_of(nxt, res):
        res, nodes = nxt, [*nodes, nxt]
    return res, d, nodes


def _is_noop_of(node: torch.fx.Node, src: torch.fx.Node) -> bool:
    """``node`` returns ``src`` unchanged: a same-shape view / alias, or a full-range slice."""
    if not is_call(node, _NOOPS) or node.args[0] is not src or shape_of(node) != shape_of(src):
        return False
    return node.target is not aten.slice.Tensor or (arg_of(node, 2, "start") in (0, None)
                                                    and arg_of(node, 4, "step", 1) == 1)


def _consumer_matmuls(res: torch.fx.Node, user: torch.fx.Node) -> list[Matmul]:
    """The matmuls reading ``res`` as left operand through ``user`` (the mm, or a 2-D reshape)."""
    shape = shape_of(res)
    if shape is None:
        return []
    if is_call(user, _MM_OPS) and user.args[0] is res and len(shape) == 2:
        return [Matmul(user, res, user.args[1])]
    if not is_call(user, RESHAPE_OPS) or len(shape) < 2 or shape_of(user) != (math.prod(shape[:-1]), shape[-1]):
        return []
    out = []
    for mm in user.users:
        if not is_call(mm, _MM_OPS) or mm.args[0] is not user or mm.args[1] is user:
            continue
        n = (shape_of(mm) or (0, 0))[1]
        posts = [p for p in mm.users if is_call(p, RESHAPE_OPS) and shape_of(p) == (*shape[:-1], n)]
        out.append(Matmul(mm, res, mm.args[1], pre=user, post=posts[0] if posts else None))
    return out


def _ancestors_after(roots: list[Any], lo: int, order: dict[torch.fx.Node, int]) -> set[torch.fx.Node]:
    """``roots`` and the nodes they are computed from, transitively, placed after ``order`` ``lo``."""
    need, stack = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        cur = stack.pop()
        if cur in need or order[cur] <= lo:
            continue
        need.add(cur)
        stack.extend(cur.all_input_nodes)
    return need


def _match_all_gather(ag: torch.fx.Node, order: dict[torch.fx.Node, int]) -> AllGatherMatch:
    """``ag``'s layout and matmuls, or why it stays unfused. Either every reader of the wait rebuilds the gathered
    tensor (the all-gather's phase's layout is ``res``, SAC's are ``copies``) or none does (``res`` is the wait)."""
    m = AllGatherMatch(ag)
    wait = m.wait = sole_wait(ag)
    if wait is None:
        m.reason = "all-gather not followed by exactly one wait"
        return m
    shard, g = shape_of(ag.args[0]), arg_of(ag, 1, "group_size")
    if not shard or not isinstance(g, int):
        m.reason = "no shape metadata"
        return m
    m.res, m.gather_dim, m.layout = wait, 0, [wait]
    layouts, covered = [], set()
    for user in list(wait.users):
        if user in covered:
            continue
        if (found := _rebuild_layout(wait, user, shard, g)) is None:
            if layouts:
                m.reason = "the gathered buffer is also read outside its layout ops"
                return m
            break
        layouts.append(found)
        covered.update(found[2])
    if len({d for _, d, _ in layouts}) > 1:
        m.reason = "the gathered buffer is rebuilt in different layouts"
        return m
    if layouts:
        layouts.sort(key=lambda lay: (phase_of(lay[0]) != phase_of(ag), order[lay[0]]))
        (m.res, m.gather_dim, nodes), rest = layouts[0], layouts[1:]
        m.layout = [wait, *nodes]
        m.copies = [(res, nodes) for res, _, nodes in rest]
    if m.gather_dim == len(shard) - 1:
        m.reason = "gather on the last dimension"
    elif tensor_val(m.res) is None or not tensor_val(m.res).is_contiguous():
        m.reason = "gathered tensor without a contiguous fake value"
    if m.reason is not None:
        return m
    lo = order[m.res] - 1
    for user in list(m.res.users):
        for mm in _consumer_matmuls(m.res, user):
            if phase_of(mm.mm) != phase_of(ag):
                m.other_phase += 1
            elif getattr(tensor_val(mm.b), "ndim", 0) == 2 and m.res not in _ancestors_after([mm.b], lo, order):
                m.matmuls.append(mm)
    if not m.matmuls:
        m.reason = ("only matmuls of another phase (SAC recompute) read the gathered tensor" if m.other_phase
                    else "no matmul reads the gathered tensor as its left operand")
    return m


def _chunk_index(part: torch.fx.Node) -> int | None:
    """Which chunk ``part`` is: ``getitem`` i of the split, or the slice of chunk i."""
    if is_getitem(part):
        return part.args[1]
    if part.target is not aten.slice.Tensor or shape_of(part) is None:
        return None
    return (arg_of(part, 2, "start") or 0) // max(1, shape_of(part)[arg_of(part, 1, "dim", 0)])


def _chunks_view(x: torch.fx.Node, scatter_dim: int, group_size: int) -> int | None:
    """The dimension of ``S`` when ``x = view(t, [g, S / g, *rest])`` of ``t`` of shape ``[1, .., 1, S, *rest]`` is
    scattered on dim 0 into ``g = group_size`` chunks (the same chunks as scattering ``t`` there); else None."""
    if scatter_dim != 0 or not is_call(x, RESHAPE_OPS) or len(x.users) != 1 or len(x.args[0].users) != 1:
        return None
    inner, outer = shape_of(x.args[0]), shape_of(x)
    if inner is None or outer is None or len(outer) < 2 or outer[0] != group_size:
        return None
    d = next((i for i, size in enumerate(inner) if size != 1), None)
    if d is None or d == len(inner) - 1 or inner[d] != group_size * outer[1] or inner[d + 1:] != outer[2:]:
        return None
    return d


def _match_reduce_scatter(rs: torch.fx.Node, found: dict, order: dict[torch.fx.Node, int]) -> ReduceScatterMatch:
    """``rs`` as ``find_reduce_scatter_patterns`` matched it (``found``), checked, or why it stays unfused."""
    m = ReduceScatterMatch(rs)
    if len(rs.users) != 1 or rs not in found:
        m.reason = ("reduce-scatter not followed by exactly one wait" if len(rs.users) != 1
                    else "reduce-scatter input not recognised")
        return m
    t = found[rs]
    nodes = t.match.nodes if hasattr(t.match, "nodes") else t.match  # newer torch: a list for the slice form
    m.wait, m.reduce_op, m.scatter_dim, x = t.wait_tensor_node, str(t.reduce_op), t.scatter_dim, t.input_node
    m.layout = sorted((n for n in nodes if n is not rs and n is not m.wait), key=order.__getitem__)
    shape = shape_of(x)
    if shape is not None:
        m.scatter_dim %= len(shape)
    if m.layout and [_chunk_index(p) for p in m.layout[-1].args[0]] != list(range(arg_of(rs, 2, "group_size"))):
        m.reason = "reduce-scatter input not recognised (chunks out of rank order)"
    elif m.reduce_op not in ("sum", "avg"):
        m.reason = f"reduce op {m.reduce_op!r}"
    elif not all(u in m.layout or u is rs for u in x.users):
        m.reason = "the matmul output has other users"
    elif shape is None:
        m.reason = "no shape metadata"
    elif m.scatter_dim == len(shape) - 1:
        m.reason = "scatter on the last dimension"
    if m.reason is not None:
        return m
    if (outer := _chunks_view(x, m.scatter_dim, arg_of(rs, 2, "group_size"))) is not None:
        m.layout, x, m.scatter_dim = [x], x.args[0], outer  # the view remove_noop_views left of DTensor's cat
    m.matmul = _matmul_of(x)  # mm (2-D) or view(mm(view(A, [M, K]), B), [*A.shape[:-1], N])
    if m.matmul is None:
        m.reason = ("the reduce-scatter input is a sum of matmul outputs" if x.target is aten.add.Tensor
                    else "the reduce-scatter input is not a matmul output")
    return m


def find_async_tp_matches(gm: torch.fx.GraphModule, tp_group_name: str | None = None) -> AsyncTPPlan:
    """Every all-gather and reduce-scatter on the TP group with its match (module docstring). Reads only."""
    if tp_group_name is None:  # the one group of the all-gathers of activations
        groups = sorted({str(group_name_of(n)) for n in gm.graph.nodes
                         if collective_kind(n) == "all_gather_into_tensor" and shard_chain(n) is None})
        if len(groups) != 1:
            return AsyncTPPlan(None, f"all-gathers of activations on several groups {groups}: pass tp_group_name"
                               if groups else "no all-gather of activations (no TP with sequence parallel)", [], [])
        tp_group_name = groups[0]
    from torch._inductor.fx_passes.micro_pipeline_tp import find_reduce_scatter_patterns

    order = positions(gm.graph)
    found = {t.reduce_scatter_node: t for t in find_reduce_scatter_patterns(gm.graph)}
    plan = AsyncTPPlan(tp_group_name, None, [], [])
    for n in gm.graph.nodes:
        if str(group_name_of(n)) != tp_group_name:  # an all-gather or reduce-scatter of the TP group
            continue
        if collective_kind(n) == "all_gather_into_tensor":
            plan.all_gathers.append(_match_all_gather(n, order))
        else:
            plan.reduce_scatters.append(_match_reduce_scatter(n, found, order))
    return plan


def _contiguous(graph: torch.fx.Graph, node: torch.fx.Node, like: torch.fx.Node):
    """``(node, 0)``, or ``(contiguous clone, 1)`` when ``node`` is not contiguous (``like`` was)."""
    val = tensor_val(node)
    if val is None or val.is_contiguous():
        return node, 0
    contiguous = {"memory_format": torch.contiguous_format}
    with graph.inserting_after(node):
        clone = _call_like(graph, aten.clone.default, (node,), like, torch.empty_like(val, **contiguous), like,
                           contiguous)
    node.meta.pop(NUMERICS_KEY, None)
    return clone, 1


def _erase_unused(graph: torch.fx.Graph, nodes: list[torch.fx.Node | None]) -> None:
    for node in reversed(nodes):
        if node is not None and not getattr(node, "_erased", False) and not node.users:
            graph.erase_node(node)


def _fuse_all_gather(graph: torch.fx.Graph, m: AllGatherMatch, group_name: str, fake_mode) -> int:
    """Replace ``m`` by one ``fused_all_gather_matmul`` at the all-gather; returns the contiguous copies added."""
    op = torch.ops.symm_mem.fused_all_gather_matmul.default
    ag = m.ag
    order = positions(graph)
    for node in sorted(_ancestors_after([mm.b for mm in m.matmuls], order[ag], order), key=order.__getitem__):
        ag.prepend(node)
    args = (ag.args[0], [mm.b for mm in m.matmuls], m.gather_dim, group_name)
    kwargs = {"return_A": True}
    with graph.inserting_before(ag):
        fused = _call_like(graph, op, args, ag, _fake_call(fake_mode, op, args, kwargs), kwargs=kwargs)
        fv = fused.meta.get("val")  # (A, [products]) or None
        a_node = _call_like(graph, operator.getitem, (fused, 0), m.res, fv and fv[0], key_from=m.res)
        outs = _call_like(graph, operator.getitem, (fused, 1), ag, fv and fv[1])
        items = [_call_like(graph, operator.getitem, (outs, i), mm.post or mm.mm, fv and fv[1][i], mm.post or mm.mm)
                 for i, mm in enumerate(m.matmuls)]
    copies = 0
    for mm, item in zip(m.matmuls, items):
        if mm.pre is not None and mm.post is None and not mm.mm.users:  # a dead matmul
            continue
        out, n = _contiguous(graph, item, mm.post or mm.mm)
        copies += n
        if mm.post is not None or mm.pre is None:  # the product in the traced shape
            (mm.post or mm.mm).replace_all_uses_with(out)
            _erase_unused(graph, [mm.post])
        if mm.pre is not None and mm.mm.users:  # the 2-D product of a 3-D A: a view of it
            view = (out, list(shape_of(mm.mm)))
            with graph.inserting_after(out):
                flat = _call_like(graph, aten.view.default, view, mm.mm,
                                  _fake_call(fake_mode, aten.view.default, view), mm.mm)
            mm.mm.replace_all_uses_with(flat)
    _erase_unused(graph, [x for mm in m.matmuls for x in (mm.pre, mm.mm, mm.post)])
    readers = [m.res, *(res for res, _ in m.copies)]
    if any(r.users for r in readers):  # A is read elsewhere (saved for the weight gradient)
        a_out, n = _contiguous(graph, a_node, m.res)
        copies += n
        for r in readers:  # SAC's recomputed layout copies read the same values
            r.replace_all_uses_with(a_out)
    else:
        graph.erase_node(a_node)
        fused.kwargs = {"return_A": False}  # as Inductor: do not return A when nothing reads it
        fused.meta["val"] = _fake_call(fake_mode, op, fused.args, fused.kwargs)
        if fused.meta["val"] is not None:
            outs.meta["val"] = fused.meta["val"][1]
    _erase_unused(graph, [ag, m.wait, *(n for _, nodes in m.copies for n in nodes), *m.layout[1:]])
    return copies


def _fuse_reduce_scatter(graph: torch.fx.Graph, m: ReduceScatterMatch, group_name: str, fake_mode) -> None:
    op = torch.ops.symm_mem.fused_matmul_reduce_scatter.default
    mm = m.matmul
    args = (mm.a, mm.b, m.reduce_op, m.scatter_dim, group_name)
    with graph.inserting_before(m.rs):
        fused = _call_like(graph, op, args, m.wait, _fake_call(fake_mode, op, args), key_from=m.wait)
    m.wait.replace_all_uses_with(fused)
    _erase_unused(graph, [mm.pre, mm.mm, mm.post, *m.layout, m.rs, m.wait])


def _workspace_bytes(ags: list[AllGatherMatch], rss: list[ReduceScatterMatch], group_size: int) -> int:
    """Symmetric-memory workspace bytes the matched ops need (largest shard or two chunks of a matmul output)."""
    need = [v.numel() * v.element_size() for m in ags if (v := tensor_val(m.ag.args[0])) is not None]
    need += [2 * (v.numel() // group_size) * v.element_size() for m in rss
             if (v := tensor_val(m.rs.args[0])) is not None]  # the matmul output, rearranged
    return max(need + [1])


def enable_symmetric_memory(group_name: str, workspace_bytes: int) -> tuple[bool, str]:
    """Enable symmetric memory for the TP group ``group_name`` with ``workspace_bytes`` of workspace (a rendezvous:
    every TP rank calls it). Returns ``(ok, note)``: whether it is usable, and whether multicast is or why not."""
    if not dist.is_available() or not dist.is_nccl_available():
        return False, "NCCL is not available"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        with warnings.catch_warnings():  # deprecated (no longer needed) in newer torch
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        symm_mem.get_symm_mem_workspace(group_name, min_size=workspace_bytes)
    except Exception as e:  # no P2P access, driver API, allocation ...
        return False, f"symmetric memory unavailable for the TP group ({type(e).__name__}: {str(e)[:200]})"
    try:
        multicast = _SymmetricMemory.has_multicast_support(DeviceType.CUDA, torch.cuda.current_device())
    except Exception:
        return True, "multicast support unknown"
    return True, "multicast on" if multicast else "multicast off: P2P copy-engine path"


def _setup_symmetric_memory(group_name: str, workspace_bytes: int) -> None:
    """The pass's process setup: :func:`enable_symmetric_memory`. Raises RuntimeError where it is unusable."""
    ok, note = enable_symmetric_memory(group_name, workspace_bytes)
    if not ok:
        raise RuntimeError(note)


def async_tp_pass(gm: torch.fx.GraphModule, example_inputs=None, *, tp_group_name: str | None = None, fuse: str = "all",
                  rewrite: bool | None = None) -> torch.fx.GraphModule:
    """Fuse the TP all-gather -> matmul and matmul -> reduce-scatter pairs of ``gm`` into
    ``symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` (module docstring).

    ``tp_group_name``: the TP group (None: inferred); ``fuse``: one of :data:`FUSE_CHOICES`; ``rewrite``: None: on a
    fake group, or on CUDA with symmetric memory (enabled here); True: always; False: count only. Stats:
    ``all_gather_fused`` / ``_left``, ``matmuls_fused``, ``reduce_scatter_fused`` / ``_left``, ``restrided`` (contiguous
    copies), ``rewritten``. Raises ``ValueError`` for ``fuse`` not in :data:`FUSE_CHOICES`."""
    if fuse not in FUSE_CHOICES:
        raise ValueError(f"fuse must be one of {', '.join(FUSE_CHOICES)}; got {fuse!r}")
    plan = find_async_tp_matches(gm, tp_group_name)
    group = plan.group_name
    if group is None:
        set_pass_summary(gm, f"skipped: {plan.group_reason}", rewritten=0)
        return gm
    fusible_ags = [m for m in plan.all_gathers if m.reason is None]
    ags = fusible_ags if fuse != "matmul_reduce_scatter" else []
    in_ag = {mm.mm for m in ags for mm in m.matmuls}
    for m in plan.reduce_scatters:  # as Inductor: a matmul between a gather and a scatter goes with the gather
        if m.reason is None and m.matmul.mm in in_ag and fuse != "all_gather_matmul":
            m.reason = "its matmul is fused with the all-gather of its input"
    fusible_rss = [m for m in plan.reduce_scatters if m.reason is None]
    rss = fusible_rss if fuse != "all_gather_matmul" else []
    stats = dict(all_gather_fused=len(ags), all_gather_left=len(plan.all_gathers) - len(ags),
                 matmuls_fused=sum(len(m.matmuls) for m in ags), reduce_scatter_fused=len(rss),
                 reduce_scatter_left=len(plan.reduce_scatters) - len(rss), restrided=0, rewritten=0)
    what = (f"{len(ags)} all-gather->matmul ({stats['matmuls_fused']} matmuls) and {len(rss)} "
            f"matmul->reduce-scatter on TP group {group!r}")
    left = _left_text(plan, ags, rss)
    skip, note = None, ""
    if not ags and not rss:
        skip = f"nothing to fuse on TP group {group!r}{left}"
    elif rewrite is None:
        device = tensor_val(ags[0].ag.args[0] if ags else rss[0].rs.args[0])
        device = device.device.type if device is not None else "unknown"
        try:
            backend = str(dist.get_backend(dist.distributed_c10d._resolve_process_group(group)))
        except Exception:
            backend = None
        if backend == "fake":
            note = "; fake process group: rewritten for the dry run, symmetric memory not set up"
        elif backend == FAKE_COLLECTIVES:  # one process, no peers: no symmetric memory to set up
            skip = f"skipped: fake collectives (no TP peers for symmetric memory); would fuse {what}{left}"
        elif device != "cuda":
            skip = f"skipped: device {device} (the symm_mem fused ops are CUDA-only); would fuse {what}{left}"
        else:
            group_size = arg_of(ags[0].ag, 1, "group_size") if ags else arg_of(rss[0].rs, 2, "group_size")
            workspace = _workspace_bytes(fusible_ags, fusible_rss, group_size)
            ok, note = enable_symmetric_memory(group, workspace)
            skip = None if ok else f"skipped: {note}; would fuse {what}{left}"
            note = f"; symmetric memory enabled, {note}"
            if ok:  # a run that loads this graph from the graph cache runs no pass: it calls this
                add_process_setup(gm, functools.partial(_setup_symmetric_memory, group, workspace))
    elif not rewrite:
        skip = f"counted only: would fuse {what}{left}"
    if skip is not None:
        set_pass_summary(gm, skip, **stats)
        return gm

    import torch.distributed._symmetric_memory  # noqa: F401  defines torch.ops.symm_mem's fused ops

    fake_mode = detect_graph_fake_mode(gm, example_inputs)
    for m in ags:
        stats["restrided"] += _fuse_all_gather(gm.graph, m, group, fake_mode)
    for m in rss:
        _fuse_reduce_scatter(gm.graph, m, group, fake_mode)
    gm.graph.lint()
    gm.recompile()
    stats["rewritten"] = 1
    copies = f", {stats['restrided']} contiguous copies" if stats["restrided"] else ""
    set_pass_summary(gm, f"fused {what}{copies}{left}{note}", **stats)
    return gm


def _left_text(plan: AsyncTPPlan, ags: list[AllGatherMatch], rss: list[ReduceScatterMatch]) -> str:
    """``"; left 1 all-gather (1: <reason>), 65 reduce-scatters (...)"``, or ``""``."""
    parts = []
    for label, ms, fused in (("all-gather", plan.all_gathers, ags), ("reduce-scatter", plan.reduce_scatters, rss)):
        reasons = Counter(m.reason or "not selected (--compile.async_tp.fuse)" for m in ms if m not in fused)
        if reasons:
            n = sum(reasons.values())
            detail = "; ".join(f"{v}: {k}" for k, v in reasons.items())
            parts.append(f"{n} {label}{'s' if n > 1 else ''} ({detail})")
    return f"; left {', '.join(parts)}" if parts else ""


@dataclass
class AsyncTPOptions:
    """``[compile.async_tp]``: options of ``async_tp`` (on by default on CUDA, elsewhere
    ``--compile.passes async_tp``; off: ``--compile.disable_passes async_tp``)."""

    fuse: Literal["all", "all_gather_matmul", "matmul_reduce_scatter"] = "all"
    """Which TP pairs the async_tp pass replaces with torch's symmetric-memory ops: all (both),
    all_gather_matmul (symm_mem.fused_all_gather_matmul) or matmul_reduce_scatter
    (symm_mem.fused_matmul_reduce_scatter). CUDA only (the pass skips elsewhere). The fused
    matmuls run in per-rank row chunks; at TP degree 2 the step stayed bitwise equal to the unfused one."""


PASS = GraphPass(name="async_tp", fn=async_tp_pass, options=AsyncTPOptions, aliases=("micro_pipeline_tp",),
                 enabled=lambda ctx: ctx.device_type == "cuda",
                 kwargs=lambda options, ctx: {"fuse": options.fuse, "tp_group_name": ctx.tp_group_name})
