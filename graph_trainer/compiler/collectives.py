"""Collectives and their waits: which nodes communicate, their kind and group, the keep-alive :func:`hold`."""

from collections.abc import Callable, Container

import torch

from graph_trainer.compiler.graph_values import tensor_val
from graph_trainer.compiler.ops import CAST_OPS, VIEW_OPS, arg_of, only_user, op_name, op_namespace

#: Namespaces of collective / communication ops: never removed as dead code, never recomputed, never put inside an
#: Inductor region. ``symm_mem``: the fused collective-matmul ops of ``async_tp``, which communicate inside the op.
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d",
                                   "_dtensor", "symm_mem"})
_FUSED_COLLECTIVE_KINDS = frozenset({"fused_all_gather_matmul", "fused_matmul_reduce_scatter"})
_WAITS = (torch.ops._c10d_functional.wait_tensor, torch.ops._c10d_functional.wait_tensor.default)
_CHAIN_OPS = VIEW_OPS | CAST_OPS | frozenset(_WAITS)  # of shard_chain


def is_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a collective / communication op (``wait_tensor`` included)."""
    return node.op == "call_function" and op_namespace(node.target) in COLLECTIVE_NAMESPACES


def collective_kind(node: torch.fx.Node) -> str | None:
    """The op name of a collective's issue node (``"all_reduce"`` ...) or fused ``symm_mem`` op; else None."""
    if not is_collective(node):
        return None
    namespace, name = op_namespace(node.target), op_name(node.target)
    if namespace == "symm_mem":
        return name if name in _FUSED_COLLECTIVE_KINDS else None
    return name if namespace == "_c10d_functional" and name != "wait_tensor" else None


def is_wait(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a functional collective's ``wait_tensor`` (input: the issue node)."""
    return node.op == "call_function" and node.target in _WAITS


def sole_wait(issue: torch.fx.Node) -> torch.fx.Node | None:
    """The ``wait_tensor`` of ``issue`` when it is ``issue``'s only user, else None."""
    return user if (user := only_user(issue)) is not None and is_wait(user) else None


def on_cpu(issue: torch.fx.Node) -> bool:
    """Whether the collective ``issue`` communicates a CPU tensor (gloo): its first argument's fake value is on CPU."""
    val = tensor_val(issue.args[0]) if issue.args else None
    return val is not None and val.device.type == "cpu"


def group_name_of(node: torch.fx.Node) -> str | None:
    """The ``group_name`` argument of an all-gather or reduce-scatter issue node, else None."""
    index = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 3}.get(collective_kind(node))
    return None if index is None else arg_of(node, index, "group_name")


def hold(x, *keep_alive):
    """Identity on ``x``; ``keep_alive`` (an in-flight collective's inputs) lives until this call."""
    return x


def strip_holds(gm: torch.fx.GraphModule) -> int:
    """Replace every :func:`hold` node by its first argument; returns how many."""
    holds = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is hold]
    for node in holds:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    if holds:
        gm.recompile()
    return len(holds)


def shard_chain(all_gather: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The views / casts / waits from a placeholder to ``all_gather``'s input, earliest first; None if none."""
    chain = []
    cur = all_gather.args[0] if all_gather.args else None
    while isinstance(cur, torch.fx.Node) and cur.op == "call_function" and cur.target in _CHAIN_OPS:
        chain.append(cur)
        cur = cur.args[0] if cur.args else None
    return chain[::-1] if isinstance(cur, torch.fx.Node) and cur.op == "placeholder" else None


def read_through(node: torch.fx.Node, views: Container,
                 where: Callable[[torch.fx.Node], bool] | None = None) -> list[torch.fx.Node]:
    """``node`` and its users, transitively, that are a wait, a :func:`hold` or in ``views`` (and pass ``where``)."""
    out, stack = [node], [node]
    while stack:
        for u in stack.pop().users:
            if u not in out and (is_wait(u) or u.target is hold or u.target in views) and (where is None or where(u)):
                out.append(u)
                stack.append(u)
    return out
