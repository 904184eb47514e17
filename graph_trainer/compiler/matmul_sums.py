"""Matmuls of a traced graph and sums of them merged into one matmul, for ``async_tp``.

A sum ``add(t_1, add(t_2, t_3))`` (any nesting) of matmuls ``t_i = post_i(mm(pre_i(A_i), B_i))`` of one shape and
dtype (the backward's input gradients of the q/k/v and w1/w3 projections) becomes one
``post(mm(pre(cat([A_1, .., A_n], -1)), cat([B_1, .., B_n], 0)))``, so that TP's reduce-scatter of it pairs with one
matmul: the same products, summed inside one matmul's reduction (not bitwise equal to the adds)."""

import math
from dataclasses import dataclass
from typing import Any

import torch

from graph_trainer import NUMERICS_KEY
from graph_trainer.compiler.graph_values import shape_of, tensor_val
from graph_trainer.compiler.node_meta import custom_meta, phase_of
from graph_trainer.compiler.ops import RESHAPE_OPS, arg_of, aten, is_call

MM_OPS = frozenset({aten.mm.default})


@dataclass
class Matmul:
    """``post(mm(pre(A), B))``: ``pre`` / ``post`` reshape to and from 2-D (None: none)."""

    mm: torch.fx.Node
    a: torch.fx.Node
    b: torch.fx.Node
    pre: torch.fx.Node | None = None
    post: torch.fx.Node | None = None


@dataclass
class MatmulSum:
    """``adds[-1] = add(...)`` of the matmuls ``terms`` (left to right), through the inner ``adds``."""

    terms: list[Matmul]
    adds: list[torch.fx.Node]


def matmul_of(x: torch.fx.Node) -> Matmul | None:
    """``x`` as a matmul: ``mm(A, B)`` (2-D), or ``view(mm(view(A, [M, K]), B), [*A.shape[:-1], N])``
    whose ``mm`` only the outer view reads (``M = prod(A.shape[:-1])``); else None."""
    if is_call(x, MM_OPS):
        return Matmul(x, x.args[0], x.args[1])
    if not is_call(x, RESHAPE_OPS) or not is_call(x.args[0], MM_OPS) or len(x.args[0].users) != 1:
        return None
    mm, pre = x.args[0], x.args[0].args[0]
    a_shape = shape_of(pre.args[0]) if is_call(pre, RESHAPE_OPS) else None
    if a_shape is None or len(a_shape) < 2 or shape_of(pre) != (math.prod(a_shape[:-1]), a_shape[-1]):
        return None
    if shape_of(x) != (*a_shape[:-1], shape_of(mm)[1]):
        return None
    return Matmul(mm, pre.args[0], mm.args[1], pre=pre, post=x)


def _terms(n: torch.fx.Node, root: torch.fx.Node, adds: list, terms: list) -> str | None:
    """Collect the adds and matmul terms under ``n`` (left to right); returns why not, or None."""
    if is_call(n, {aten.add.Tensor}) and arg_of(n, 2, "alpha", 1) == 1 and (n is root or len(n.users) == 1):
        for arg in n.args[:2]:
            if not isinstance(arg, torch.fx.Node):
                return "a term is not a tensor"
            if (why := _terms(arg, root, adds, terms)) is not None:
                return why
        adds.append(n)
        return None
    if (mm := matmul_of(n)) is None:
        return "a term is not a matmul output"
    if len(n.users) != 1 or (mm.pre is None and len(mm.mm.users) != 1):
        return "a matmul output has other users"
    terms.append(mm)
    return None


def matmul_sum_of(x: torch.fx.Node) -> tuple[MatmulSum | None, str | None]:
    """``(sum, None)`` when ``x`` is an ``add`` (nested adds read once, alpha 1) of at least two matmuls
    (:func:`matmul_of`) each read only by its add, all of ``x``'s phase, shape and dtype (operands too), all 2-D or
    all higher-dimensional; ``(None, why not)`` otherwise. Reads only."""
    adds: list[torch.fx.Node] = []
    terms: list[Matmul] = []
    if not is_call(x, {aten.add.Tensor}):
        return None, "not a sum"
    if (why := _terms(x, x, adds, terms)) is not None:
        return None, why
    val = tensor_val(x)
    if val is None or any(tensor_val(n) is None for t in terms for n in (t.a, t.b, t.post or t.mm)):
        return None, "no fake values"
    outs = [tensor_val(t.post or t.mm) for t in terms]
    if any(tuple(o.shape) != tuple(val.shape) for o in outs):
        return None, "terms of different shapes"
    if any(tensor_val(n).dtype != val.dtype for t in terms for n in (t.a, t.b, t.post or t.mm)):
        return None, "terms of different dtypes"
    if len({t.pre is None for t in terms}) != 1:
        return None, "2-D and higher-dimensional terms"
    if any(phase_of(t.mm) != phase_of(x) for t in terms):
        return None, "a matmul of another phase"
    return MatmulSum(terms, adds), None


def merge_matmul_sum(graph: torch.fx.Graph, s: MatmulSum, fake_mode: Any) -> Matmul:
    """Replace the sum ``s`` by one matmul at its last add: ``A = cat([A_i], -1)`` (``[*lead, sum K_i]``), ``B =
    cat([B_i], 0)`` (``[sum K_i, N]``), ``mm(view(A, [M, sum K_i]), B)`` viewed as ``[*lead, N]`` (2-D: no views).
    Erases the adds and the terms' matmuls (and views nothing else reads); returns the new matmul."""
    root, terms = s.adds[-1], s.terms
    a_parts = [t.pre.args[0] if t.pre is not None else t.mm.args[0] for t in terms]  # as now in the graph
    b_parts = [t.mm.args[1] for t in terms]
    lead, k = shape_of(a_parts[0])[:-1], sum(shape_of(p)[-1] for p in a_parts)
    with graph.inserting_before(root):
        a = _new(graph, fake_mode, aten.cat.default, (a_parts, len(lead)), root)
        b = _new(graph, fake_mode, aten.cat.default, (b_parts, 0), root)
        pre = post = None
        if terms[0].pre is not None:
            pre = _new(graph, fake_mode, aten.view.default, (a, [math.prod(lead), k]), root)
        mm = _new(graph, fake_mode, aten.mm.default, (a if pre is None else pre, b), root,
                  key_from=root if pre is None else None)
        if pre is not None:
            post = _new(graph, fake_mode, aten.view.default, (mm, list(shape_of(root))), root, root)
    root.replace_all_uses_with(mm if post is None else post)
    old = [*reversed(s.adds), *(t.post for t in terms), *(t.mm for t in terms), *(t.pre for t in terms)]
    for node in dict.fromkeys(n for n in old if n is not None):  # a pre view may be shared
        if not node.users:
            graph.erase_node(node)
    return Matmul(mm, a, b, pre=pre, post=post)


def _new(graph, fake_mode, op, args, like, key_from=None) -> torch.fx.Node:
    """:func:`call_like` with the fake value of ``op`` on ``args``."""
    return call_like(graph, op, args, like, fake_call(fake_mode, op, args), key_from)


def call_like(graph: torch.fx.Graph, target, args, like: torch.fx.Node, val: Any = None, key_from=None,
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


def fake_call(fake_mode, op, args, kwargs=None) -> Any:
    """The fake value of ``op`` on its node arguments' fake values (None without a fake mode)."""
    if fake_mode is None:
        return None
    vals = torch.fx.node.map_arg((args, kwargs or {}), lambda a: a.meta.get("val"))
    with fake_mode:
        return op(*vals[0], **vals[1])
