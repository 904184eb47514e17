"""Shared helpers of the graph passes (not a pass itself); pass modules import what they share
from here, never from another pass module.

Pass summaries (:func:`set_pass_summary`), trace-time node metadata, the
``compile_with_inductor`` tag and the fusion group, op names and the view / cast op sets,
collectives (the ``symm_mem`` fused ops of ``async_tp`` included), the keep-alive :func:`hold`, and graph
analysis (:class:`DisjointSet`, :func:`storages`, :func:`split_acyclic`, fake inputs), and the
chains of pointwise ops the pointwise annotations tag (:func:`find_pointwise_regions`,
:func:`tag_regions`) and the RMSNorm instances (:func:`find_rmsnorm_instances`).
"""

from __future__ import annotations

import json
import operator
from collections import Counter, defaultdict
from collections.abc import Callable, Container, Iterable
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY, MODULE_FQN_KEY, PHASE_KEY

SUMMARY_KEY = "graph_trainer_pass_summary"
#: ``node.meta["custom"]`` key of a fusion group: under ``full_inductor`` a node of a group
#: shares generated kernels only with nodes of the same group.
FUSION_GROUP_KEY = "inductor_fusion_group"
STATS_KEY = "graph_trainer_pass_stats"
#: Node meta key Inductor's lowering reads to round a low-precision op's result as eager does.
BARRIER_KEY = "low_precision_pointwise_barrier"

aten = torch.ops.aten
prims = torch.ops.prims


def set_pass_summary(gm: torch.nn.Module, summary: str, **stats: Any) -> None:
    """Record what a pass did on ``gm.meta``: ``summary`` (one short line) and numeric ``stats``."""
    if not isinstance(getattr(gm, "meta", None), dict):
        gm.meta = {}  # type: ignore[attr-defined]
    gm.meta[SUMMARY_KEY] = summary
    gm.meta[STATS_KEY] = dict(stats)


def pop_pass_summary(gm: Any) -> tuple[str, dict[str, Any]]:
    """Return and clear the summary/stats a pass left on ``gm`` ("" / {} if none)."""
    meta = getattr(gm, "meta", None)
    if not isinstance(meta, dict):
        return "", {}
    return meta.pop(SUMMARY_KEY, ""), meta.pop(STATS_KEY, {})


def custom_meta(node: torch.fx.Node) -> dict[str, Any]:
    """``node.meta["custom"]`` or ``{}`` (never None)."""
    custom = node.meta.get("custom")
    return custom if isinstance(custom, dict) else {}


def phase_of(node: torch.fx.Node) -> str | None:
    """The trace-time phase of ``node`` (``"forward"`` / ``"backward"``), or None."""
    return custom_meta(node).get(PHASE_KEY)


def module_fqn_of(node: torch.fx.Node) -> str | None:
    """The FQN of the innermost module that ran ``node`` (backward nodes: their forward op's), or None."""
    return custom_meta(node).get(MODULE_FQN_KEY)


def is_tagged_for_inductor(node: torch.fx.Node) -> bool:
    """Whether ``node`` carries a ``compile_with_inductor`` tag (regional_inductor compiles it)."""
    return COMPILE_WITH_INDUCTOR_KEY in custom_meta(node)


def fusion_group_of(node: torch.fx.Node) -> str | None:
    """The fusion group of ``node`` (:data:`FUSION_GROUP_KEY`), or None."""
    return custom_meta(node).get(FUSION_GROUP_KEY)


def tag_fusion_group(node: torch.fx.Node, group: str) -> None:
    """Put ``node`` into fusion group ``group``, keeping its other ``custom`` entries."""
    node.meta["custom"] = {**custom_meta(node), FUSION_GROUP_KEY: group}


def tag_for_inductor(
    node: torch.fx.Node,
    inductor_configs: dict[str, Any],
    region: str,
    candidate_configs: list[dict[str, Any]] | None = None,
) -> None:
    """Tag ``node`` for regional_inductor as part of region ``region`` (never fused with another
    region), keeping its other ``custom`` entries (copied: they may be shared between nodes).
    Non-empty ``candidate_configs``: config sets ``regional_inductor`` also compiles and times."""
    tag: dict[str, Any] = {"inductor_configs": dict(inductor_configs), "inductor_region": region}
    if candidate_configs:
        tag["candidate_inductor_configs"] = [dict(c) for c in candidate_configs]
    node.meta["custom"] = {**custom_meta(node), COMPILE_WITH_INDUCTOR_KEY: tag}


def untag_for_inductor(node: torch.fx.Node) -> None:
    """Remove ``node``'s ``compile_with_inductor`` tag and its eager-rounding mark (:data:`BARRIER_KEY`)."""
    if is_tagged_for_inductor(node):
        node.meta["custom"] = {k: v for k, v in custom_meta(node).items() if k != COMPILE_WITH_INDUCTOR_KEY}
    node.meta.pop(BARRIER_KEY, None)


def mutated_args(node: torch.fx.Node) -> list[Any]:
    """The arguments an aten op node writes in place (``Tensor(a!)`` in its schema), positional
    or keyword; ``None`` for such an optional argument not given. ``node.target`` must be an
    ``OpOverload``."""
    schema = node.target._schema
    args = [*node.args, *(node.kwargs.get(a.name) for a in schema.arguments[len(node.args):])]
    return [a for a, spec in zip(args, schema.arguments) if spec.alias_info is not None and spec.alias_info.is_write]


def is_getitem(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``operator.getitem`` (an element of a tuple-returning node)."""
    return node.op == "call_function" and node.target is operator.getitem


def returns_view(target: Any) -> bool:
    """Whether ``target`` is an op whose schema returns an alias of an input that it does not write
    (``aten.view``, ``t``, ``split``, ``slice``, ...: a view, no kernel); False for non-ops."""
    return isinstance(target, torch._ops.OpOverload) and any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def _op_name(target: Any) -> str | None:
    """``"mm"`` for ``aten.mm.default`` or ``aten.mm``; None for non-ops."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return None


def packet_name(node: torch.fx.Node) -> str | None:
    """The op packet name of a ``call_function`` OpOverload node (``"mm"`` for ``aten.mm.default``)."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return _op_name(node.target)
    return None


def op_namespace(target: Any) -> str | None:
    """The namespace of an op (``"aten"``, ``"_c10d_functional"`` ...), None for non-ops."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.namespace
    return None


def target_name(node: torch.fx.Node) -> str:
    """A stable name for a node's target (``"aten.mm.default"``, ``"_operator.getitem"``)."""
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    t = node.target
    if isinstance(t, str):
        return f"{node.op}:{t}"
    if isinstance(t, torch._ops.OpOverload):
        return str(t)
    if isinstance(t, torch._ops.HigherOrderOperator):
        return f"higher_order.{t.name()}"
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)
    return f"{mod}.{name}" if mod else name


def op_counts(gm: Any) -> dict[str, int]:
    """Counts of nodes per :func:`target_name` (``{}`` if ``gm`` has no FX graph)."""
    graph = getattr(gm, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return {}
    return dict(sorted(Counter(target_name(n) for n in graph.nodes).items()))


def num_nodes(gm: Any) -> int | None:
    """Number of nodes of ``gm``'s FX graph (None if it has none, e.g. a compiled callable)."""
    graph = getattr(gm, "graph", None)
    return len(graph.nodes) if isinstance(graph, torch.fx.Graph) else None


#: Views with the same elements in another shape.
RESHAPE_OPS: frozenset = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
#: Views onto (part of) a buffer (a gathered FSDP buffer is read through ``slice -> view``).
SLICE_OPS: frozenset = frozenset({aten.slice.Tensor, aten.alias.default, aten.as_strided.default})
#: Views that reorder or broadcast dimensions.
PERMUTE_OPS: frozenset = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default})
#: Every view op the passes follow.
VIEW_OPS: frozenset = RESHAPE_OPS | SLICE_OPS | PERMUTE_OPS | {aten.detach.default}
#: dtype casts: ``aten._to_copy`` (make_fx's ``.to(dtype)``) and ``prims.convert_element_type``.
CAST_OPS: frozenset = frozenset({aten._to_copy.default, prims.convert_element_type.default})


def packet_names(ops: Iterable[Any]) -> frozenset[str]:
    """The packet names of ``ops`` (``{"view"}`` for ``{aten.view.default}``), to match every overload."""
    return frozenset(name for op in ops if (name := _op_name(op)) is not None)


#: Namespaces of collective / communication ops: never removed as dead code, never
#: recomputed, never put inside an Inductor region. ``symm_mem``: the fused
#: collective-matmul ops of ``async_tp``, which communicate inside the op.
COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor", "symm_mem"}
)
_FUSED_COLLECTIVE_KINDS = frozenset({"fused_all_gather_matmul", "fused_matmul_reduce_scatter"})


def is_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a collective / communication op (``wait_tensor`` included)."""
    return node.op == "call_function" and op_namespace(node.target) in COLLECTIVE_NAMESPACES


def collective_kind(node: torch.fx.Node) -> str | None:
    """The op name of a functional collective's issue node (``"all_gather_into_tensor"``, ``"all_reduce"``
    ...) or of a fused ``symm_mem`` collective-matmul (no wait); None for waits and other nodes."""
    if not is_collective(node):
        return None
    namespace, name = op_namespace(node.target), _op_name(node.target)
    if namespace == "symm_mem":
        return name if name in _FUSED_COLLECTIVE_KINDS else None
    return name if namespace == "_c10d_functional" and name != "wait_tensor" else None


def is_wait(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a functional collective's ``wait_tensor`` (input: the issue node)."""
    return (
        node.op == "call_function"
        and op_namespace(node.target) == "_c10d_functional"
        and _op_name(node.target) == "wait_tensor"
    )


def hold(x, *keep_alive):
    """Identity on ``x``; ``keep_alive`` (an in-flight collective's inputs) lives until this call.
    ``overlap_collectives`` inserts it after moved waits; passes test ``node.target is hold``."""
    return x


def strip_holds(gm: torch.fx.GraphModule, of: Container[torch.fx.Node] | None = None) -> int:
    """Replace every :func:`hold` node (only those holding a node of ``of``, if given) by its first
    argument (before a compiler that owns buffer lifetimes, e.g. full-graph Inductor); returns how
    many were removed."""
    holds = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is hold
             and (of is None or node.args[0] in of)]
    for node in holds:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    if holds:
        gm.recompile()
    return len(holds)


def shard_chain(all_gather: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes (views, casts, waits) between a placeholder and ``all_gather``'s input, earliest
    first; None when there is no such chain (an activation all-gather, not an FSDP parameter's)."""
    chain = []
    cur = all_gather.args[0] if all_gather.args else None
    while (
        isinstance(cur, torch.fx.Node) and cur.op == "call_function"
        and (cur.target in VIEW_OPS or cur.target in CAST_OPS or is_wait(cur))
    ):
        chain.append(cur)
        cur = cur.args[0] if cur.args else None
    if not isinstance(cur, torch.fx.Node) or cur.op != "placeholder":
        return None
    return chain[::-1]


def has_recompute_tags(graph: torch.fx.Graph) -> bool:
    """Whether a node carries selective AC's ``PREFER/MUST_RECOMPUTE`` tag."""
    from torch.utils.checkpoint import CheckpointPolicy

    recompute = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
    return any(n.meta.get("recompute") in recompute for n in graph.nodes)


def strip_recompute_tags(graph: torch.fx.Graph) -> int:
    """Delete selective AC's ``meta["recompute"]`` / ``["ac_graph_id"]`` (else torch >= 2.12's
    ``compile_fx`` recomputes a second time); returns how many nodes had a tag."""
    n = 0
    for node in graph.nodes:
        n += node.meta.pop("recompute", None) is not None
        node.meta.pop("ac_graph_id", None)
    return n


class DisjointSet:
    """Union-find over hashable items: each item is its own set until joined."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, item: Any) -> Any:
        path = []
        while (up := self.parent.get(item, item)) != item:
            path.append(item)
            item = up
        for p in path:  # path compression
            self.parent[p] = item
        return item

    def union(self, a: Any, b: Any) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


def storages(val: Any) -> list[tuple[Any, int]]:
    """``(storage key, bytes)`` of every tensor in ``val`` (a fake value or a pytree of them);
    views share their base's key; tensor subclasses without a storage are skipped."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = []
    for t in pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            try:
                st = t.untyped_storage()
            except Exception:
                continue
            out.append((StorageWeakRef(st), st.nbytes()))
    return out


def split_acyclic(
    nodes: list[torch.fx.Node], order: dict[torch.fx.Node, int] | None = None
) -> list[list[torch.fx.Node]]:
    """Split ``nodes`` into the fewest parts that can each be fused without a dependency cycle,
    in graph order (``[nodes]`` if acyclic). ``order``: node -> graph position.

    The nodes reachable from the set through an outside node (an AC-recomputed norm and its
    backward, the attention backward between them) are split off, and split again."""
    if not nodes:
        return []
    if order is None:
        order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    remaining = sorted(nodes, key=order.__getitem__)
    parts: list[list[torch.fx.Node]] = []
    while remaining:
        members = set(remaining)
        last = order[remaining[-1]]
        late: set[torch.fx.Node] = set()
        visited: set[torch.fx.Node] = set()
        stack = [u for n in remaining for u in n.users if u not in members]
        while stack:
            cur = stack.pop()
            if cur in visited or order.get(cur, last + 1) > last:
                continue
            visited.add(cur)
            if cur in members:
                late.add(cur)
            stack.extend(cur.users)
        parts.append([n for n in remaining if n not in late])
        remaining = [n for n in remaining if n in late]
    return parts


def val_bytes(val: Any) -> int:
    """Bytes of a tensor (at most its storage's: an expanded view counts what it reads) or of a
    list / tuple of them; else 0."""
    if isinstance(val, torch.Tensor):
        n = val.numel() * val.element_size()
        try:
            n = min(n, val.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        return n
    if isinstance(val, (list, tuple)):
        return sum(val_bytes(v) for v in val)
    return 0


def placeholder_vals(gm: torch.fx.GraphModule) -> list[Any]:
    """``meta.get("val")`` of every placeholder of ``gm``, in order (None where missing)."""
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def accelerator_of(gm: torch.fx.GraphModule, example_inputs: Any = None) -> torch.device | None:
    """The device of the first placeholder value (then ``example_inputs`` leaf) that is neither
    on the CPU nor on meta, or None (a CPU graph)."""
    vals = placeholder_vals(gm) + pytree.tree_leaves(example_inputs)
    return next((v.device for v in vals if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")),
                None)


def detect_graph_fake_mode(gm: torch.fx.GraphModule, example_inputs: Any = None):
    """The FakeTensorMode of the placeholders' ``meta["val"]``, else of ``example_inputs``, else None."""
    from torch._guards import detect_fake_mode

    for vals in (placeholder_vals(gm), pytree.tree_leaves(example_inputs)):
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        mode = detect_fake_mode(tensors) if tensors else None
        if mode is not None:
            return mode
    return None


def fake_inputs_for(gm: torch.fx.GraphModule, example_inputs: Any = None) -> list[Any]:
    """Flat fake example inputs: the placeholders' ``meta["val"]`` if all have one, else the
    leaves of ``example_inputs``; raises ``ValueError`` when neither exists."""
    vals = placeholder_vals(gm)
    if vals and all(v is not None for v in vals):
        return vals
    if example_inputs is None:
        raise ValueError("graph placeholders carry no meta['val'] and no example_inputs were given")
    return list(pytree.tree_leaves(example_inputs))


def json_object(value: Any, flag: str) -> dict[str, Any]:
    """``value`` (a JSON object as text, a dict, or empty) as a dict; ``{}`` when empty.

    Raises:
        ValueError: not a JSON object (the message names ``flag``).
    """
    if isinstance(value, dict):
        return dict(value)
    if not value or not str(value).strip():
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object, e.g. '{{\"coordinate_descent_tuning\": true}}'; "
                         f"got {value!r} ({e})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    return parsed


# --- chains of pointwise ops (the pointwise annotation passes) ---

_POINTWISE_EXTRA_OPS = {"_to_copy", "_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward"}
# View-family ops (every overload) that join a chain they continue.
_CHAIN_VIEW_PACKETS = packet_names(RESHAPE_OPS | PERMUTE_OPS) | {"unsqueeze", "squeeze"}


def _is_real_tensor_node(node: torch.fx.Node) -> bool:
    """A real tensor result with no complex tensor input (Inductor has no complex codegen)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_complex():
        return False
    return not any(isinstance(v := u.meta.get("val"), torch.Tensor) and v.is_complex() for u in node.all_input_nodes)


def _chain_kind(node: torch.fx.Node) -> str | None:
    """"compute", "view" or None (not eligible)."""
    name = packet_name(node)
    if name is None or node.target.namespace != "aten" or is_tagged_for_inductor(node):
        return None
    if not _is_real_tensor_node(node):
        return None
    tags = set(node.target.tags)
    if node.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in tags:
        return None  # in-place / out= ops (torch 2.11 has no Tag.inplace)
    if name in _CHAIN_VIEW_PACKETS:
        return "view"
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags or name in _POINTWISE_EXTRA_OPS:
        return "compute"
    return None


def find_pointwise_regions(
    graph: torch.fx.Graph, min_ops: int = 2, accept: Callable[[torch.fx.Node], bool] | None = None,
) -> list[list[torch.fx.Node]]:
    """Acyclic regions of chained cheap ops, in graph order, each a list of nodes in graph order
    with at least ``min_ops`` non-view ops. Ops: aten ``pointwise`` / ``reduction`` ops
    (``torch.Tag``), ``_to_copy``, ``_log_softmax(_backward_data)`` and ``nll_loss_forward/backward``;
    not in-place, seeded-random or complex ops, nodes already tagged for Inductor, collectives. A
    view joins only a chain it continues. Connected ops of one ``(phase, module FQN)`` form a
    region, cut by :func:`split_acyclic` where it would form a cycle (the residual ``out = h +
    ffn(norm(h))``). ``accept``: a further test every non-view op must pass (views are joined by
    the same rule either way)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    chains = DisjointSet()
    kind: dict[torch.fx.Node, str] = {}
    for n in nodes:  # union matched neighbours of the same (phase, module)
        k = _chain_kind(n)
        if k is None or (k == "compute" and accept is not None and not accept(n)):
            continue
        key = (phase_of(n), module_fqn_of(n))
        ins = [u for u in n.all_input_nodes if u in kind and (phase_of(u), module_fqn_of(u)) == key]
        if k == "view" and not ins:
            continue  # a view joins only a chain it continues
        kind[n] = k
        for u in ins:
            chains.union(u, n)
    components: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for n in nodes:  # graph order within each component
        if n in kind:
            components[chains.find(n)].append(n)
    pieces = [part for comp in components.values() for part in split_acyclic(comp, pos)]
    pieces.sort(key=lambda p: pos[p[0]])
    return [p for p in pieces if sum(kind[n] == "compute" for n in p) >= min_ops]


def tag_regions(regions: list[list[torch.fx.Node]], inductor_configs: dict[str, Any], prefix: str) -> dict[str, int]:
    """Tag the nodes of each region for ``regional_inductor`` as region ``<prefix>_<phase>_<i>``
    with ``inductor_configs``. Returns the stats ``regions``, ``nodes``, ``forward_regions``,
    ``backward_regions`` and ``largest`` (nodes of the largest region)."""
    by_phase: dict[str, int] = defaultdict(int)
    for i, region in enumerate(regions):
        phase = phase_of(region[0]) or "none"
        by_phase[phase] += 1
        for n in region:
            tag_for_inductor(n, inductor_configs, f"{prefix}_{phase}_{i}")
    return {"regions": len(regions), "nodes": sum(map(len, regions)), "forward_regions": by_phase["forward"],
            "backward_regions": by_phase["backward"], "largest": max(map(len, regions), default=0)}


FUSED_RMS_NORM = aten._fused_rms_norm.default
FUSED_RMS_NORM_BACKWARD = aten._fused_rms_norm_backward.default
_PHASES = ("forward", "backward")

# Ops that never belong to a norm: their presence disqualifies a module.
_HEAVY_PACKETS = {
    "mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_scaled_mm", "convolution",
    "embedding", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
    "_grouped_mm", "scaled_dot_product_attention",
}  # fmt: skip
# Ops (every overload) skipped between the steps of the RMS pattern.
_PASS_THROUGH_PACKETS = packet_names(RESHAPE_OPS | CAST_OPS) | {"clone", "detach"}


def _is_heavy(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator) or is_collective(node):
        return True
    return packet_name(node) in _HEAVY_PACKETS


def _produces_tensors(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return bool(val) and all(isinstance(v, torch.Tensor) or v is None for v in val)
    return isinstance(val, torch.Tensor)


def _skip_pass_through(node: Any) -> Any:
    while isinstance(node, torch.fx.Node) and packet_name(node) in _PASS_THROUGH_PACKETS:
        node = node.args[0] if node.args else None
    return node


def _is_rms_rsqrt(node: torch.fx.Node) -> bool:
    """``node`` is ``rsqrt([add(] mean(pow(x, 2) | mul(x, x)) [, eps)])``."""
    if packet_name(node) != "rsqrt" or not node.args:
        return False
    arg = _skip_pass_through(node.args[0])
    if isinstance(arg, torch.fx.Node) and packet_name(arg) in ("add", "add_"):
        tensors = [a for a in arg.args if isinstance(a, torch.fx.Node)]
        if len(tensors) != 1:
            return False
        arg = _skip_pass_through(tensors[0])
    if not (isinstance(arg, torch.fx.Node) and packet_name(arg) == "mean" and arg.args):
        return False
    sq = _skip_pass_through(arg.args[0])
    if not isinstance(sq, torch.fx.Node) or len(sq.args) < 2:
        return False
    name = packet_name(sq)
    return (name == "pow" and sq.args[1] == 2) or (name == "mul" and sq.args[0] is sq.args[1])


def _has_rms_pattern(nodes) -> bool:
    return any(_is_rms_rsqrt(n) for n in nodes)


def find_rmsnorm_instances(graph: torch.fx.Graph) -> list[dict[str, Any]]:
    """All RMSNorm instances of ``graph`` in graph order (pure analysis).

    Each is ``{"name", "phase", "kind", "form" ("fused" | "decomposed"), "module_fqn", "nodes":
    [nodes to tag]}``; ``kind`` is ``"forward"``, ``"backward"`` (a norm's gradient) or
    ``"recompute"`` (a forward norm recomputed in the backward phase by activation
    checkpointing); ``name`` is ``rmsnorm_<kind>_<i>``, ``i`` counting each kind in graph order.
    """
    instances: list[dict[str, Any]] = []
    fused_fqns: set[str] = set()
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[tuple[str, str], list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        fqn, phase = module_fqn_of(node), phase_of(node)
        if node.target in (FUSED_RMS_NORM, FUSED_RMS_NORM_BACKWARD):
            is_bwd = node.target is FUSED_RMS_NORM_BACKWARD
            phase = phase if phase in _PHASES else "backward" if is_bwd else "forward"
            if fqn is not None:
                fused_fqns.add(fqn)
            kind = "forward" if phase == "forward" else "backward" if is_bwd else "recompute"
            nodes = [node] + [u for u in node.users if is_getitem(u)]
            instances.append({"phase": phase, "kind": kind, "form": "fused", "module_fqn": fqn, "nodes": nodes})
        elif fqn is not None and phase in _PHASES:
            groups.setdefault((fqn, phase), []).append(node)

    for (fqn, phase), nodes in groups.items():
        fwd = groups.get((fqn, "forward"), [])
        if fqn in fused_fqns or not fwd or any(_is_heavy(n) for n in fwd) or any(_is_heavy(n) for n in nodes):
            continue
        if not (fqn.rsplit(".", 1)[-1].lower().endswith("norm") or _has_rms_pattern(fwd)):
            continue
        tag = [n for n in nodes if not is_collective(n) and _produces_tensors(n)]
        for part in split_acyclic(tag, order):
            kind = "forward" if phase == "forward" else "recompute" if _has_rms_pattern(part) else "backward"
            instances.append({"phase": phase, "kind": kind, "form": "decomposed", "module_fqn": fqn, "nodes": part})

    instances.sort(key=lambda inst: order[inst["nodes"][0]])
    per_kind: Counter = Counter()
    for inst in instances:
        inst["name"] = f"rmsnorm_{inst['kind']}_{per_kind[inst['kind']]}"
        per_kind[inst["kind"]] += 1
    return instances
