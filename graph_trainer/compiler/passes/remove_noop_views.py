"""Remove no-op view / copy / detach nodes from the traced training-step graph.

Matches (on the fake values in ``meta["val"]``): a ``view`` / ``reshape`` / ``_unsafe_view`` or ``alias`` with its
input's shape, strides and dtype; such a ``clone`` (not of a lazily conjugated / negated view); a ``detach`` whose users
do not mutate it. Never a graph output, nor a node in an alias group that some op mutates. Each match is replaced by its
input. A ``cat`` that rewrites a contiguous tensor's bytes in their own order (:func:`identity_cat_source`) becomes
``view(x, shape)``. Not Inductor's ``remove_noop_ops``: it assumes a functional graph."""

import operator
from collections import Counter
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from graph_trainer.compiler.collectives import is_collective
from graph_trainer.compiler.graph_values import DisjointSet, tensor_val
from graph_trainer.compiler.node_meta import custom_meta, set_pass_summary
from graph_trainer.compiler.ops import RESHAPE_OPS, arg_of, aten, is_getitem, op_name
from graph_trainer.compiler.registry import GraphPass

_KINDS = {op: op_name(op) for op in RESHAPE_OPS | {aten.alias.default, aten.clone.default, aten.detach.default}}


class _AliasInfo(DisjointSet):
    """Union-find over the nodes that may share storage, and the mutated groups."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        super().__init__()
        mutated: list[torch.fx.Node] = []
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            if is_getitem(node):
                src = node.args[0]
                if isinstance(src, torch.fx.Node) and _returns_alias(src):
                    self.union(node, src)
                continue
            target = node.target if node.op == "call_function" else None
            if is_collective(node):  # wait_tensor returns its input without an alias annotation
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
            else:  # unknown callable / higher-order op: may alias and mutate every input
                for arg_node in node.all_input_nodes:
                    mutated.append(arg_node)
                    self.union(node, arg_node)
        self.mutated_roots = {self.find(n) for n in mutated}

    def is_mutated(self, node: torch.fx.Node) -> bool:
        return self.find(node) in self.mutated_roots


def _returns_alias(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in node.target._schema.returns)
    return node.op != "call_function" or node.target is not operator.getitem


def _bound_args(node: torch.fx.Node, schema) -> list[tuple[torch.fx.Node, Any]]:
    """(input node, schema argument) pairs, for positional and keyword args."""
    vals = [(node.args[i] if not a.kwarg_only and i < len(node.args) else node.kwargs.get(a.name), a)
            for i, a in enumerate(schema.arguments)]
    return [(leaf, a) for val, a in vals for leaf in torch.utils._pytree.tree_leaves(val)
            if isinstance(leaf, torch.fx.Node)]


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    if not statically_known_true(sym_eq(tuple(a.shape), tuple(b.shape))):
        return False
    return all(statically_known_true(size <= 1) or statically_known_true(sa == sb)  # strides matter where size > 1
               for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


def _non_mutating_user(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    if user.op != "call_function":
        return False
    if user.target is operator.getitem:
        return True
    if not isinstance(user.target, torch._ops.OpOverload):
        return False
    return not any(a is node and s.alias_info is not None and s.alias_info.is_write
                   for a, s in _bound_args(user, user.target._schema))


def _leading_ones(val: torch.Tensor, dim: int) -> bool:
    return all(statically_known_true(size == 1) for size in val.shape[:dim])


def identity_cat_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` when ``node`` is ``aten.cat(pieces, dim)`` whose pieces are every output of one ``split`` /
    ``split_with_sizes`` of a contiguous ``x``, in order, with only size-1 dimensions before the split dimension of
    ``x`` and before ``dim`` of each piece (so the cat holds ``x``'s bytes in the same order). Else None."""
    if node.op != "call_function" or node.target is not aten.cat.default or not node.args:
        return None
    pieces, dim = node.args[0], arg_of(node, 1, "dim", 0)
    if not pieces or not all(isinstance(p, torch.fx.Node) and p.target is operator.getitem for p in pieces):
        return None
    split = pieces[0].args[0]
    if not (isinstance(split, torch.fx.Node) and split.target in (aten.split.Tensor, aten.split_with_sizes.default)
            and isinstance(split.meta.get("val"), (list, tuple))):
        return None
    if [p.args for p in pieces] != [(split, i) for i in range(len(split.meta["val"]))]:
        return None
    x, out = split.args[0], tensor_val(node)
    x_val, split_dim = tensor_val(x), arg_of(split, 2, "dim", 0)
    if x_val is None or out is None or x_val.dtype != out.dtype or not x_val.is_contiguous():
        return None
    split_dim, dim = split_dim % x_val.dim(), dim % out.dim()
    if not _leading_ones(x_val, split_dim):
        return None
    return x if all(tensor_val(p) is not None and _leading_ones(tensor_val(p), dim) for p in pieces) else None


def _removable_kind(node: torch.fx.Node, aliases: _AliasInfo, outputs: set[torch.fx.Node]) -> str | None:
    kind = _KINDS.get(node.target) if node.op == "call_function" and node.args else None
    if node.target is aten.cat.default:
        src = identity_cat_source(node)
        ok = src is not None and node not in outputs and not aliases.is_mutated(node) and not aliases.is_mutated(src)
        return "cat" if ok else None
    if kind is None or node in outputs or node.kwargs.get("out") is not None:
        return None
    src = node.args[0]
    src_val, val = tensor_val(src), tensor_val(node)
    if src_val is None or val is None:
        return None
    if aliases.is_mutated(node) or aliases.is_mutated(src) or not _same_layout(src_val, val):
        return None
    if kind == "clone" and (node.kwargs.get("memory_format") not in (None, torch.preserve_format)
                            or src_val.is_conj() or src_val.is_neg() or src_val.is_complex()):
        return None
    if kind == "detach" and not all(_non_mutating_user(u, node) for u in node.users):
        return None
    return kind


def _cat_to_view(graph: torch.fx.Graph, cat: torch.fx.Node) -> None:
    """Replace ``cat`` (:func:`identity_cat_source` holds) by ``view(x, cat's shape)`` with the cat's fake value
    (a fake view would not pickle); its pieces and their ``split`` go too where nothing else reads them."""
    pieces = list(cat.args[0])
    split = pieces[0].args[0]  # split(x): identity_cat_source's x is its input
    with graph.inserting_before(cat):
        view = graph.call_function(aten.view.default, (split.args[0], list(cat.meta["val"].shape)))
    view.meta.update(custom=dict(custom_meta(cat)), val=cat.meta["val"])
    cat.replace_all_uses_with(view)
    graph.erase_node(cat)
    for dead in [*pieces, split]:
        if not dead.users:
            graph.erase_node(dead)


def remove_noop_views_pass(gm: torch.fx.GraphModule, example_inputs=None) -> torch.fx.GraphModule:
    """Replace no-op views / aliases / clones / detaches by their input (module docstring), in place. Stats: ``removed``
    and ``removed_<kind>`` (``view``, ``reshape``, ``_unsafe_view``, ``alias``, ``clone``, ``detach``, ``cat``)."""
    aliases = _AliasInfo(gm.graph)
    outputs = {a for o in gm.graph.find_nodes(op="output") for a in o.all_input_nodes}
    removed: Counter[str] = Counter()
    for node in list(gm.graph.nodes):
        if (kind := _removable_kind(node, aliases, outputs)) is None:
            continue
        if kind == "cat":
            _cat_to_view(gm.graph, node)
        else:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        removed[kind] += 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    total = sum(removed.values())
    detail = ", ".join(f"{n} {k}" for k, n in sorted(removed.items()))
    set_pass_summary(gm, f"removed {total} no-op node(s)" + (f" ({detail})" if detail else ""), removed=total,
                     **{f"removed_{k}": n for k, n in removed.items()})
    return gm


PASS = GraphPass(name="remove_noop_views", fn=remove_noop_views_pass, enabled=lambda ctx: True, in_memory_trial=True)
