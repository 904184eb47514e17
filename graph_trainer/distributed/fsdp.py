"""Traceable FSDP: per-parameter sharding whose collectives land inside the traced graph.

SimpleFSDP-style (torchtitan.experiments.simple_fsdp), reduced to what make_fx needs:

* Each parameter is flattened, padded to a multiple of the FSDP degree ``W`` and
  split into ``W`` equal chunks; rank ``r`` keeps chunk ``r`` as a plain fp32
  ``nn.Parameter`` of shape ``[ceil(numel / W)]``. AdamW is elementwise, so running it
  on the shards is the unsharded update; padding elements stay zero.
* In the forward, :class:`_AllGather` casts the shard to the compute dtype (bf16),
  all-gathers it with ``_c10d_functional.all_gather_into_tensor`` and views it as the
  full parameter. Its backward casts the gradient to the reduce dtype (fp32) and
  ``reduce_scatter_tensor``s it with sum over the group (the loss is already divided by
  the global batch's token count, :func:`graph_trainer.model.loss_fn`). Both are functional
  collectives, so make_fx records them as ``_c10d_functional.*`` + ``wait_tensor``
  nodes in the one graph, where passes can bucket and reorder them.

We write this instead of reusing ``torchtitan.experiments.simple_fsdp`` because that
one parametrizes modules with DTensors, which make_fx does not trace as plain
placeholders; here the placeholders are the local shards.

As traced, autograd saves the all-gathered parameters for the backward: one unsharded
bf16 copy of the model per rank for the whole step. The ``reshard_after_forward`` pass
(:mod:`graph_trainer.compiler.passes`) rewires the backward to a second all-gather of each shard,
so the forward copy dies after its last forward use (``--compile.fsdp.keep_last_blocks K``
keeps the forward copy of the last K blocks instead).

HSDP (replicas of an FSDP group) and replicate x TP: :func:`all_reduce_grad` wraps each
placeholder, so the reduce-scattered gradient is then all-reduced (sum) over the replicas,
also as graph nodes.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


# all_gather_tensor / reduce_scatter_tensor are the names torch 2.11 and 2.13 share.
warnings.filterwarnings("ignore", message=".*_functional_collectives.*deprecated", category=FutureWarning)


@dataclass
class ShardSpec:
    """How one parameter is sharded: full ``shape``, ``numel``, and the chunk size."""

    name: str
    shape: torch.Size
    numel: int
    chunk: int  # elements per rank (after padding)


class _AllGather(torch.autograd.Function):
    """shard [chunk] -> full parameter [shape] (forward: all-gather; backward: reduce-scatter sum)."""

    @staticmethod
    def forward(ctx, shard, spec: ShardSpec, group, param_dtype, reduce_dtype):
        ctx.spec, ctx.group, ctx.reduce_dtype = spec, group, reduce_dtype
        x = shard if param_dtype is None else shard.to(param_dtype)
        full = funcol.all_gather_tensor(x, 0, group)
        if isinstance(full, funcol.AsyncCollectiveTensor):
            full = full.wait()
        return full[: spec.numel].view(spec.shape)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        g = grad.reshape(-1)
        if ctx.reduce_dtype is not None:
            g = g.to(ctx.reduce_dtype)
        pad = spec.chunk * dist.get_world_size(ctx.group) - spec.numel
        if pad:
            g = torch.nn.functional.pad(g, (0, pad))
        out = funcol.reduce_scatter_tensor(g, "sum", 0, ctx.group)
        if isinstance(out, funcol.AsyncCollectiveTensor):
            out = out.wait()
        return out, None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    """x -> x (forward); backward: all-reduce (sum) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        out = funcol.all_reduce(grad, "sum", ctx.group)
        if isinstance(out, funcol.AsyncCollectiveTensor):
            out = out.wait()
        return out, None


def all_reduce_grad(t: torch.Tensor, group) -> torch.Tensor:
    """Identity on ``t`` whose backward sums ``t``'s gradient over ``group``: the replicate
    dimension of HSDP / replicate x TP. Applied to a placeholder (an FSDP shard or a TP-local
    parameter, fp32), it puts one ``_c10d_functional.all_reduce`` + ``wait_tensor`` per
    parameter into the traced backward, after the FSDP reduce-scatter that produced the
    shard's gradient (the order of FSDP2's HSDP: reduce-scatter inside a replica, then
    all-reduce across replicas).

    Args:
        t: any tensor (shape, dtype and values unchanged; a view of ``t``).
        group: the replicate process group (ranks holding the same shard).
    """
    return _AllReduceGrad.apply(t, group)


def all_gather_param(shard, spec, group, param_dtype=None, reduce_dtype=torch.float32):
    """Differentiable all-gather of one shard into the full parameter (see module docstring)."""
    return _AllGather.apply(shard, spec, group, param_dtype, reduce_dtype)


def shard_tensors(
    names: list[str], tensors: list[torch.Tensor], group
) -> tuple[list[ShardSpec], list[torch.nn.Parameter]]:
    """Shard each tensor (flattened, zero-padded to a multiple of W) over ``group``.

    Args:
        names: FQNs, for the specs.
        tensors: the full tensors (with TP: this rank's TP-local tensors), equal on
            every rank of ``group``.
        group: the FSDP process group (world size W, this rank r).

    Returns:
        ``(specs, shards)``: per tensor its :class:`ShardSpec` and the local shard
        ``nn.Parameter`` of shape ``[ceil(numel / W)]`` (same dtype, fresh storage).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    specs, shards = [], []
    for name, p in zip(names, tensors):
        chunk = math.ceil(p.numel() / world)
        flat = p.detach().reshape(-1)
        pad = chunk * world - p.numel()
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        shards.append(torch.nn.Parameter(flat[rank * chunk : (rank + 1) * chunk].clone()))
        specs.append(ShardSpec(name, p.shape, p.numel(), chunk))
    return specs, shards


def free_parameters(model: torch.nn.Module, names: list[str]) -> None:
    """Replace the named parameters of ``model`` by empty meta tensors of the same shape:
    the traced step re-parametrizes the module with its placeholders, so the original
    (full, or TP DTensor) copies are no longer needed."""
    for name in names:
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        p = mod._parameters[attr]
        mod._parameters[attr] = torch.nn.Parameter(
            torch.empty(p.shape, device="meta", dtype=p.dtype), requires_grad=True
        )


def shard_parameters(model: torch.nn.Module, group) -> tuple[list[ShardSpec], list[torch.nn.Parameter]]:
    """Shard every trainable parameter of ``model`` over ``group`` (see :func:`shard_tensors`)
    and free the model's own copies (:func:`free_parameters`).

    Args:
        model: a materialized model (same values on every rank).
        group: the FSDP process group (world size W, this rank r).

    Returns:
        ``(specs, shards)``: per parameter, its :class:`ShardSpec` and the local fp32
        shard ``nn.Parameter`` of shape ``[ceil(numel / W)]``.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    specs, shards = shard_tensors([n for n, _ in named], [p for _, p in named], group)
    free_parameters(model, [n for n, _ in named])
    return specs, shards


class ShardedParams(torch.nn.Module):
    """Holds this rank's shards as parameters, for torchtitan's optimizer builder and for
    checkpointing.

    The shards live in a submodule named ``rank<r>of<W>`` (parameter FQNs like
    ``rank0of2.shards.3``): the state-dict keys differ between ranks, so DCP saves
    every rank's part instead of de-duplicating equal keys as replicated tensors, and a
    checkpoint saved with another FSDP degree cannot be loaded by mistake.
    """

    def __init__(self, specs: list[ShardSpec], shards: list[torch.nn.Parameter], rank: int = 0, world: int = 1):
        super().__init__()
        self.specs = specs
        self.names = [s.name for s in specs]
        self.key = f"rank{rank}of{world}"
        holder = torch.nn.Module()
        holder.shards = torch.nn.ParameterList(shards)
        self.add_module(self.key, holder)

    @property
    def shards(self) -> torch.nn.ParameterList:
        return getattr(self, self.key).shards


def sharded_grad_norm_(
    shards: list[torch.nn.Parameter], max_norm: float, group=None, weights: list[float] | None = None
) -> torch.Tensor:
    """Clip gradients by the global L2 norm of the (unsharded) gradient; returns the norm.

    The norm is ``sqrt(all_reduce_sum(sum_i w_i * ||g_i||^2))`` over ``group`` (default:
    the world). ``weights[i]`` (default 1) corrects for tensors held identically by
    several ranks of ``group``: with TP, a TP-replicated parameter (norm weights under
    sequence parallel) has weight ``1 / tp``; FSDP shards and TP shards have 1.
    Padding contributes zero. With all weights 1 the rounding is that of
    ``torch.nn.utils.get_total_norm`` on FSDP2's DTensor gradients (DTensor's partial-norm
    reduction of the stacked per-tensor norms: squares summed over ``group`` as one vector,
    ``** 0.5``, then their 2-norm), so the traced FSDP / HSDP step reports eager's norm bitwise.
    """
    grads = [s.grad for s in shards if s.grad is not None]
    # per-tensor norms first (torch's accurate reduction), as torch.nn.utils.get_total_norm
    if not grads:
        local = torch.zeros(())
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local.sqrt()
    elif weights is None or all(w == 1 for w in weights):
        sq = torch.stack(torch._foreach_norm(grads)) ** 2
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
        total = torch.linalg.vector_norm(sq**0.5)
    else:
        sq = torch.stack(torch._foreach_norm(grads)).pow(2)
        w = [wi for s, wi in zip(shards, weights) if s.grad is not None]
        local = (sq * torch.tensor(w, dtype=sq.dtype, device=sq.device)).sum()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local.sqrt()
    clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, clip)
    return total
