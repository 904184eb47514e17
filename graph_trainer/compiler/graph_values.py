"""The values of graph nodes (fake tensors, shapes, storages, bytes, device, fake mode) and graph structure helpers."""

import contextlib
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef


class DisjointSet:
    """Union-find over hashable items: each item is its own set until joined."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, item: Any) -> Any:
        path = []
        while (up := self.parent.get(item, item)) != item:
            path.append(item)
            item = up
        self.parent.update(dict.fromkeys(path, item))  # path compression
        return item

    def union(self, a: Any, b: Any) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


def positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Node -> its index in ``graph``'s order (recompute after moving nodes)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def tensor_val(node: Any) -> torch.Tensor | None:
    """``node.meta["val"]`` when ``node`` is a node whose value is a tensor, else None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def shape_of(node: Any) -> tuple[int, ...] | None:
    """The shape of :func:`tensor_val` as a tuple, or None."""
    return tuple(v.shape) if (v := tensor_val(node)) is not None else None


def storages(val: Any) -> list[tuple[Any, int]]:
    """``(storage key, bytes)`` of every tensor in the pytree ``val`` (views share their base's key)."""
    out = []
    for t in pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            try:
                st = t.untyped_storage()
            except Exception:
                continue
            out.append((StorageWeakRef(st), st.nbytes()))
    return out


def split_acyclic(nodes: list[torch.fx.Node],
                  order: dict[torch.fx.Node, int] | None = None) -> list[list[torch.fx.Node]]:
    """Split ``nodes`` into parts that can each be fused without a dependency cycle, in graph order
    (``[nodes]`` if acyclic): the nodes reachable from the set through an outside node are split off, and split
    again. ``order``: node -> graph position."""
    if not nodes:
        return []
    order = order or positions(nodes[0].graph)
    remaining = sorted(nodes, key=order.__getitem__)
    parts: list[list[torch.fx.Node]] = []
    while remaining:
        members, last = set(remaining), order[remaining[-1]]
        late, visited = set(), set()  # members reached from outside; nodes walked
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
    """Bytes of a tensor (at most its storage's) or of a list / tuple of them; else 0."""
    if isinstance(val, torch.Tensor):
        n = val.numel() * val.element_size()
        with contextlib.suppress(RuntimeError, NotImplementedError):
            n = min(n, val.untyped_storage().nbytes())
        return n
    return sum(val_bytes(v) for v in val) if isinstance(val, (list, tuple)) else 0


def fused_bytes(region: list[torch.fx.Node]) -> int:
    """Bytes one fused kernel of ``region`` moves: each input from outside it read once, each output read outside
    it written once (:func:`val_bytes` of their ``meta["val"]``)."""
    members = set(region)
    inputs = {u for n in members for u in n.all_input_nodes if u not in members}
    outputs = [n for n in members if any(u not in members for u in n.users)]
    return sum(val_bytes(n.meta.get("val")) for n in (*inputs, *outputs))


def placeholder_vals(gm: torch.fx.GraphModule) -> list[Any]:
    """``meta.get("val")`` of every placeholder of ``gm``, in order (None where missing)."""
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def accelerator_of(gm: torch.fx.GraphModule, example_inputs: Any = None) -> torch.device | None:
    """The device of the first placeholder value (then ``example_inputs`` leaf) not on CPU or meta, else None."""
    vals = placeholder_vals(gm) + pytree.tree_leaves(example_inputs)
    return next((v.device for v in vals if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")), None)


def detect_graph_fake_mode(gm: torch.fx.GraphModule, example_inputs: Any = None):
    """The FakeTensorMode of the placeholders' ``meta["val"]``, else of ``example_inputs``, else None."""
    for vals in (placeholder_vals(gm), pytree.tree_leaves(example_inputs)):
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        mode = detect_fake_mode(tensors) if tensors else None
        if mode is not None:
            return mode
    return None


def fake_inputs_for(gm: torch.fx.GraphModule, example_inputs: Any = None) -> list[Any]:
    """The placeholders' fake values, else the leaves of ``example_inputs``; else ``ValueError``."""
    vals = placeholder_vals(gm)
    if vals and all(v is not None for v in vals):
        return vals
    if example_inputs is None:
        raise ValueError("graph placeholders carry no meta['val'] and no example_inputs were given")
    return list(pytree.tree_leaves(example_inputs))
