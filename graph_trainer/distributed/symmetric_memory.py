"""Symmetric memory for the TP group, and the one fused op of ``async_tp`` that torch lacks.

:func:`fused_matmul_sum_reduce_scatter` (``graph_trainer_symm_mem::fused_matmul_reduce_scatter``): torch's
``symm_mem.fused_matmul_reduce_scatter`` for a reduce-scatter of a *sum* of matmul outputs (the input gradients of
q/k/v and of w1/w3 under TP). torch's op takes one matmul; summing before it (``cat`` of the operands) would round
differently and move the operands once more. On CUDA each rank's rows are produced as the traced graph computes them,
``mm`` then ``add_`` per summand in the graph's order, inside torch's ``_pipelined_produce_and_all2all`` (the
pipeline torch's own op uses, with the same split of ``A`` into per-rank row chunks); elsewhere the reference: the
sum, then a functional reduce-scatter. Its op name is torch's, so every reader of the fused ops (projection,
collectives) counts it as one."""

import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d

#: The namespace of :func:`fused_matmul_sum_reduce_scatter` (a collective namespace: ``compiler/collectives.py``).
NAMESPACE = "graph_trainer_symm_mem"


def enable_symmetric_memory(group_name: str, workspace_bytes: int) -> tuple[bool, str]:
    """Enable symmetric memory for the TP group ``group_name`` with ``workspace_bytes`` of workspace (a rendezvous:
    every TP rank calls it). Returns ``(ok, note)``: whether it is usable, and whether multicast is or why not."""
    if not dist.is_available() or not dist.is_nccl_available():
        return False, "NCCL is not available"
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _SymmetricMemory

        with warnings.catch_warnings():  # deprecated (no longer needed) in newer torch
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        symm_mem.get_symm_mem_workspace(group_name, min_size=workspace_bytes)
    except Exception as e:  # no P2P access, driver API, allocation ...
        return False, f"symmetric memory unavailable for the TP group ({type(e).__name__}: {str(e)[:200]})"
    try:
        multicast = _SymmetricMemory.has_multicast_support(DeviceType.CUDA, torch.cuda.current_device())
    except Exception:
        return True, "multicast support unknown"
    return True, "multicast on" if multicast else "multicast off: P2P copy-engine path"


def setup_symmetric_memory(group_name: str, workspace_bytes: int) -> None:
    """The pass's process setup: :func:`enable_symmetric_memory`. Raises RuntimeError where it is unusable."""
    ok, note = enable_symmetric_memory(group_name, workspace_bytes)
    if not ok:
        raise RuntimeError(note)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a.flatten(0, -2), b).view(*a.shape[:-1], b.shape[1])


@torch.library.custom_op(f"{NAMESPACE}::fused_matmul_reduce_scatter", mutates_args=(),
                         tags=(torch._C.Tag.needs_fixed_stride_order,))
def fused_matmul_sum_reduce_scatter(As: list[torch.Tensor], Bs: list[torch.Tensor], reduce_op: str, scatter_dim: int,
                                    group_name: str) -> torch.Tensor:
    """``reduce_scatter(((A_0 @ B_0 + A_1 @ B_1) + A_2 @ B_2) + ..., reduce_op, scatter_dim, group_name)``.

    ``As[i]``: ``[*lead, K_i]`` (``lead`` the same for all), ``Bs[i]``: ``[K_i, N]``, one dtype; the sum is taken in
    list order, each addition rounded to that dtype as ``aten.add`` does. Returns ``[*lead, N]`` with ``lead[scatter_dim]``
    divided by the group's size (``scatter_dim`` < ``len(lead)``). ``reduce_op``: ``"sum"`` or ``"avg"``. This body is
    the reference (every device but CUDA); the CUDA kernel micro-pipelines it (module docstring)."""
    total = _product(As[0], Bs[0])
    for a, b in zip(As[1:], Bs[1:]):
        total = total + _product(a, b)
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(total, reduce_op, scatter_dim, group_name))


@fused_matmul_sum_reduce_scatter.register_fake
def _(As, Bs, reduce_op, scatter_dim, group_name):
    shape = [*As[0].shape[:-1], Bs[0].shape[1]]
    shape[scatter_dim] //= c10d._get_group_size_by_name(group_name)
    return As[0].new_empty(shape)


def pipelined_sum_reduce_scatter(As: list[torch.Tensor], Bs: list[torch.Tensor], reduce_op: str, scatter_dim: int,
                                  group_name: str, produce_and_all2all: Callable) -> torch.Tensor:
    """:func:`fused_matmul_sum_reduce_scatter` as torch's ``_fused_matmul_reduce_scatter_impl`` computes one matmul
    (scatter dim not last): ``A``'s rows (``scatter_dim`` moved first) split into one chunk per rank, each chunk's
    summed products exchanged by ``produce_and_all2all(chunk_producer(rank, out), output, group_name)`` (CUDA: torch's
    ``_pipelined_produce_and_all2all``), then reduced. Raises ``ValueError`` for a ``reduce_op`` but sum and avg."""
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op must be sum or avg; got {reduce_op!r}")
    g = c10d._get_group_size_by_name(group_name)
    rows = [a.movedim(scatter_dim, 0).flatten(0, -2).chunk(g) for a in As]

    def produce(rank: int, out: torch.Tensor) -> None:
        torch.mm(rows[0][rank], Bs[0], out=out)
        for r, b in zip(rows[1:], Bs[1:]):
            out.add_(torch.mm(r[rank], b))

    lead = list(As[0].movedim(scatter_dim, 0).shape[:-1])
    stacked = As[0].new_empty(math.prod(lead), Bs[0].shape[1])
    produce_and_all2all(produce, stacked, group_name)
    parts = stacked.view(g, lead[0] // g, *lead[1:], -1).movedim(1, scatter_dim + 1).movedim(0, scatter_dim)
    return parts.sum(dim=scatter_dim) if reduce_op == "sum" else parts.mean(dim=scatter_dim)


@fused_matmul_sum_reduce_scatter.register_kernel("cuda")
def _(As, Bs, reduce_op, scatter_dim, group_name):
    from torch.distributed._symmetric_memory import _pipelined_produce_and_all2all

    with torch.profiler.record_function("fused_matmul_sum_reduce_scatter"):
        return pipelined_sum_reduce_scatter(As, Bs, reduce_op, scatter_dim, group_name, _pipelined_produce_and_all2all)
