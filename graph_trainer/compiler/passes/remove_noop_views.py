"""Remove no-op view / copy / detach nodes from the traced training-step graph.

Matches (all conditions are checked on the fake values in ``node.meta["val"]``;
a node without a tensor ``val`` on itself and its input is never touched):

* ``aten.view.default`` / ``aten.reshape.default`` / ``aten._unsafe_view.default``
  whose result has the same shape, strides and dtype as its input.
* ``aten.alias.default``.
* ``aten.clone.default`` whose result has the same shape, strides and dtype as
  its input, whose input is not a lazily conjugated / negated view, and where
  no tensor aliasing the input or the clone is mutated anywhere in the graph
  (so the copy is observably identical to the original for every reader).
* ``aten.detach.default``: the graph is run without autograd recording, so a
  detach is a plain alias; it is removed when every user is an op known not to
  mutate it (an ATen op that does not write to that argument, or ``getitem``).

Collective ops are treated as aliasing their inputs (``wait_tensor`` returns its
input without an alias annotation).

Never removed: nodes that are graph outputs (returning an alias of an input, or
the input itself, could let the caller's in-place updates leak between
tensors), and nodes in an alias group that some op mutates (in-place ops,
``out=`` ops, or any op we cannot analyse, such as higher-order ops).

Changes: every matched node's uses are replaced by its input and the node is
erased; the graph is recompiled. Counts per kind are reported in the stats. Numerics:
unchanged (every removed node returns its input's values).

Why not Inductor's ``torch._inductor.fx_passes.post_grad.remove_noop_ops``
(``tests/passes/test_remove_noop_views.py::test_inductor_remove_noop_ops_on_this_graph``
runs it on the same graphs): it is written for Inductor's functionalized post-grad graph,
and this make_fx graph keeps its in-place ops. It has no mutation analysis, so it removes
a ``clone`` whose source is later updated in place, and the clone's readers then see the
updated values. It has no rule for ``detach``, ``_unsafe_view`` or ``reshape``, and its
``view`` rule compares the size argument literally (``view(x, [-1, n])`` stays), so on a
traced training step it removes none of the detaches. Nor does it offer a hook to keep
the mutated alias groups out, hence this pass's own matcher.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from graph_trainer.compiler.common import RESHAPE_OPS, DisjointSet, is_collective, set_pass_summary
from graph_trainer.compiler.registry import GraphPass

aten = torch.ops.aten

# reshape views (-> their kind in the stats: "view", "reshape", "_unsafe_view")
_SAME_SHAPE_VIEWS = {op: op._schema.name.split("::")[-1] for op in RESHAPE_OPS}


class _AliasInfo(DisjointSet):
    """Union-find over nodes that may share storage + the set of mutated groups."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        super().__init__()
        mutated: list[torch.fx.Node] = []
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            if node.op == "call_function" and node.target is operator.getitem:
                src = node.args[0]
                if isinstance(src, torch.fx.Node) and _returns_alias(src):
                    self.union(node, src)
                continue
            target = node.target if node.op == "call_function" else None
            if is_collective(node):
                # e.g. wait_tensor returns its input without an alias annotation
                for arg_node in node.all_input_nodes:
                    self.union(node, arg_node)
            elif isinstance(target, torch._ops.OpOverload):
                schema = target._schema
                returns_alias = any(r.alias_info is not None for r in schema.returns)
                for arg_node, arg_schema in _bound_args(node, schema):
                    if arg_schema.alias_info is None:
                        continue
                    if arg_schema.alias_info.is_write:
                        mutated.append(arg_node)
                    if returns_alias:
                        self.union(node, arg_node)
            else:
                # Unknown callable / higher-order op / submodule: assume it may
                # alias and mutate every tensor input.
                for arg_node in node.all_input_nodes:
                    mutated.append(arg_node)
                    self.union(node, arg_node)
        self.mutated_roots = {self.find(n) for n in mutated}

    def is_mutated(self, node: torch.fx.Node) -> bool:
        return self.find(node) in self.mutated_roots


def _returns_alias(node: torch.fx.Node) -> bool:
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in t._schema.returns)
    return node.op != "call_function" or t is not operator.getitem


def _bound_args(node: torch.fx.Node, schema) -> list[tuple[torch.fx.Node, Any]]:
    """(input node, schema argument) pairs, for positional and keyword args."""
    out = []
    for i, a in enumerate(schema.arguments):
        if a.kwarg_only:
            val = node.kwargs.get(a.name)
        elif i < len(node.args):
            val = node.args[i]
        else:
            val = node.kwargs.get(a.name)
        for leaf in torch.utils._pytree.tree_leaves(val):
            if isinstance(leaf, torch.fx.Node):
                out.append((leaf, a))
    return out


def _val(node: Any) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    if not statically_known_true(sym_eq(tuple(a.shape), tuple(b.shape))):
        return False
    # Strides only matter where the size is > 1.
    for size, sa, sb in zip(a.shape, a.stride(), b.stride()):
        if statically_known_true(size <= 1):
            continue
        if not statically_known_true(sa == sb):
            return False
    return True


def _non_mutating_user(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    if user.op != "call_function":
        return False
    if user.target is operator.getitem:
        return True
    if not isinstance(user.target, torch._ops.OpOverload):
        return False
    for arg_node, arg_schema in _bound_args(user, user.target._schema):
        if arg_node is node and arg_schema.alias_info is not None and arg_schema.alias_info.is_write:
            return False
    return True


def _output_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    out: set[torch.fx.Node] = set()
    for node in graph.find_nodes(op="output"):
        for leaf in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(leaf, torch.fx.Node):
                out.add(leaf)
    return out


def _removable_kind(node: torch.fx.Node, aliases: _AliasInfo, outputs: set[torch.fx.Node]) -> str | None:
    if node.op != "call_function" or node in outputs or node.kwargs.get("out") is not None:
        return None
    target = node.target
    if target not in _SAME_SHAPE_VIEWS and target not in (
        aten.alias.default,
        aten.clone.default,
        aten.detach.default,
    ):
        return None
    if not node.args:
        return None
    src = node.args[0]
    src_val, val = _val(src), _val(node)
    if src_val is None or val is None:
        return None
    if aliases.is_mutated(node) or aliases.is_mutated(src):
        return None
    if not _same_layout(src_val, val):
        return None
    if target in _SAME_SHAPE_VIEWS:
        return _SAME_SHAPE_VIEWS[target]
    if target is aten.alias.default:
        return "alias"
    if target is aten.clone.default:
        mf = node.kwargs.get("memory_format")
        if mf not in (None, torch.preserve_format):
            return None
        if src_val.is_conj() or src_val.is_neg() or src_val.is_complex():
            return None
        return "clone"
    # detach
    if all(_non_mutating_user(u, node) for u in node.users):
        return "detach"
    return None


def remove_noop_views_pass(gm: torch.fx.GraphModule, example_inputs=None) -> torch.fx.GraphModule:
    """Replace no-op views / aliases / clones / detaches by their input.

    See the module docstring for the exact conditions. Modifies ``gm`` in place,
    recompiles it and records the number removed per kind in the pass stats
    (``view``, ``reshape``, ``_unsafe_view``, ``alias``, ``clone``, ``detach``).
    """
    aliases = _AliasInfo(gm.graph)
    outputs = _output_nodes(gm.graph)
    removed: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        kind = _removable_kind(node, aliases, outputs)
        if kind is None:
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        removed[kind] += 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    total = sum(removed.values())
    detail = ", ".join(f"{n} {k}" for k, n in sorted(removed.items()))
    set_pass_summary(
        gm,
        f"removed {total} no-op node(s)" + (f" ({detail})" if detail else ""),
        removed=total,
        **{f"removed_{k}": n for k, n in removed.items()},
    )
    return gm


PASS = GraphPass(name="remove_noop_views", fn=remove_noop_views_pass, enabled=lambda ctx: True, in_memory_trial=True)
