"""Small helpers shared by the graph passes (not a pass itself).

Every pass reports what it did through :func:`set_pass_summary`, which stores a
one-line human readable summary and a dict of numbers on ``gm.meta``;
:func:`graph_trainer.passes.pipeline.run_passes` reads them back for its log line
and its ``summary.json``.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY, MODULE_FQN_KEY, PHASE_KEY

SUMMARY_KEY = "graph_trainer_pass_summary"
STATS_KEY = "graph_trainer_pass_stats"

aten = torch.ops.aten

# Namespaces of collective / communication ops: never removed as dead code,
# never put inside an Inductor region by an annotation pass.
COLLECTIVE_NAMESPACES = frozenset(
    {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"}
)


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


def custom_meta(node: torch.fx.Node) -> dict[str, Any]:
    """``node.meta["custom"]`` or ``{}`` (never None)."""
    custom = node.meta.get("custom")
    return custom if isinstance(custom, dict) else {}


def phase_of(node: torch.fx.Node) -> str | None:
    return custom_meta(node).get(PHASE_KEY)


def module_fqn_of(node: torch.fx.Node) -> str | None:
    return custom_meta(node).get(MODULE_FQN_KEY)


def is_tagged_for_inductor(node: torch.fx.Node) -> bool:
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


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def packet_name(node: torch.fx.Node) -> str | None:
    """The op packet name of a ``call_function`` OpOverload node (``"mm"`` for
    ``aten.mm.default``), else None."""
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return None


def op_namespace(target: Any) -> str | None:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.namespace
    return None


def is_collective(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and op_namespace(node.target) in COLLECTIVE_NAMESPACES


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
    graph = getattr(gm, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return None
    return len(graph.nodes)


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


def placeholder_vals(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def detect_graph_fake_mode(gm: torch.fx.GraphModule, example_inputs: Any = None):
    """The FakeTensorMode of the graph (placeholder ``meta["val"]``), else of
    ``example_inputs``, else ``None``."""
    from torch._guards import detect_fake_mode

    vals = [v for v in placeholder_vals(gm) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(vals) if vals else None
    if mode is None and example_inputs is not None:
        flat = [x for x in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor)]
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
    return list(torch.utils._pytree.tree_leaves(example_inputs))
