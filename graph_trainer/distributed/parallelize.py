"""Device, process group, ParallelDims / DeviceMesh, and model parallelization: torchtitan's
``parallelize_llama`` for ``eager`` / ``jit`` (:func:`parallelize_eager`), TP plan, AC wrappers and
traceable FSDP for ``aot_fx_trace`` (:func:`distribute_for_trace`)."""

import contextlib
import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import init_device_mesh

from graph_trainer import logger
from graph_trainer.distributed import fake_pg, fsdp
from graph_trainer.errors import UserError
from graph_trainer.trace import trace_train_step

#: ``--training.mixed_precision_*`` values -> dtypes.
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def init_device_and_dist(fake_world: int = 0) -> tuple[torch.device, int, int]:
    """``(device, rank, world_size)`` from torchrun's env, the process group started: ``cuda:LOCAL_RANK`` (NCCL), else
    ``cpu`` (gloo); ``fake_world > 0``: rank 0 of that many on :mod:`.fake_pg`. Raises UserError: more local ranks
    than visible GPUs."""
    if fake_world:  # one process, the first GPU
        world_size, rank, local_rank, local_world = fake_world, 0, 0, 1
    else:
        world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if torch.cuda.is_available():
        if local_world > (n := torch.cuda.device_count()):
            raise UserError(f"NGPU={local_world} processes were started on this node but only {n} CUDA "
                            f"GPU(s) are visible. Set NGPU<={n} (or CUDA_VISIBLE_DEVICES).")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    _patch_torchtitan_device_type(device.type)
    if fake_world and not dist.is_initialized():
        fake_pg.init(fake_world)
    elif world_size > 1 and not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group(backend="nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    return device, rank, world_size


def _patch_torchtitan_device_type(device_type: str) -> None:
    """torchtitan 0.2.2 assumes ``"cuda"`` when no accelerator exists; tell it the truth."""
    for name in ("torchtitan.distributed.parallel_dims", "torchtitan.distributed.utils", "torchtitan.tools.utils"):
        importlib.import_module(name).device_type = device_type


def check_parallel_degrees(cfg, world_size: int, n_heads: int, n_kv_heads: int | None) -> tuple[int, int, int]:
    """The ``(replicate, shard, tp)`` degrees of ``[parallelism]`` for ``world_size`` ranks
    (``data_parallel_shard_degree = -1`` resolved). Raises UserError: degrees whose product is not the world size, a
    TP degree that does not divide the (KV) heads, an FSDP degree larger than the world, or PP, CP, EP; replicas x TP
    without FSDP for the eager / jit baselines (torchtitan's DDP refuses TP)."""
    p = cfg.parallelism
    for name in ("pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree"):
        if getattr(p, name) != 1:
            raise UserError(f"--parallelism.{name}={getattr(p, name)} is not supported by graph_trainer; use 1.")
    tp, rep, shard = p.tensor_parallel_degree, p.data_parallel_replicate_degree, p.data_parallel_shard_degree
    world, name = _world_name(world_size)
    if shard > world_size:
        raise UserError(f"--parallelism.data_parallel_shard_degree={shard} is larger than the world "
                        f"size {world_size} ({name}). Use -1 (the rest) or a divisor of {name}.")
    if tp < 1 or rep < 1 or world_size % (tp * rep) != 0:
        raise UserError(f"tensor_parallel_degree={tp} x data_parallel_replicate_degree={rep} does not divide {world}.")
    shard = world_size // (tp * rep) if shard == -1 else shard
    if tp * rep * shard != world_size:
        raise UserError(f"Parallel degrees multiply to {tp * rep * shard} (replicate {rep} x shard {shard} x "
                        f"TP {tp}) but {world}. Make the product equal {name} (shard -1 = the rest).")
    if rep > 1 and tp > 1 and shard == 1 and cfg.compile.mode in ("eager", "jit"):
        raise UserError(f"--compile.mode {cfg.compile.mode} cannot run replicas x TP without FSDP (torchtitan's DDP "
                        "refuses TP): use --parallelism.data_parallel_shard_degree > 1 (HSDP x TP) or the traced step.")
    for what, h in (("heads", n_heads), ("KV heads", n_kv_heads or n_heads)):
        if h % tp:
            raise UserError(f"tensor_parallel_degree={tp} does not divide the model's {h} {what}.")
    return rep, shard, tp


def _world_name(world_size: int) -> tuple[str, str]:
    """``("NGPU=8", "NGPU")``, or with ``NNODES`` > 1 ``("NNODES x NGPU=2x8=16", "NNODES x NGPU")``."""
    nnodes = os.environ.get("NNODES", "1").strip()
    if nnodes.isascii() and nnodes.isdigit() and int(nnodes) > 1 and world_size % int(nnodes) == 0:
        return f"NNODES x NGPU={nnodes}x{world_size // int(nnodes)}={world_size}", "NNODES x NGPU"
    return f"NGPU={world_size}", "NGPU"


def layout_key(replicate: int, shard: int, tp: int) -> str:
    """The layout a checkpoint records and resume checks, e.g. ``dp_shard2_dp_replicate1_tp1``."""
    return f"dp_shard{shard}_dp_replicate{replicate}_tp{tp}"


def build_parallel_dims(cfg, world_size: int, n_heads: int, n_kv_heads: int | None):
    """torchtitan ``ParallelDims`` of :func:`check_parallel_degrees`."""
    from torchtitan.distributed import ParallelDims

    rep, shard, tp = check_parallel_degrees(cfg, world_size, n_heads, n_kv_heads)
    return ParallelDims(dp_replicate=rep, dp_shard=shard, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=world_size)


def parallelize_eager(model, parallel_dims, cfg, device: torch.device):
    """torchtitan's Llama3 parallelization (eager / jit baselines). Returns the model.

    With bf16 parameters the baseline trains in bf16 in every layout: where torchtitan would leave
    it fp32 (no FSDP), FSDP2 over a 1-rank shard dimension casts (docs/design.md, "Mixed precision")."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp, parallelize_llama

    if parallel_dims.world_size > 1:
        parallel_dims.build_mesh()
    # torchtitan builds size-1 mesh dimensions too, but its get_mesh refuses them: read its _meshes
    mesh = None
    if cfg.training.mixed_precision_param == "bfloat16" and not parallel_dims.fsdp_enabled:
        if parallel_dims.world_size == 1:
            if not dist.is_initialized():
                _init_single_process_group(device)
            mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
        elif not parallel_dims.dp_replicate_enabled:  # TP alone: the layout's own size-1 "fsdp" dimension
            mesh = parallel_dims._meshes["fsdp"]  # (beside "tp" in one mesh, as FSDP x TP needs)
        elif not parallel_dims.tp_enabled:  # replicas alone (torchtitan's DDP refuses TP)
            mesh = parallel_dims._global_meshes["dense"]["dp_replicate", "fsdp"]
    if mesh is not None and parallel_dims.dp_replicate_enabled:  # torchtitan's steps without its DDP
        parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = parallelize_llama(model, parallel_dims, cfg)
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
        hsdp = "HSDP over the replicas, " if mesh.ndim > 1 else ""
        logger.info(f"Applied FSDP2 over a 1-rank shard dimension ({hsdp}mesh {tuple(mesh.shape)}) for bf16 "
                    "mixed precision")
    # sum the gradients over the DP ranks, as the loss and the traced step expect: FSDP2's divide
    # factor is already 1 (forced to a plain SUM on gloo, which lacks PREMUL_SUM); DDP: a SUM hook
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        if dist.get_backend() == "gloo":
            m.set_force_sum_reduction_for_comms(True)
    if not fsdp_modules and hasattr(model, "register_comm_hook") and dist.is_initialized():
        model.register_comm_hook(None, _sum_allreduce_hook)
    return model


def _sum_allreduce_hook(group, bucket):
    """DDP comm hook: all-reduce with ``SUM`` (torch's ``allreduce_hook`` divides by the world)."""
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _init_single_process_group(device: torch.device) -> None:
    """A 1-rank process group without torchrun, on an in-process store."""
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            world_size=1, rank=0)


def apply_ac_for_trace(model, cfg) -> None:
    """Wrap TransformerBlocks for activation checkpointing before tracing (torchtitan's ``apply_ac``)."""
    if cfg.activation_checkpoint.mode == "none":
        return
    import torch.utils.checkpoint as ckpt
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    # under make_fx op-level SAC's cache sees version-counter bumps eager does not (a spurious
    # "... has been mutated"); the traced step stays bitwise eager op-SAC with the check off
    lenient = functools.partial(ckpt.create_selective_checkpoint_contexts, allow_cache_entry_mutation=True)
    with mock.patch.object(ckpt, "create_selective_checkpoint_contexts", lenient):
        apply_ac(model, cfg.activation_checkpoint, model_compile_enabled=False, op_sac_save_list=_op_sac_save_list,
                 base_folder=cfg.job.dump_folder)


def all_reduce_grads(grads: list[torch.Tensor], group=None) -> None:
    """Sum-all-reduce gradients in place over ``group`` as one flat buffer (replicated DP)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


@dataclass
class TraceParallel:
    """How the traced step sees the parameters under FSDP and / or TP (``aot_fx_trace``).

    ``names`` / ``params``: FQNs and placeholders (the parameters, or this rank's fp32 FSDP shards / TP-local tensors);
    ``materialize``: None or placeholders -> compute parameters inside the graph; ``dp_group``: the ranks sharing the
    global batch; ``norm_group``: the ranks of the grad norm (None: the world); ``norm_weights``: ``1 / tp`` for
    TP-replicated params, else 1; ``fsdp2_mesh`` / ``fsdp2_layouts``: the eager baseline's mesh and
    :func:`~graph_trainer.distributed.fsdp.fsdp2_layout` per param; ``eager_norm``: clip with eager's DTensor norm
    (``--debug.deterministic``); ``replicated_grads``: params whose eager gradient is Replicate (embeddings under TP
    without FSDP: DTensor's embedding backward replicates it)."""

    names: list[str] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    materialize: Callable | None = None
    opt_module: torch.nn.Module | None = None
    fsdp_group: Any = None
    dp_group: Any = None
    replicate_group: Any = None
    norm_group: Any = None
    tp_mesh: Any = None
    loss_parallel: bool = False
    norm_weights: list[float] | None = None
    fsdp2_mesh: Any = None
    fsdp2_layouts: list | None = None
    eager_norm: bool = False
    replicated_grads: frozenset = frozenset()

    @property
    def sharded(self) -> bool:
        return self.fsdp_group is not None or self.tp_mesh is not None

    @property
    def tp_group_name(self) -> str | None:
        """The TP group's name as the traced collectives carry it; None without TP."""
        return None if self.tp_mesh is None else self.tp_mesh.get_group().group_name

    def trace(self, model, loss_fn, tokens, labels, param_dtype):
        """:func:`graph_trainer.trace.trace_train_step` with these placeholders, under
        ``loss_parallel()`` when TP uses it. ``param_dtype``: compute dtype, None for the parameters'."""
        from torch.distributed.tensor.parallel import loss_parallel

        kwargs = dict(params=self.params, param_names=self.names, materialize=self.materialize) if self.sharded else {}
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            return trace_train_step(model, loss_fn, tokens, labels, param_dtype=param_dtype, **kwargs)

    def as_fsdp2_local(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """``t``, shaped like placeholder ``i`` (its shard, gradient or AdamW moment), as a view in
        FSDP2's local shape (unchanged without an FSDP2 layout, or for other shapes)."""
        lay = self.fsdp2_layouts[i] if self.fsdp2_layouts else None
        return t if lay is None or t.numel() != lay.local_shape.numel() or t.dim() == 0 else t.view(lay.local_shape)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm (over all ranks when sharded); returns it (0-d fp32).

        Sharded, with ``eager_norm``, torch's ``get_total_norm`` over the gradients as DTensors in FSDP2's layout on the
        eager baseline's mesh: eager's norm bitwise, at a host cost (docs/design.md, "Eager == traced, bit for bit, with
        NCCL"); without it, or where a shard is not FSDP2's chunk,
        :func:`graph_trainer.distributed.fsdp.sharded_grad_norm_` (one all-reduce)."""
        from torch.distributed.tensor import DTensor, Replicate
        from torchtitan.distributed.utils import clip_grad_norm_

        if not self.sharded:
            return clip_grad_norm_(self.params, max_norm, foreach=True)
        if not self.eager_norm or self.fsdp2_layouts is None or None in self.fsdp2_layouts:
            return fsdp.sharded_grad_norm_(self.params, max_norm, self.norm_group, self.norm_weights)
        kept = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = [self.params[i].grad for i in kept]
        dgrads = [DTensor.from_local(g.view(lay.local_shape), self.fsdp2_mesh, lay.placements, run_check=False,
                                     shape=lay.shape, stride=lay.stride)
                  for g, lay in zip(grads, (self.fsdp2_layouts[i] for i in kept))]
        dgrads = [d.redistribute(placements=[Replicate()] * self.fsdp2_mesh.ndim) if i in self.replicated_grads else d
                  for i, d in zip(kept, dgrads)]
        # DTensor warns that the norm's mesh dimensions are reduced one after the other: that order is eager's
        quiet = logging.getLogger("torch.distributed.tensor._redistribute")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            total = torch.nn.utils.get_total_norm(dgrads, 2.0, error_if_nonfinite=False, foreach=True)
            total = total.full_tensor() if isinstance(total, DTensor) else total
        finally:
            quiet.setLevel(level)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))  # clip_grads_with_norm_
        return total


def distribute_for_trace(model, cfg, parallel_dims, device: torch.device, rank: int, world_size: int) -> TraceParallel:
    """Prepare ``model`` for ``aot_fx_trace``: TP (torchtitan's Llama3 plan), activation checkpointing, traceable FSDP
    over ``dp_shard`` and, with ``dp_replicate > 1``, the gradient all-reduce over the replicas (mesh order as
    torchtitan's). Mixed precision as FSDP2 + TP: fp32 placeholders cast to ``mixed_precision_param`` before the
    all-gather, reduce-scatters in ``mixed_precision_reduce``. Under ``COMM_MODE=fake_collectives`` ``model`` is on meta
    and this rank's shards go on ``device``."""
    from torch.distributed.tensor import DTensor, Replicate
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    rep, tp, shard = parallel_dims.dp_replicate, parallel_dims.tp, parallel_dims.dp_shard
    pdtype, rdtype = DTYPES[cfg.training.mixed_precision_param], DTYPES[cfg.training.mixed_precision_reduce]
    pdtype = None if pdtype == torch.float32 else pdtype
    out, mesh = TraceParallel(), None
    if tp > 1 or shard > 1:
        dims = {"dp_replicate": rep, "dp_shard": shard, "tp": tp} if rep > 1 else {"dp_shard": shard, "tp": tp}
        mesh = init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    if tp > 1:
        out.tp_mesh = mesh["tp"]
        out.loss_parallel = not cfg.parallelism.disable_loss_parallel
        apply_tp(model, out.tp_mesh, loss_parallel=out.loss_parallel, enable_float8_tensorwise_tp=False)
        logger.info(f"Applied torchtitan's Llama3 TP plan (degree {tp}, loss parallel {out.loss_parallel}) for tracing")
    apply_ac_for_trace(model, cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out.names = [n for n, _ in named]
    if mesh is None:
        out.dp_group = dist.group.WORLD if world_size > 1 else None
        out.params = [p for _, p in named]
        out.opt_module = model
        return out

    tp_specs = [(p.placements, p.shape, p.stride()) for _, p in named] if tp > 1 else None
    local = [p.to_local().detach() if tp > 1 else p.detach() for _, p in named]
    out.norm_weights = [1.0 / tp if tp > 1 and all(isinstance(pl, Replicate) for pl in p.placements) else 1.0
                        for _, p in named]
    out.eager_norm = bool(cfg.debug.deterministic)
    if tp > 1 and shard == 1 and pdtype is None:  # eager without FSDP keeps DTensor autograd's gradient placements
        embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
        out.replicated_grads = frozenset(i for i, n in enumerate(out.names) if n in embeddings)
    out.fsdp2_mesh = mesh[(("dp_replicate",) if rep > 1 else ()) + ("dp_shard",) + (("tp",) if tp > 1 else ())]
    out.fsdp2_layouts = [fsdp.fsdp2_layout(t, p.shape, p.stride(), tuple(p.placements) if tp > 1 else (), shard, rep)
                         for t, (_, p) in zip(local, named)]
    specs = None
    if shard > 1:
        out.fsdp_group = out.dp_group = mesh["dp_shard"].get_group()
        specs, out.params = fsdp.shard_tensors(out.names, local, out.fsdp_group)
    else:
        out.params = [torch.nn.Parameter(t.clone()) for t in local]
    if rep > 1:
        out.replicate_group = mesh["dp_replicate"].get_group()
        out.dp_group = _flat_group(mesh, ("dp_replicate", "dp_shard") if shard > 1 else ("dp_replicate",), "dp")
        norm_dims = tuple(d for d, n in (("dp_shard", shard), ("tp", tp)) if n > 1)
        out.norm_group = _flat_group(mesh, norm_dims, "dp_shard_tp")
        logger.info(f"Replicate degree {rep}: gradients all-reduced over the replicas inside the graph")
    del local
    if cfg.comm.mode == "fake_collectives":  # rank 0's shards of a model built on meta (train.py)
        out.params = materialize_meta_shards(out.names, out.params, device)
    fsdp.free_parameters(model, out.names)
    out.opt_module = fsdp.ShardedParams(out.params, rank, world_size)
    group, tp_mesh, rep_group = out.fsdp_group, out.tp_mesh, out.replicate_group

    def materialize(ps):
        if rep_group is not None:
            ps = [fsdp.all_reduce_grad(p, rep_group) for p in ps]
        full = ([fsdp.all_gather_param(p, s, group, pdtype, rdtype) for p, s in zip(ps, specs)] if group is not None
                else [p.to(pdtype) if pdtype is not None and p.is_floating_point() else p for p in ps])
        return full if tp_mesh is None else [DTensor.from_local(t, tp_mesh, pl, run_check=False, shape=sh, stride=st)
                                             for t, (pl, sh, st) in zip(full, tp_specs)]

    out.materialize = materialize
    return out


def materialize_meta_shards(names: list[str], shards: list[torch.nn.Parameter], device: torch.device,
                            std: float = 0.02) -> list[torch.nn.Parameter]:
    """Meta shards allocated on ``device`` (fake_collectives): ``norm.weight`` ones, the rest N(0, std); others kept."""
    out = []
    for name, p in zip(names, shards):
        if p.is_meta:
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            t = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, std)
            p = torch.nn.Parameter(t, requires_grad=p.requires_grad)
        out.append(p)
    return out


def _flat_group(mesh, dims: tuple[str, ...], name: str):
    """The process group of ``mesh``'s ``dims`` together (several: a flattened sub-mesh ``name``)."""
    return mesh[dims[0]].get_group() if len(dims) == 1 else mesh[dims]._flatten(name).get_group()
