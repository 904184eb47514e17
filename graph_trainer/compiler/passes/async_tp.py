"""Async TP: fuse TP's all-gather -> matmul and matmul -> reduce-scatter pairs into
torch's micro-pipelined symmetric-memory ops.

Matches, on the TP process group only (sequence parallel, torchtitan's Llama3 plan as
traced by :func:`graph_trainer.distributed.parallelize.distribute_for_trace`):

* **all-gather -> matmul**: ``_c10d_functional.all_gather_into_tensor(shard, g, tp)``, its
  ``wait_tensor`` and the layout ops that turn the rank-major result into the gathered
  tensor ``A`` (gather dimension ``d``): nothing (``d = 0``); ``split`` on dim 0 into the
  ``g`` rank chunks -> ``getitem`` s -> ``cat`` on ``d`` (or ``slice`` s -> ``cat``: the
  unbacked-shape form); or one ``view`` that moves the rank dimension into ``d`` when
  every dimension before ``d`` has size 1 (funcol's view shortcut: Llama3 at batch 1);
  then any no-op op that alone reads it (the full-range ``slice`` with which DTensor trims
  an uneven shard's padding, same-shape views). When ``sac_recompute`` copied these layout
  ops into the backward, the copies are recognised too and read the fused op's ``A``.
  Then every ``aten.mm`` that reads ``A`` as its *left* operand, directly (2-D ``A``) or
  through ``view`` / ``reshape`` to ``[prod(A.shape[:-1]), K]`` and, optionally, back to
  ``[*A.shape[:-1], N]`` (how make_fx records ``nn.Linear`` on 3-D input), in the same
  phase as the all-gather. These become one
  ``symm_mem.fused_all_gather_matmul(shard, [B_0, B_1 ...], d, tp)`` (the q/k/v or
  w1/w3 projections share one all-gather), whose ``getitem`` s replace ``A`` and each
  matmul's result. ``return_A=False`` when nothing else reads ``A``; in a training step
  the gathered activation is saved for the weight gradient, so ``A`` is returned.
* **matmul -> reduce-scatter**: ``_c10d_functional.reduce_scatter_tensor(X, "sum" | "avg",
  g, tp)`` and its wait as Inductor's ``micro_pipeline_tp.find_reduce_scatter_patterns``
  finds them (reused here): ``X`` directly, or through funcol's ``split`` on dimension
  ``d`` -> ``getitem`` s -> ``cat`` on 0 (its scatter on ``d``; newer torch also finds
  the ``slice`` form), the ``g`` chunks in rank order (checked here: Inductor's pattern
  takes any number in any order). ``X`` must be the output of an ``aten.mm`` (2-D,
  ``d = 0``) or of ``view(mm(view(A, [M, K]), B), [*A.shape[:-1], N])`` that nothing
  else reads. It becomes ``symm_mem.fused_matmul_reduce_scatter(A, B, op, d, tp)``, which
  replaces the wait.

Why not Inductor's ``torch._inductor.fx_passes.micro_pipeline_tp.micro_pipeline_tp_pass``
itself (``tests/passes/test_async_tp.py::test_inductor_micro_pipeline_tp_*`` run it on the
traced graphs): it is written for Inductor's post-grad graph and finds its matmuls
(``_find_consumer_matmuls``, ``_find_producer_matmul``) through ``aten.reshape`` ->
``mm`` -> ``aten.reshape``, while make_fx records ``view`` / ``_unsafe_view``, so on this
graph it fuses nothing. With those retargeted to ``reshape`` it still misses every
all-gather whose result is rebuilt by one ``view`` (batch 1, the Llama3 8B setting) and,
under op-level SAC, the all-gathers whose layout ops SAC copied into the backward (its
``find_all_gather_patterns`` then takes the rank-major buffer for a gather on dimension
0); it fuses matmuls of another phase, leaves its new nodes without fake values, and
rewrites only where NCCL and symmetric memory are set up, never on the dry run's fake
group. So the all-gather layouts and the matmuls are matched here, and only its
reduce-scatter finder is reused.

As Inductor: a matmul whose right operand depends on ``A`` is left out; the fused op is
inserted at the all-gather (the nodes the right operands need that come later are moved
up) or at the reduce-scatter. Left as they are (counted, with the reason, in the
summary): gathers / scatters on the last dimension (Inductor's extra last-dim paths: not
in the Llama3 plan); all-gathers no matmul reads as its left operand (the embedding's
backward); reduce-scatters of anything but one matmul's output -- in the backward the
TP input gradient of q/k/v and of w1/w3 is the *sum* of two or three matmuls, which a
fused op cannot take without changing the summation. Matmuls of another phase that read
``A`` -- SAC's recomputed projections in the backward (``sac_recompute`` runs first) --
stay plain matmuls reading the returned ``A``: fusing them would compute them in the
forward and keep them alive until the backward.

The TP group: the option ``tp_group_name``, else the one group of the all-gathers of
activations, i.e. all-gathers whose input is not a parameter shard
(:func:`~graph_trainer.compiler.common.shard_chain`): FSDP's parameter all-gathers (and
its gradient reduce-scatters) are on ``dp_shard`` and never match; several candidate
groups: the pass skips. Only pairs on that group are matched.

When it rewrites (``rewrite=None``, the default):

* on a fake process group (the ``COMM_MODE=fake_backend`` dry run): always, so the dry
  run's graph, per-pass table and memory estimate carry the fused ops. The ops have Meta
  kernels (``torch/distributed/_symmetric_memory``: the reference all-gather / matmul /
  reduce-scatter), so the fake values are exact; symmetric memory is not touched.
* on real ranks: only on CUDA with symmetric memory usable. The pass enables it for the TP
  group (``enable_symm_mem_for_group``; a no-op, deprecated, where torch no longer needs
  it) and allocates the group's symmetric workspace at the largest size the matched ops
  need (a rendezvous of the TP ranks, which all run the pipeline; later growth would be
  impossible under CUDA graph capture). It skips -- graph unchanged, the summary saying
  why and counting what it would fuse -- without a TP group, on a non-CUDA device (the
  ops have CUDA and Meta kernels only: on gloo / CPU every run stays bitwise the run
  without the pass), without NCCL, or when the workspace cannot be set up.
  ``rewrite=True`` rewrites regardless (tests); ``False`` only counts.

NVLink multicast off (``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1``): both fused ops still run. ``TORCH_SYMM_MEM_DISABLE_MULTICAST``
makes ``_SymmetricMemory.has_multicast_support`` false
(``c10d::symmetric_memory::device_has_multicast_support``), which only deselects
``fused_all_gather_matmul``'s multimem path (taken for ``return_A=False`` and at most
2048 gathered rows); the path used here copies the peers' shards with copy-engine P2P
copies between symmetric-memory barriers (signal pads, no multicast), and
``fused_matmul_reduce_scatter`` always produces chunks and exchanges them by P2P copies.
The summary says whether multicast is available.

Numerics: the same products, computed in chunks of ``M / g`` rows (one per rank's
shard) -- bitwise equal to the unfused matmul where cuBLAS picks the same kernel for the
chunk as for the whole ``M`` rows, which is not guaranteed; the fused reduce-scatter
sums the ``g`` partial products with ``torch.sum`` instead of NCCL (for ``g = 2`` one
rounding of ``a + b`` either way). torch's own tests of these ops compare with
``allclose``, not bitwise: compare runs with ``loss_compare --rtol``. A gather on a
dimension ``d > 0`` whose leading dimensions are not all 1 (batch > 1) gives the ops'
outputs a permuted layout; each output the graph reads is then copied to the contiguous
layout the traced graph expects (``clone``; the ``restrided`` stat), so later ``view`` s
stay valid.

Where it runs in :data:`~graph_trainer.compiler.passes.ORDER`: after
``sac_recompute`` (it must see which projections the backward recomputes, and the
recomputed copies must read the returned ``A``) and ``reshard_after_forward`` (which only
touches FSDP parameter all-gathers); before ``overlap_collectives`` /
``bucket_collectives`` (they schedule the remaining functional collectives; a fused op
has no wait and overlaps inside itself, and ``overlap_collectives`` hoists it like any
non-all-gather collective, to just after its inputs) and before the annotation and
Inductor passes: the fused ops are collectives
(:data:`~graph_trainer.compiler.common.COLLECTIVE_NAMESPACES`), so no annotation pass puts
them into a ``regional_inductor`` region (it compiles tagged nodes only); ``full_inductor``
lowers them as fallback kernels with fixed input strides (their
``needs_fixed_stride_order`` tag), as for Inductor's own ``micro_pipeline_tp``.
"""

from __future__ import annotations

import contextlib
import math
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx

from graph_trainer import NUMERICS_KEY
from graph_trainer.compiler.common import (
    RESHAPE_OPS,
    collective_kind,
    custom_meta,
    detect_graph_fake_mode,
    is_getitem,
    is_wait,
    phase_of,
    set_pass_summary,
    shard_chain,
)
from graph_trainer.compiler.registry import GraphPass

aten = torch.ops.aten

#: Values of the ``fuse`` option (``--compile.async_tp.fuse``): both kinds of pair, or one.
FUSE_CHOICES = ("all", "all_gather_matmul", "matmul_reduce_scatter")

_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default})


# --------------------------------------------------------------------------- matching


@dataclass
class Matmul:
    """One ``aten.mm`` of a matched pair: ``mm(pre(A), B)`` (``pre``: the reshape of ``A``
    to 2-D, None when ``A`` is 2-D), ``post`` the reshape of the product back to
    ``[*A.shape[:-1], N]`` (None: the 2-D product is read directly)."""

    mm: torch.fx.Node
    a: torch.fx.Node
    b: torch.fx.Node
    pre: torch.fx.Node | None = None
    post: torch.fx.Node | None = None


@dataclass
class AllGatherMatch:
    """A TP all-gather and the matmuls that read its result ``res`` (the gathered tensor)
    as left operand. ``reason``: why it is left unfused (None: fusible)."""

    ag: torch.fx.Node
    wait: torch.fx.Node | None = None
    res: torch.fx.Node | None = None
    gather_dim: int = 0
    layout: list[torch.fx.Node] = field(default_factory=list)  # wait .. res (the layout ops)
    copies: list[tuple[torch.fx.Node, list[torch.fx.Node]]] = field(default_factory=list)  # recomputed layouts
    matmuls: list[Matmul] = field(default_factory=list)
    other_phase: int = 0  # matmuls reading A in another phase, left unfused
    reason: str | None = None


@dataclass
class ReduceScatterMatch:
    """A TP reduce-scatter of a matmul's output. ``reason``: why it is left unfused."""

    rs: torch.fx.Node
    wait: torch.fx.Node | None = None
    scatter_dim: int = 0
    reduce_op: str = "sum"
    layout: list[torch.fx.Node] = field(default_factory=list)  # split/slice .. cat
    matmul: Matmul | None = None
    reason: str | None = None


@dataclass
class AsyncTPPlan:
    """What :func:`find_async_tp_matches` found: the TP group (None: none / ambiguous,
    ``group_reason`` says which), every TP all-gather and reduce-scatter with its match."""

    group_name: str | None
    group_reason: str | None
    all_gathers: list[AllGatherMatch]
    reduce_scatters: list[ReduceScatterMatch]

    @property
    def fusible_all_gathers(self) -> list[AllGatherMatch]:
        return [m for m in self.all_gathers if m.reason is None]

    @property
    def fusible_reduce_scatters(self) -> list[ReduceScatterMatch]:
        return [m for m in self.reduce_scatters if m.reason is None]


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    val = _val(node)
    return tuple(val.shape) if val is not None else None


def _group_name(node: torch.fx.Node) -> str | None:
    """Group name of a functional all-gather / reduce-scatter (last positional argument)."""
    kind = collective_kind(node)
    if kind == "all_gather_into_tensor":
        return _arg(node, 2, "group_name")
    if kind == "reduce_scatter_tensor":
        return _arg(node, 3, "group_name")
    return None


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_reshape(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in RESHAPE_OPS


def _is_mm(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.mm.default


def infer_tp_group(gm: torch.fx.GraphModule) -> tuple[str | None, str | None]:
    """``(group name, None)`` of the TP group of ``gm``: the group of the all-gathers of
    activations (functional all-gathers whose input is not a parameter shard:
    :func:`~graph_trainer.compiler.common.shard_chain` is None); ``(None, reason)`` when
    there is none or more than one."""
    groups = sorted({
        str(_group_name(n)) for n in gm.graph.nodes
        if collective_kind(n) == "all_gather_into_tensor" and shard_chain(n) is None
    })
    if not groups:
        return None, "no all-gather of activations (no TP with sequence parallel)"
    if len(groups) > 1:
        return None, f"all-gathers of activations on several groups {groups}: pass tp_group_name"
    return groups[0], None


def _is_noop_layout(node: torch.fx.Node, src: torch.fx.Node) -> bool:
    """Whether ``node`` returns ``src`` unchanged: a same-shape ``view`` / ``reshape`` or
    ``alias``, or a ``slice`` over the whole dimension (DTensor's trim of an uneven shard's
    padding, a no-op for even shards)."""
    if node.op != "call_function" or not node.args or node.args[0] is not src or _shape(node) != _shape(src):
        return False
    if node.target is aten.slice.Tensor:
        return _arg(node, 2, "start", 0) in (0, None) and _arg(node, 4, "step", 1) == 1
    return node.target in RESHAPE_OPS or node.target is aten.alias.default


def _one_layout(wait: torch.fx.Node, user: torch.fx.Node, shard: tuple[int, ...], g: int):
    """:func:`_rebuild_layout` followed by the no-op ops (:func:`_is_noop_layout`) that are
    the gathered tensor's only reader."""
    found = _rebuild_layout(wait, user, shard, g)
    if found is not None:
        res, d, nodes = found
        while (nxt := _only_user(res)) is not None and _is_noop_layout(nxt, res):
            res, nodes = nxt, [*nodes, nxt]
        found = res, d, nodes
    return found


def _rebuild_layout(wait: torch.fx.Node, user: torch.fx.Node, shard: tuple[int, ...], g: int):
    """``(gathered tensor, gather dim, nodes)`` when ``user`` of ``wait`` starts one of the
    layouts that rebuild the gathered tensor from the rank-major buffer, else None."""
    if user.op != "call_function":
        return None
    # split on dim 0 into the g rank chunks -> getitem 0..g-1 -> cat on d
    if user.target in _SPLITS and _arg(user, 2, "dim", 0) == 0:
        items = sorted(user.users, key=lambda u: u.args[1] if is_getitem(u) else -1)
        if len(items) == g and all(is_getitem(u) and u.args[1] == i and _shape(u) == shard for i, u in enumerate(items)):
            cats = {_only_user(u) for u in items}
            cat = cats.pop() if len(cats) == 1 else None
            if cat is not None and cat.target is aten.cat.default and list(cat.args[0]) == items:
                return cat, _arg(cat, 1, "dim", 0) % len(shard), [user, *items, cat]
        return None
    # slice on dim 0 (the narrow form) -> cat on d
    if user.target is aten.slice.Tensor:
        cat = _only_user(user)
        parts = list(cat.args[0]) if cat is not None and cat.target is aten.cat.default else []
        if len(parts) == g and all(
            isinstance(p, torch.fx.Node) and p.target is aten.slice.Tensor and p.args[0] is wait
            and len(p.users) == 1 and _arg(p, 1, "dim", 0) == 0 and _arg(p, 2, "start") == i * shard[0]
            for i, p in enumerate(parts)
        ):
            return cat, _arg(cat, 1, "dim", 0) % len(shard), [*parts, cat]
        return None
    # one view moving the rank dimension into d (all dimensions before d of size 1)
    if _is_reshape(user):
        out = _shape(user)
        for d in range(1, len(shard)):
            if out == shard[:d] + (shard[d] * g,) + shard[d + 1:] and math.prod(shard[:d]) == 1:
                return user, d, [user]
    return None


def _gather_layout(ag: torch.fx.Node, m: AllGatherMatch) -> None:
    """Fill ``m.wait``, ``m.res``, ``m.gather_dim``, ``m.layout``, ``m.copies`` (or ``m.reason``).

    The wait's users either all rebuild the gathered tensor (a layout per user; several
    when ``sac_recompute`` copied the layout into the backward: the one of the
    all-gather's phase is ``res``, the others are ``copies``), or read the buffer itself
    (gather on dim 0: ``res`` is the wait)."""
    waits = [u for u in ag.users if is_wait(u)]
    if len(waits) != 1 or len(ag.users) != 1:
        m.reason = "all-gather not followed by exactly one wait"
        return
    wait = m.wait = waits[0]
    shard, g = _shape(ag.args[0]), _arg(ag, 1, "group_size")
    if shard is None or not isinstance(g, int) or not shard:
        m.reason = "no shape metadata"
        return
    m.res, m.gather_dim, m.layout = wait, 0, [wait]
    layouts, covered = [], set()
    for user in list(wait.users):
        if user in covered:
            continue
        found = _one_layout(wait, user, shard, g)
        if found is None:
            if layouts:
                m.reason = "the gathered buffer is also read outside its layout ops"
            return
        layouts.append(found)
        covered.update(found[2])
    if not layouts:  # gather on dim 0: the buffer itself (behind no-op ops read only there)
        while (nxt := _only_user(m.res)) is not None and _is_noop_layout(nxt, m.res):
            m.res, m.layout = nxt, [*m.layout, nxt]
        return
    if len({d for _, d, _ in layouts}) != 1:
        m.reason = "the gathered buffer is rebuilt in different layouts"
        return
    order = {n: i for i, n in enumerate(ag.graph.nodes)}
    layouts.sort(key=lambda lay: (phase_of(lay[0]) != phase_of(ag), order[lay[0]]))
    (m.res, m.gather_dim, nodes), rest = layouts[0], layouts[1:]
    m.layout = [wait, *nodes]
    m.copies = [(res, nodes) for res, _, nodes in rest]


def _consumer_matmul(res: torch.fx.Node, user: torch.fx.Node) -> list[Matmul]:
    """The matmuls reading ``res`` as left operand through ``user`` (``user`` is the mm,
    or a reshape of ``res`` to 2-D feeding mms)."""
    shape = _shape(res)
    if shape is None:
        return []
    if _is_mm(user) and user.args[0] is res and len(shape) == 2:
        return [Matmul(user, res, user.args[1])]
    if not _is_reshape(user) or len(shape) < 2 or _shape(user) != (math.prod(shape[:-1]), shape[-1]):
        return []
    out = []
    for mm in user.users:
        if not _is_mm(mm) or mm.args[0] is not user or mm.args[1] is user:
            continue
        n = (_shape(mm) or (0, 0))[1]
        posts = [p for p in mm.users if _is_reshape(p) and _shape(p) == (*shape[:-1], n)]
        out.append(Matmul(mm, res, mm.args[1], pre=user, post=posts[0] if posts else None))
    return out


def _depends_on(node: Any, target: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
    """Whether ``node`` is ``target`` or computed from it (walks only nodes after ``target``)."""
    if not isinstance(node, torch.fx.Node):
        return False
    stack, seen, lo = [node], set(), order[target]
    while stack:
        cur = stack.pop()
        if cur is target:
            return True
        if cur in seen or order.get(cur, -1) <= lo:
            continue
        seen.add(cur)
        stack.extend(cur.all_input_nodes)
    return False


def _match_all_gather(ag: torch.fx.Node, order: dict[torch.fx.Node, int]) -> AllGatherMatch:
    m = AllGatherMatch(ag)
    _gather_layout(ag, m)
    if m.reason is not None:
        return m
    shard = _shape(ag.args[0])
    if m.gather_dim == len(shard) - 1:
        m.reason = "gather on the last dimension"
        return m
    if _val(m.res) is None or not _val(m.res).is_contiguous():
        m.reason = "gathered tensor without a contiguous fake value"
        return m
    phase = phase_of(ag)
    for user in list(m.res.users):
        for mm in _consumer_matmul(m.res, user):
            if phase_of(mm.mm) != phase:
                m.other_phase += 1
            elif not _depends_on(mm.b, m.res, order) and _val(mm.b) is not None and _val(mm.b).dim() == 2:
                m.matmuls.append(mm)
    if not m.matmuls:
        m.reason = ("only matmuls of another phase (SAC recompute) read the gathered tensor" if m.other_phase
                    else "no matmul reads the gathered tensor as its left operand")
    return m


def _chunk_index(part: torch.fx.Node) -> int | None:
    """Which chunk ``part`` is: ``getitem`` i of the split, or the slice of chunk i."""
    if is_getitem(part):
        return part.args[1]
    if part.target is not aten.slice.Tensor or _shape(part) is None:
        return None
    return (_arg(part, 2, "start") or 0) // max(1, _shape(part)[_arg(part, 1, "dim", 0)])


def _match_reduce_scatter(rs: torch.fx.Node, found: dict, order: dict[torch.fx.Node, int]) -> ReduceScatterMatch:
    """``rs`` as Inductor's ``find_reduce_scatter_patterns`` matched it (``found``: its matches
    by reduce-scatter), checked and with its producer matmul."""
    m = ReduceScatterMatch(rs)
    if len(rs.users) != 1 or rs not in found:
        m.reason = ("reduce-scatter not followed by exactly one wait" if len(rs.users) != 1
                    else "reduce-scatter input not recognised")
        return m
    t = found[rs]
    nodes = t.match.nodes if hasattr(t.match, "nodes") else t.match  # newer torch: a list for the slice form
    m.wait, m.reduce_op, m.scatter_dim, x = t.wait_tensor_node, str(t.reduce_op), t.scatter_dim, t.input_node
    m.layout = sorted((n for n in nodes if n is not rs and n is not m.wait), key=order.__getitem__)
    if m.layout and [_chunk_index(p) for p in m.layout[-1].args[0]] != list(range(_arg(rs, 2, "group_size"))):
        m.reason = "reduce-scatter input not recognised (chunks out of rank order)"
        return m
    if m.reduce_op not in ("sum", "avg"):
        m.reason = f"reduce op {m.reduce_op!r}"
        return m
    if not all(u in m.layout or u is rs for u in x.users):
        m.reason = "the matmul output has other users"
        return m
    shape = _shape(x)
    if shape is None:
        m.reason = "no shape metadata"
        return m
    m.scatter_dim %= len(shape)
    if m.scatter_dim == len(shape) - 1:
        m.reason = "scatter on the last dimension"
        return m
    # the producer: mm (2-D) or view(mm(view(A, [M, K]), B), [*A.shape[:-1], N])
    if _is_mm(x):
        m.matmul = Matmul(x, x.args[0], x.args[1])
    elif _is_reshape(x) and _is_mm(x.args[0]) and len(x.args[0].users) == 1:
        mm, pre = x.args[0], x.args[0].args[0]
        a = pre.args[0] if _is_reshape(pre) else None
        a_shape = _shape(a)
        if a_shape is not None and len(a_shape) >= 2 and _shape(pre) == (math.prod(a_shape[:-1]), a_shape[-1]) \
                and shape == (*a_shape[:-1], _shape(mm)[1]):
            m.matmul = Matmul(mm, a, mm.args[1], pre=pre, post=x)
    if m.matmul is None:
        m.reason = ("the reduce-scatter input is a sum of matmul outputs" if x.target is aten.add.Tensor
                    else "the reduce-scatter input is not a matmul output")
    return m


def find_async_tp_matches(gm: torch.fx.GraphModule, tp_group_name: str | None = None) -> AsyncTPPlan:
    """Every all-gather and reduce-scatter of ``gm`` on the TP group with its match (see
    the module docstring); ``tp_group_name`` None: :func:`infer_tp_group`. Reads only."""
    reason = None
    if tp_group_name is None:
        tp_group_name, reason = infer_tp_group(gm)
    if tp_group_name is None:
        return AsyncTPPlan(None, reason, [], [])
    from torch._inductor.fx_passes.micro_pipeline_tp import find_reduce_scatter_patterns

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = {t.reduce_scatter_node: t for t in find_reduce_scatter_patterns(gm.graph)}
    ags, rss = [], []
    for n in gm.graph.nodes:
        kind = collective_kind(n)
        if kind not in ("all_gather_into_tensor", "reduce_scatter_tensor") or str(_group_name(n)) != tp_group_name:
            continue
        if kind == "all_gather_into_tensor":
            ags.append(_match_all_gather(n, order))
        else:
            rss.append(_match_reduce_scatter(n, found, order))
    return AsyncTPPlan(tp_group_name, None, ags, rss)


# --------------------------------------------------------------------------- rewriting


def _set_meta(new: torch.fx.Node, like: torch.fx.Node, val: Any = None, key_from: torch.fx.Node | None = None) -> None:
    new.meta["custom"] = dict(custom_meta(like))
    for k in ("stack_trace", "seq_nr"):
        if k in like.meta:
            new.meta[k] = like.meta[k]
    if val is not None:
        new.meta["val"] = val
    if key_from is not None and NUMERICS_KEY in key_from.meta:
        new.meta[NUMERICS_KEY] = key_from.meta[NUMERICS_KEY]


def _fake_call(fake_mode, op, args, kwargs) -> Any:
    """The fake value of ``op`` on the fake values of its node arguments (None without)."""
    if fake_mode is None:
        return None
    vals = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta.get("val"))
    with fake_mode:
        return op(*vals[0], **vals[1])


def _contiguous(graph: torch.fx.Graph, node: torch.fx.Node, like: torch.fx.Node, fake_mode) -> tuple[torch.fx.Node, int]:
    """``node``, or a contiguous ``clone`` of it placed after it when its fake value is not
    contiguous (the traced value it replaces, ``like``, is, and later ``view`` s rely on
    it); ``(node, copies added)``. The clone takes ``like``'s metadata."""
    val = _val(node)
    if val is None or val.is_contiguous():
        return node, 0
    with graph.inserting_after(node):
        clone = graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        _set_meta(clone, like, torch.empty_like(val, memory_format=torch.contiguous_format), key_from=like)
    node.meta.pop(NUMERICS_KEY, None)
    return clone, 1


def _erase_unused(graph: torch.fx.Graph, nodes: list[torch.fx.Node | None]) -> None:
    for node in reversed(nodes):
        if node is not None and not getattr(node, "_erased", False) and not node.users:
            graph.erase_node(node)


def _raise_ancestors(graph: torch.fx.Graph, roots: list[torch.fx.Node], before: torch.fx.Node) -> int:
    """Move the nodes ``roots`` need that come after ``before`` to just before it (in their
    order); returns how many moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    lo = order[before]
    need, stack = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        cur = stack.pop()
        if cur in need or order[cur] <= lo:
            continue
        need.add(cur)
        stack.extend(cur.all_input_nodes)
    for node in sorted(need, key=order.__getitem__):
        before.prepend(node)
    return len(need)


def _fuse_all_gather(graph: torch.fx.Graph, m: AllGatherMatch, group_name: str, fake_mode, has_return_a: bool) -> int:
    """Replace ``m`` by one ``fused_all_gather_matmul`` at the all-gather; returns the
    contiguous copies added."""
    op = torch.ops.symm_mem.fused_all_gather_matmul.default
    ag = m.ag
    _raise_ancestors(graph, [mm.b for mm in m.matmuls], ag)
    args = (ag.args[0], [mm.b for mm in m.matmuls], m.gather_dim, group_name)
    kwargs = {"return_A": True} if has_return_a else {}
    with graph.inserting_before(ag):
        fused = graph.call_function(op, args, kwargs)
        _set_meta(fused, ag, _fake_call(fake_mode, op, args, kwargs))
        fused_val = fused.meta.get("val")
        a_node = graph.call_function(operator.getitem, (fused, 0))
        outs = graph.call_function(operator.getitem, (fused, 1))
        _set_meta(a_node, m.res, fused_val[0] if fused_val is not None else None, key_from=m.res)
        _set_meta(outs, ag, fused_val[1] if fused_val is not None else None)
        items = []
        for i, mm in enumerate(m.matmuls):
            item = graph.call_function(operator.getitem, (outs, i))
            _set_meta(item, mm.post or mm.mm, fused_val[1][i] if fused_val is not None else None,
                      key_from=mm.post or mm.mm)
            items.append(item)
    copies = 0
    for mm, item in zip(m.matmuls, items):
        out = item
        if mm.post is not None or mm.pre is None:  # the product in the traced shape
            out, n = _contiguous(graph, item, mm.post or mm.mm, fake_mode)
            copies += n
            (mm.post or mm.mm).replace_all_uses_with(out)
            _erase_unused(graph, [mm.post])
        if mm.pre is not None and mm.mm.users:  # the 2-D product of a 3-D A: a view of it
            if out is item:
                out, n = _contiguous(graph, item, mm.post or mm.mm, fake_mode)
                copies += n
            with graph.inserting_after(out):
                flat = graph.call_function(aten.view.default, (out, list(_shape(mm.mm))))
            _set_meta(flat, mm.mm, _fake_view(fake_mode, out, _shape(mm.mm)), key_from=mm.mm)
            mm.mm.replace_all_uses_with(flat)
    _erase_unused(graph, [x for mm in m.matmuls for x in (mm.pre, mm.mm, mm.post)])
    readers = [m.res, *(res for res, _ in m.copies)]
    if any(r.users for r in readers):  # the gathered tensor is read elsewhere (saved for the weight gradient)
        a_out, n = _contiguous(graph, a_node, m.res, fake_mode)
        copies += n
        for r in readers:  # SAC's recomputed layout copies read the same values
            r.replace_all_uses_with(a_out)
    else:
        graph.erase_node(a_node)
        if has_return_a:  # Inductor's rule: do not return A when nothing reads it
            fused.kwargs = {**fused.kwargs, "return_A": False}
            fused.meta["val"] = _fake_call(fake_mode, op, fused.args, fused.kwargs)
            if fused.meta["val"] is not None:
                outs.meta["val"] = fused.meta["val"][1]
    _erase_unused(graph, [ag, m.wait, *(n for _, nodes in m.copies for n in nodes), *m.layout[1:]])
    return copies


def _fake_view(fake_mode, node: torch.fx.Node, shape) -> Any:
    val = _val(node)
    if fake_mode is None or val is None:
        return None
    with fake_mode:
        return val.view(list(shape))


def _fuse_reduce_scatter(graph: torch.fx.Graph, m: ReduceScatterMatch, group_name: str, fake_mode) -> None:
    op = torch.ops.symm_mem.fused_matmul_reduce_scatter.default
    mm = m.matmul
    args = (mm.a, mm.b, m.reduce_op, m.scatter_dim, group_name)
    with graph.inserting_before(m.rs):
        fused = graph.call_function(op, args)
    _set_meta(fused, m.wait, _fake_call(fake_mode, op, args, {}), key_from=m.wait)
    m.wait.replace_all_uses_with(fused)
    _erase_unused(graph, [mm.pre, mm.mm, mm.post, *m.layout, m.rs, m.wait])


# --------------------------------------------------------------------------- symmetric memory


def _workspace_bytes(plan: AsyncTPPlan, group_size: int) -> int:
    """Symmetric workspace the matched ops need (bytes): the shard of an all-gather, two
    ``1/g`` chunks of a reduce-scatter's matmul output (``_pipelined_*`` in
    ``torch/distributed/_symmetric_memory``)."""
    need = 0
    for m in plan.fusible_all_gathers:
        v = _val(m.ag.args[0])
        need = max(need, v.numel() * v.element_size() if v is not None else 0)
    for m in plan.fusible_reduce_scatters:
        v = _val(m.matmul.post or m.matmul.mm)
        need = max(need, 2 * (v.numel() // group_size) * v.element_size() if v is not None else 0)
    return need


def _backend(group_name: str) -> str | None:
    try:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        return str(dist.get_backend(c10d._resolve_process_group(group_name)))
    except Exception:
        return None


def enable_symmetric_memory(group_name: str, workspace_bytes: int) -> tuple[bool, str]:
    """Enable symmetric memory for the TP group ``group_name`` and allocate its workspace of
    at least ``workspace_bytes`` (a rendezvous of the group's ranks: every rank must call
    it). Returns ``(ok, note)``: ``note`` says whether NVLink multicast is available, or
    why symmetric memory is not usable (no NCCL, no symmetric-memory support, the
    allocation or rendezvous failed)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return False, "NCCL is not available"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        with warnings.catch_warnings():  # deprecated (no longer needed) in newer torch
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        symm_mem.get_symm_mem_workspace(group_name, min_size=max(workspace_bytes, 1))
    except Exception as e:  # no P2P access, driver API, allocation ...
        return False, f"symmetric memory unavailable for the TP group ({type(e).__name__}: {str(e)[:200]})"
    try:  # informational: both fused ops run without multicast (module docstring)
        multicast = _SymmetricMemory.has_multicast_support(DeviceType.CUDA, torch.cuda.current_device())
    except Exception:
        return True, "multicast support unknown"
    return True, "multicast on" if multicast else "multicast off: P2P copy-engine path"


# --------------------------------------------------------------------------- the pass


def async_tp_pass(
    gm: torch.fx.GraphModule,
    example_inputs=None,
    *,
    tp_group_name: str | None = None,
    fuse: str = "all",
    rewrite: bool | None = None,
) -> torch.fx.GraphModule:
    """Fuse the TP all-gather -> matmul and matmul -> reduce-scatter pairs of ``gm`` into
    ``symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` (module
    docstring: what matches, when it rewrites, numerics).

    Args:
        tp_group_name: the TP process group's name (``ProcessGroup.group_name``); None:
            inferred from the graph (:func:`infer_tp_group`).
        fuse: one of :data:`FUSE_CHOICES`: both kinds of pair, or only one.
        rewrite: None: on a fake process group, or on CUDA with symmetric memory usable
            (enabled here); True: always (no symmetric memory set up); False: count only.

    Stats: ``all_gather_fused`` / ``all_gather_left``, ``matmuls_fused`` (matmuls inside
    the fused all-gathers), ``reduce_scatter_fused`` / ``reduce_scatter_left`` (TP group
    only), ``restrided`` (contiguous copies added), ``rewritten`` (1 / 0).

    Raises:
        ValueError: ``fuse`` not in :data:`FUSE_CHOICES`.
    """
    if fuse not in FUSE_CHOICES:
        raise ValueError(f"fuse must be one of {', '.join(FUSE_CHOICES)}; got {fuse!r}")
    plan = find_async_tp_matches(gm, tp_group_name)
    if plan.group_name is None:
        set_pass_summary(gm, f"skipped: {plan.group_reason}", rewritten=0)
        return gm
    ags = plan.fusible_all_gathers if fuse in ("all", "all_gather_matmul") else []
    rss = plan.fusible_reduce_scatters if fuse in ("all", "matmul_reduce_scatter") else []
    in_ag = {mm.mm for m in ags for mm in m.matmuls}
    for m in rss:  # a matmul between a gather and a scatter goes with its all-gather (as Inductor)
        if m.matmul.mm in in_ag:
            m.reason = "its matmul is fused with the all-gather of its input"
    rss = [m for m in rss if m.reason is None]
    stats = dict(
        all_gather_fused=len(ags), all_gather_left=len(plan.all_gathers) - len(ags),
        matmuls_fused=sum(len(m.matmuls) for m in ags),
        reduce_scatter_fused=len(rss), reduce_scatter_left=len(plan.reduce_scatters) - len(rss),
        restrided=0, rewritten=0,
    )
    what = (f"{len(ags)} all-gather->matmul ({stats['matmuls_fused']} matmuls) and {len(rss)} "
            f"matmul->reduce-scatter on TP group {plan.group_name!r}")
    left = _left_text(plan, ags, rss)
    if not ags and not rss:
        set_pass_summary(gm, f"nothing to fuse on TP group {plan.group_name!r}{left}", **stats)
        return gm

    note = ""
    if rewrite is None:
        backend = _backend(plan.group_name)
        device = _val(ags[0].ag.args[0] if ags else rss[0].matmul.mm)
        device = device.device.type if device is not None else "unknown"
        if backend == "fake":
            note = "; fake process group: rewritten for the dry run, symmetric memory not set up"
        elif device != "cuda":
            set_pass_summary(gm, f"skipped: device {device} (the symm_mem fused ops are CUDA-only); "
                                 f"would fuse {what}{left}", **stats)
            return gm
        else:
            group_size = _arg(ags[0].ag, 1, "group_size") if ags else _arg(rss[0].rs, 2, "group_size")
            ok, note = enable_symmetric_memory(plan.group_name, _workspace_bytes(plan, group_size))
            if not ok:
                set_pass_summary(gm, f"skipped: {note}; would fuse {what}{left}", **stats)
                return gm
            note = f"; symmetric memory enabled, {note}"
    elif not rewrite:
        set_pass_summary(gm, f"counted only: would fuse {what}{left}", **stats)
        return gm

    import torch.distributed._symmetric_memory  # noqa: F401  defines torch.ops.symm_mem's fused ops

    graph = gm.graph
    fake_mode = detect_graph_fake_mode(gm, example_inputs)
    has_return_a = any(a.name == "return_A" for a in torch.ops.symm_mem.fused_all_gather_matmul.default._schema.arguments)
    for m in ags:
        stats["restrided"] += _fuse_all_gather(graph, m, plan.group_name, fake_mode, has_return_a)
    for m in rss:
        _fuse_reduce_scatter(graph, m, plan.group_name, fake_mode)
    graph.lint()
    gm.recompile()
    stats["rewritten"] = 1
    copies = f", {stats['restrided']} contiguous copies" if stats["restrided"] else ""
    set_pass_summary(gm, f"fused {what}{copies}{left}{note}", **stats)
    return gm


def _left_text(plan: AsyncTPPlan, ags: list[AllGatherMatch], rss: list[ReduceScatterMatch]) -> str:
    """``"; left: 1 all-gather (no matmul ...), 65 reduce-scatters (...)"`` or ``""``."""
    parts = []
    for label, ms, fused in (("all-gather", plan.all_gathers, ags), ("reduce-scatter", plan.reduce_scatters, rss)):
        reasons: dict[str, int] = {}
        for m in ms:
            if m not in fused:
                r = m.reason or "not selected (--compile.async_tp.fuse)"
                reasons[r] = reasons.get(r, 0) + 1
        if reasons:
            n = sum(reasons.values())
            parts.append(f"{n} {label}{'s' if n > 1 else ''} (" + "; ".join(f"{v}: {k}" for k, v in reasons.items()) + ")")
    return f"; left {', '.join(parts)}" if parts else ""


@dataclass
class AsyncTPOptions:
    """``[compile.async_tp]``: options of ``async_tp`` (``--compile.passes async_tp``)."""

    fuse: Literal["all", "all_gather_matmul", "matmul_reduce_scatter"] = "all"
    """Which TP pairs the async_tp pass replaces with torch's symmetric-memory ops: all:
    all-gather -> matmul (symm_mem.fused_all_gather_matmul) and matmul -> reduce-scatter
    (symm_mem.fused_matmul_reduce_scatter); all_gather_matmul / matmul_reduce_scatter:
    only that one. CUDA only (the pass skips elsewhere). The fused matmuls run in
    per-rank row chunks: equal to the unfused step up to the matmul kernels' choice, not
    guaranteed bitwise (graph_trainer/compiler/passes/async_tp.py)."""


PASS = GraphPass(
    name="async_tp", fn=async_tp_pass, options=AsyncTPOptions,
    kwargs=lambda options, ctx: {"fuse": options.fuse, "tp_group_name": ctx.tp_group_name},
    aliases=("micro_pipeline_tp",),
)
