"""Op names, op sets and op counts of FX graphs, and small accessors of a node's arguments and users."""

import operator
from collections import Counter
from collections.abc import Container, Iterable
from typing import Any

import torch

aten = torch.ops.aten


def mutated_args(node: torch.fx.Node) -> list[Any]:
    """The arguments an ``OpOverload`` node writes in place (``Tensor(a!)``); None for an optional one not given."""
    schema = node.target._schema
    args = [*node.args, *(node.kwargs.get(a.name) for a in schema.arguments[len(node.args):])]
    return [a for a, spec in zip(args, schema.arguments) if spec.alias_info is not None and spec.alias_info.is_write]


def is_getitem(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``operator.getitem``."""
    return node.op == "call_function" and node.target is operator.getitem


def arg_of(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``node``: positional ``index`` if given so, else the keyword, else ``default``."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def is_call(node: Any, targets: Container[Any]) -> bool:
    """Whether ``node`` is a ``call_function`` node of one of ``targets``."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one user of ``node``, or None (none or several)."""
    return next(iter(node.users)) if len(node.users) == 1 else None


def returns_view(target: Any) -> bool:
    """Whether ``target`` is an op returning an alias of an input it does not write (a view: ``t``, ``split`` ...)."""
    return isinstance(target, torch._ops.OpOverload) and any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def op_name(target: Any) -> str | None:
    """``"mm"`` for ``aten.mm.default`` or ``aten.mm``; None for non-ops."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return None


def packet_name(node: torch.fx.Node) -> str | None:
    """:func:`op_name` of a ``call_function`` OpOverload node, else None."""
    is_op = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    return op_name(node.target) if is_op else None


def op_namespace(target: Any) -> str | None:
    """The namespace of an op (``"aten"``, ``"_c10d_functional"`` ...), None for non-ops."""
    return target.namespace if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else None


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


def fx_graph(gm: Any) -> torch.fx.Graph | None:
    """``gm.graph`` if it is an FX graph, else None (e.g. a compiled callable)."""
    graph = getattr(gm, "graph", None)
    return graph if isinstance(graph, torch.fx.Graph) else None


def op_counts(gm: Any) -> dict[str, int]:
    """Counts of nodes per :func:`target_name` (``{}`` if ``gm`` has no FX graph)."""
    graph = fx_graph(gm)
    return {} if graph is None else dict(sorted(Counter(target_name(n) for n in graph.nodes).items()))


def num_nodes(gm: Any) -> int | None:
    """Number of nodes of ``gm``'s FX graph (None if it has none)."""
    graph = fx_graph(gm)
    return None if graph is None else len(graph.nodes)


#: View ops the passes follow: reshapes, views onto (part of) a buffer (FSDP: ``slice -> view``), permutes and
#: broadcasts, and all of them.
RESHAPE_OPS: frozenset = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
SLICE_OPS: frozenset = frozenset({aten.slice.Tensor, aten.alias.default, aten.as_strided.default})
PERMUTE_OPS: frozenset = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default})
VIEW_OPS: frozenset = RESHAPE_OPS | SLICE_OPS | PERMUTE_OPS | {aten.detach.default}
#: dtype casts: ``aten._to_copy`` (make_fx's ``.to(dtype)``) and ``prims.convert_element_type``.
CAST_OPS: frozenset = frozenset({aten._to_copy.default, torch.ops.prims.convert_element_type.default})


def packet_names(ops: Iterable[Any]) -> frozenset[str]:
    """The packet names of ``ops`` (``{"view"}`` for ``{aten.view.default}``), to match every overload."""
    return frozenset(name for op in ops if (name := op_name(op)) is not None)
