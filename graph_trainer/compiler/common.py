"""Shared helpers of the graph passes (not a pass itself).

Every pass module of :mod:`graph_trainer.compiler.passes` imports what it shares with other
passes from here, never from another pass module. What is here:

* **Pass summaries**: every pass reports what it did through :func:`set_pass_summary`
  (a one-line summary and a dict of numbers on ``gm.meta``);
  :func:`graph_trainer.compiler.pipeline.run_pipeline` reads them back with
  :func:`pop_pass_summary` for its log line and its ``summary.json``.
* **Node metadata** written at trace time (``custom["phase"]``, ``custom["module_fqn"]``)
  and the ``compile_with_inductor`` tag of the annotation passes.
* **Ops**: names of targets, op counts, and the one definition of each view / cast op
  set (:data:`RESHAPE_OPS`, :data:`SLICE_OPS`, :data:`PERMUTE_OPS`, :data:`VIEW_OPS`,
  :data:`CAST_OPS`).
* **Collectives**: the one way to recognise them (:func:`is_collective`,
  :func:`collective_kind`, :func:`is_wait`; the fused symmetric-memory ops of ``async_tp``
  included), the keep-alive identity :func:`hold` that
  ``overlap_collectives`` inserts after a moved wait, and :func:`shard_chain` (what makes
  an all-gather an FSDP parameter all-gather).
* **Graph analysis**: :class:`DisjointSet`, :func:`storages`, :func:`split_acyclic`,
  :func:`strip_recompute_tags`, and the fake mode / fake inputs of a graph.
"""

from __future__ import annotations

import json
import operator
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY, MODULE_FQN_KEY, PHASE_KEY

SUMMARY_KEY = "graph_trainer_pass_summary"
STATS_KEY = "graph_trainer_pass_stats"

aten = torch.ops.aten
prims = torch.ops.prims


# --------------------------------------------------------------------------- pass summaries


def set_pass_summary(gm: torch.nn.Module, summary: str, **stats: Any) -> None:
    """Record what a pass did: ``summary`` (one short line) and numeric ``stats``."""
    meta = getattr(gm, "meta", None)
    if meta is None:
        try:
            gm.meta = meta = {}  # type: ignore[attr-defined]
        except Exception:  # pragma: no cover - exotic callables
            return
    meta[SUMMARY_KEY] = summary
    meta[STATS_KEY] = dict(stats)


def pop_pass_summary(gm: Any) -> tuple[str, dict[str, Any]]:
    """Return and clear the summary/stats a pass left on ``gm`` ("" / {} if none)."""
    meta = getattr(gm, "meta", None)
    if not isinstance(meta, dict):
        return "", {}
    return meta.pop(SUMMARY_KEY, ""), meta.pop(STATS_KEY, {})


# --------------------------------------------------------------------------- node metadata


def custom_meta(node: torch.fx.Node) -> dict[str, Any]:
    """``node.meta["custom"]`` or ``{}`` (never None)."""
    custom = node.meta.get("custom")
    return custom if isinstance(custom, dict) else {}


def phase_of(node: torch.fx.Node) -> str | None:
    """The trace-time phase of ``node`` (``"forward"`` / ``"backward"``), or None."""
    return custom_meta(node).get(PHASE_KEY)


def module_fqn_of(node: torch.fx.Node) -> str | None:
    """The FQN of the innermost module that ran ``node`` (backward nodes: that of their
    forward op), or None."""
    return custom_meta(node).get(MODULE_FQN_KEY)


def is_tagged_for_inductor(node: torch.fx.Node) -> bool:
    """Whether ``node`` carries a ``compile_with_inductor`` tag (regional_inductor compiles it)."""
    return COMPILE_WITH_INDUCTOR_KEY in custom_meta(node)


def tag_for_inductor(
    node: torch.fx.Node,
    inductor_configs: dict[str, Any],
    region: str,
    candidate_configs: list[dict[str, Any]] | None = None,
) -> None:
    """Tag ``node`` for regional_inductor, keeping its other ``custom`` entries.

    The ``custom`` dict is copied (it may be shared between nodes created under
    the same ``fx.traceback.annotate`` block) and every node gets its own
    ``inductor_configs`` copy. ``region`` becomes the ``inductor_region`` key:
    nodes with different region ids are never fused into one compiled region.
    Non-empty ``candidate_configs`` become ``"candidate_inductor_configs"``: config
    sets ``regional_inductor_pass`` also compiles and times for this region.
    """
    custom = dict(custom_meta(node))
    custom[COMPILE_WITH_INDUCTOR_KEY] = {
        "inductor_configs": dict(inductor_configs),
        "inductor_region": region,
    }
    if candidate_configs:
        custom[COMPILE_WITH_INDUCTOR_KEY]["candidate_inductor_configs"] = [dict(c) for c in candidate_configs]
    node.meta["custom"] = custom


# --------------------------------------------------------------------------- ops


def is_getitem(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``operator.getitem`` (an element of a tuple-returning node)."""
    return node.op == "call_function" and node.target is operator.getitem


def _op_name(target: Any) -> str | None:
    """``"mm"`` for ``aten.mm.default`` or ``aten.mm``; None for non-ops."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return None


def packet_name(node: torch.fx.Node) -> str | None:
    """The op packet name of a ``call_function`` OpOverload node (``"mm"`` for
    ``aten.mm.default``), else None."""
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        return _op_name(t)
    return None


def op_namespace(target: Any) -> str | None:
    """The namespace of an op (``"aten"``, ``"_c10d_functional"`` ...), None for non-ops."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.namespace
    return None


def target_name(node: torch.fx.Node) -> str:
    """A stable printable name for a node's target (for op counts)."""
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    t = node.target
    if isinstance(t, str):
        return f"{node.op}:{t}"
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    if isinstance(t, torch._ops.HigherOrderOperator):
        return f"higher_order.{t.name()}"
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)
    return f"{mod}.{name}" if mod else name


def op_counts(gm: Any) -> dict[str, int]:
    """Counts of nodes per target (``{}`` if ``gm`` has no FX graph)."""
    graph = getattr(gm, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return {}
    return dict(sorted(Counter(target_name(n) for n in graph.nodes).items()))


def num_nodes(gm: Any) -> int | None:
    """Number of nodes of ``gm``'s FX graph (None if it has none, e.g. a compiled callable)."""
    graph = getattr(gm, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return None
    return len(graph.nodes)


#: Views with the same elements in another shape: ``view``, ``_unsafe_view``, ``reshape``.
RESHAPE_OPS: frozenset = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
#: Views onto (part of) a buffer: ``slice``, ``alias``, ``as_strided`` (a gathered FSDP
#: buffer is read through ``slice -> view``).
SLICE_OPS: frozenset = frozenset({aten.slice.Tensor, aten.alias.default, aten.as_strided.default})
#: Views that reorder or broadcast dimensions: ``t``, ``transpose``, ``permute``, ``expand``.
PERMUTE_OPS: frozenset = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default})
#: Every view op the passes follow: the three sets above and ``detach``.
VIEW_OPS: frozenset = RESHAPE_OPS | SLICE_OPS | PERMUTE_OPS | {aten.detach.default}
#: dtype casts: ``aten._to_copy`` (make_fx's ``.to(dtype)``) and ``prims.convert_element_type``.
CAST_OPS: frozenset = frozenset({aten._to_copy.default, prims.convert_element_type.default})


def packet_names(ops: Iterable[Any]) -> frozenset[str]:
    """The packet names of ``ops`` (``{"view", "reshape"}`` for ``{aten.view.default,
    aten.reshape.default}``), for passes that match every overload of an op."""
    return frozenset(name for op in ops if (name := _op_name(op)) is not None)


# --------------------------------------------------------------------------- collectives

#: Namespaces of collective / communication ops: never removed as dead code,
#: never recomputed, never put inside an Inductor region by an annotation pass.
#: ``symm_mem``: torch's symmetric-memory ops (the fused collective-matmul ops of the
#: ``async_tp`` pass), which communicate inside the op.
COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor", "symm_mem"}
)
#: Namespace of the functional collectives that make_fx records for traced FSDP / TP:
#: each issue op returns a buffer that its ``wait_tensor`` completes.
FUNCTIONAL_COLLECTIVES = "_c10d_functional"
#: Namespace of torch's symmetric-memory ops (``torch.distributed._symmetric_memory``).
SYMM_MEM = "symm_mem"
#: The fused collective-matmul ops of ``symm_mem`` that :func:`collective_kind` reports:
#: each all-gathers / reduce-scatters inside the op and returns completed values (no
#: ``wait_tensor``).
FUSED_COLLECTIVE_KINDS = frozenset({"fused_all_gather_matmul", "fused_matmul_reduce_scatter"})


def is_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a collective / communication op (any of
    :data:`COLLECTIVE_NAMESPACES`, ``wait_tensor`` included)."""
    return node.op == "call_function" and op_namespace(node.target) in COLLECTIVE_NAMESPACES


def collective_kind(node: torch.fx.Node) -> str | None:
    """The kind of a functional collective's issue node (``"all_gather_into_tensor"``,
    ``"reduce_scatter_tensor"``, ``"all_reduce"`` ...: its op name in
    :data:`FUNCTIONAL_COLLECTIVES`) or of a fused symmetric-memory collective-matmul op
    (``"fused_all_gather_matmul"``, ``"fused_matmul_reduce_scatter"``:
    :data:`FUSED_COLLECTIVE_KINDS`, which have no wait), else None (waits and other nodes)."""
    if not is_collective(node):
        return None
    name = _op_name(node.target)
    if op_namespace(node.target) == SYMM_MEM:
        return name if name in FUSED_COLLECTIVE_KINDS else None
    if op_namespace(node.target) != FUNCTIONAL_COLLECTIVES:
        return None
    return None if name == "wait_tensor" else name


def is_wait(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a functional collective's ``wait_tensor`` (its input is the
    issue node, its result the completed buffer)."""
    return (
        is_collective(node)
        and op_namespace(node.target) == FUNCTIONAL_COLLECTIVES
        and _op_name(node.target) == "wait_tensor"
    )


def hold(x, *keep_alive):
    """Identity on ``x``; ``keep_alive`` only extends the lifetime of its arguments
    (the inputs of an in-flight collective) to this call in the generated code.

    ``overlap_collectives`` inserts it after every wait that no longer follows its
    collective; other passes recognise it by identity (``node.target is hold``), so this
    is the one function object used as that target. At run time the result is the
    wait's buffer (an alias, for memory estimates)."""
    return x


def strip_holds(gm: torch.fx.GraphModule) -> int:
    """Replace every :func:`hold` node by its first argument (before a compiler that owns
    buffer lifetimes, e.g. full-graph Inductor); returns how many were removed."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is hold:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            n += 1
    if n:
        gm.recompile()
    return n


def shard_chain(all_gather: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes between a graph input and ``all_gather``'s input (views, casts, waits),
    earliest first; None when the input is not computed from a placeholder that way.

    An all-gather with a chain is an FSDP parameter all-gather (its input is the
    parameter's shard, perhaps cast); all-gathers of activations (TP sequence parallel)
    have none."""
    chain = []
    cur = all_gather.args[0] if all_gather.args and isinstance(all_gather.args[0], torch.fx.Node) else None
    while (
        cur is not None and cur.op == "call_function"
        and (cur.target in VIEW_OPS or cur.target in CAST_OPS or is_wait(cur))
    ):
        chain.append(cur)
        cur = cur.args[0] if cur.args and isinstance(cur.args[0], torch.fx.Node) else None
    if cur is None or cur.op != "placeholder":
        return None
    return list(reversed(chain))


# --------------------------------------------------------------------------- graph analysis


def has_recompute_tags(graph: torch.fx.Graph) -> bool:
    """Whether a node carries selective AC's ``PREFER/MUST_RECOMPUTE`` tag (op-level SAC
    traced, ``sac_recompute`` not run yet)."""
    from torch.utils.checkpoint import CheckpointPolicy

    recompute = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
    return any(n.meta.get("recompute") in recompute for n in graph.nodes)


def strip_recompute_tags(graph: torch.fx.Graph) -> int:
    """Delete ``meta["recompute"]`` / ``meta["ac_graph_id"]`` (selective activation
    checkpointing's tags) from every node; returns how many nodes had a tag.

    Once ``sac_recompute`` consumed them (or decided not to) they must go: torch >= 2.12's
    ``compile_fx`` runs its own remat on tagged forward-loss-backward graphs
    (``torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph``),
    which would recompute a second time (and rejects graphs whose tagged ops it cannot
    replay)."""
    n = 0
    for node in graph.nodes:
        had = node.meta.pop("recompute", None) is not None
        node.meta.pop("ac_graph_id", None)
        n += had
    return n


class DisjointSet:
    """Union-find over hashable items (nodes, storage keys): each item is its own set
    until joined; ``find`` compresses paths."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, item: Any) -> Any:
        root = item
        while (up := self.parent.get(root, root)) != root:
            root = up
        while item != root:  # path compression
            up = self.parent.get(item, item)
            self.parent[item] = root
            item = up
        return root

    def union(self, a: Any, b: Any) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


def storages(val: Any) -> list[tuple[Any, int]]:
    """``(storage key, bytes)`` of every tensor in ``val`` (a fake value, or a pytree of
    them); views share their base's key. Tensor subclasses without a storage are skipped."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = []
    for t in pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            try:
                st = t.untyped_storage()
            except Exception:  # tensor subclasses without storage
                continue
            out.append((StorageWeakRef(st), st.nbytes()))
    return out


def split_acyclic(
    nodes: list[torch.fx.Node], order: dict[torch.fx.Node, int] | None = None
) -> list[list[torch.fx.Node]]:
    """Split ``nodes`` into the fewest "layers" that can each be fused into one
    sub-graph without creating a dependency cycle.

    A set S cannot be fused when some node of S is reachable from S through a
    node outside S (e.g. an activation-checkpoint recompute of a norm and that
    norm's backward: recompute -> attention recompute/backward -> norm backward).
    The nodes of S reachable that way ("late") are split off and the rest
    ("early", never empty: it holds S's first node) is one cycle-free part; the
    late nodes are split again. Each search only visits nodes up to S's last
    node in graph order, so a compact S costs a few dozen node visits.
    Returns the parts in graph order, each in graph order; a cycle-free S gives
    ``[S]``.
    """
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


# --------------------------------------------------------------------------- fake values


def placeholder_vals(gm: torch.fx.GraphModule) -> list[Any]:
    """``meta.get("val")`` of every placeholder of ``gm``, in order (None where missing)."""
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def detect_graph_fake_mode(gm: torch.fx.GraphModule, example_inputs: Any = None):
    """The FakeTensorMode of the graph (placeholder ``meta["val"]``), else of
    ``example_inputs``, else ``None``."""
    from torch._guards import detect_fake_mode

    vals = [v for v in placeholder_vals(gm) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(vals) if vals else None
    if mode is None and example_inputs is not None:
        flat = [x for x in pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor)]
        mode = detect_fake_mode(flat) if flat else None
    return mode


def fake_inputs_for(gm: torch.fx.GraphModule, example_inputs: Any = None) -> list[Any]:
    """Flat fake example inputs: placeholder ``meta["val"]`` when every placeholder
    has one, else the pytree leaves of ``example_inputs``."""
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
