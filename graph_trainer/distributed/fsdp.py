"""Traceable FSDP: per-parameter sharding whose collectives land inside the traced graph.

SimpleFSDP-style (docs/design.md, "Several ranks"): rank ``r`` keeps chunk ``r`` of each flattened, zero-padded
parameter as a plain fp32 ``nn.Parameter``; :func:`all_gather_param` gathers it in the compute dtype, its backward
reduce-scatters the gradient (sum) in the reduce dtype, both as ``_c10d_functional`` nodes of the one graph. Own code
because ``torchtitan.experiments.simple_fsdp``'s DTensor parameters are no plain placeholders for make_fx."""

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_c10d = torch.ops._c10d_functional


@dataclass
class ShardSpec:
    """How one parameter is sharded: full ``shape``, ``numel``, and ``chunk`` elements per rank."""

    name: str
    shape: torch.Size
    numel: int
    chunk: int


class _AllGather(torch.autograd.Function):
    """shard [chunk] -> full parameter [shape] (forward: all-gather; backward: reduce-scatter sum)."""

    @staticmethod
    def forward(ctx, shard, spec: ShardSpec, group, param_dtype, reduce_dtype):
        ctx.spec, ctx.group, ctx.reduce_dtype = spec, group, reduce_dtype
        x = shard if param_dtype is None else shard.to(param_dtype)
        full = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, dist.get_world_size(group), group.group_name))
        return full[: spec.numel].view(spec.shape)

    @staticmethod
    def backward(ctx, grad):
        spec, world = ctx.spec, dist.get_world_size(ctx.group)
        g = grad.reshape(-1) if ctx.reduce_dtype is None else grad.reshape(-1).to(ctx.reduce_dtype)
        if pad := spec.chunk * world - spec.numel:
            g = torch.nn.functional.pad(g, (0, pad))
        out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(g, "sum", world, ctx.group.group_name))
        return out, None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    """x -> x (forward); backward: all-reduce (sum) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _c10d.wait_tensor(_c10d.all_reduce(grad, "sum", ctx.group.group_name)), None


def all_reduce_grad(t: torch.Tensor, group) -> torch.Tensor:
    """A view of ``t`` whose backward sums the gradient over the replicate ``group`` (HSDP /
    replicate x TP): applied to a placeholder, one all-reduce per parameter in the traced
    backward, after the FSDP reduce-scatter (FSDP2's HSDP order)."""
    return _AllReduceGrad.apply(t, group)


def all_gather_param(shard, spec, group, param_dtype=None, reduce_dtype=torch.float32):
    """Differentiable all-gather of one shard into the full parameter (module docstring)."""
    return _AllGather.apply(shard, spec, group, param_dtype, reduce_dtype)


def shard_tensors(names: list[str], tensors: list[torch.Tensor], group) -> tuple[list[ShardSpec], list]:
    """Shard each tensor (equal on every rank of ``group``) over ``group``: per tensor its
    :class:`ShardSpec` and this rank's ``nn.Parameter`` of shape ``[ceil(numel / W)]`` (fresh storage)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    specs, shards = [], []
    for name, p in zip(names, tensors):
        chunk = math.ceil(p.numel() / world)
        flat = p.detach().reshape(-1)
        if pad := chunk * world - p.numel():
            flat = torch.nn.functional.pad(flat, (0, pad))
        shards.append(torch.nn.Parameter(flat[rank * chunk : (rank + 1) * chunk].clone()))
        specs.append(ShardSpec(name, p.shape, p.numel(), chunk))
    return specs, shards


def free_parameters(model: torch.nn.Module, names: list[str]) -> None:
    """Replace the named parameters of ``model`` by meta tensors of the same shape (the traced
    step re-parametrizes the module with its placeholders)."""
    for name in names:
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        p = mod._parameters[attr]
        mod._parameters[attr] = torch.nn.Parameter(torch.empty(p.shape, device="meta", dtype=p.dtype))


@dataclass
class Fsdp2Layout:
    """Where the eager baseline's FSDP2 keeps one parameter: ``placements`` on its mesh, the global
    ``shape`` and ``stride``, and this rank's ``local_shape``."""

    placements: tuple
    shape: torch.Size
    stride: tuple
    local_shape: torch.Size


def fsdp2_layout(tp_local: torch.Tensor, shape: torch.Size, stride: tuple, tp_placements: tuple, shard: int,
                 replicate: int) -> Fsdp2Layout | None:
    """How ``fully_shard`` over ``shard`` ranks (HSDP: ``replicate`` replicas) lays out a parameter of global ``shape``
    / ``stride`` with TP-local tensor ``tp_local`` (``tp_placements``; ``()`` without TP): ``Replicate()`` on the
    replicas, dim-0 chunks (``_StridedShard`` under TP on dim 0), TP's placement. None where this rank's flat shard is
    not FSDP2's chunk (dim 0 not a multiple of ``shard``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if tp_local.dim() == 0 or tp_local.shape[0] % shard:
        return None
    fsdp_dim: Any = Shard(0)
    if tp_placements and isinstance(tp_placements[0], Shard) and tp_placements[0].dim == 0:
        fsdp_dim = _StridedShard(0, split_factor=shape[0] // tp_local.shape[0])  # TP's degree
    placements = ((Replicate(),) if replicate > 1 else ()) + (fsdp_dim,) + tuple(tp_placements)
    local_shape = torch.Size((tp_local.shape[0] // shard, *tp_local.shape[1:]))
    return Fsdp2Layout(placements, torch.Size(shape), tuple(stride), local_shape)


class ShardedParams(torch.nn.Module):
    """This rank's shards as parameters under a submodule ``rank<r>of<W>`` (``rank0of2.shards.3``): DCP
    saves every rank's part instead of de-duplicating equal keys and refuses another FSDP degree."""

    def __init__(self, shards: list[torch.nn.Parameter], rank: int = 0, world: int = 1):
        super().__init__()
        holder = torch.nn.Module()
        holder.shards = torch.nn.ParameterList(shards)
        self.add_module(f"rank{rank}of{world}", holder)


@functools.lru_cache(maxsize=8)
def _on_device(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, made once: a blocking host-to-device copy synchronizes the
    stream, so building it every step would make the host wait for the whole backward before it issues the
    clipping and the optimizer step (the GPU idles meanwhile)."""
    return torch.tensor(values, dtype=dtype, device=device)


def sharded_grad_norm_(shards: list[torch.nn.Parameter], max_norm: float, group=None,
                       weights: list[float] | None = None) -> torch.Tensor:
    """Clip gradients by the global L2 norm of the unsharded gradient; returns the norm (0-d fp32):
    ``sqrt(all_reduce_sum(Σ_i w_i · ||g_i||²))`` over ``group`` (default: the world); ``weights`` (default 1):
    ``1 / tp`` for TP-replicated tensors. Eager's norm, not its rounding."""
    grads = [s.grad for s in shards if s.grad is not None]
    if grads and (weights is None or all(w == 1 for w in weights)):
        sq = torch.stack(torch._foreach_norm(grads)) ** 2
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
        total = torch.linalg.vector_norm(sq**0.5)
    else:
        local = torch.zeros(())
        if grads:
            sq = torch.stack(torch._foreach_norm(grads)).pow(2)
            w = [wi for s, wi in zip(shards, weights) if s.grad is not None]
            local = (sq * _on_device(tuple(w), sq.dtype, sq.device)).sum()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total
