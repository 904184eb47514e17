"""``COMM_MODE=fake_backend``: trace one step of an NGPU-rank layout in one process, execute nothing.

Rank 0 of ``NGPU`` ranks on a fake process group builds the model on the meta device, distributes and traces it as
training does, and logs the collectives, state bytes, graph estimates, the memory policy's choice and the projected step
(:mod:`graph_trainer.projection.cost_model`). RMSNorm and attention are traced as CUDA runs them, so the graph estimate
is the GPU run's."""

import contextlib
import functools
import os
from collections import Counter, defaultdict
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed.tensor.experimental
from torch.fx._lazy_graph_module import _LazyGraphModule

from graph_trainer import logger
from graph_trainer.compiler.collectives import collective_kind
from graph_trainer.compiler.graph_values import val_bytes


def collective_summary(gm: torch.fx.GraphModule) -> dict[str, dict[str, int]]:
    """``{op name: {"count": n, "bytes": output bytes per rank}}`` of the collectives of ``gm``."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for n in gm.graph.nodes:
        if (name := collective_kind(n)) is not None:
            out[name]["count"] += 1
            out[name]["bytes"] += val_bytes(n.meta.get("val"))
    return dict(out)


@contextlib.contextmanager
def fused_attention_on_meta():
    """Trace mask-free, dropout-free SDPA on meta tensors as one fused attention op
    (``aten._scaled_dot_product_flash_attention_for_cpu``, saved by selective AC), as a GPU runs
    it, instead of the math path's ``[batch, heads, seq, seq]`` scores. GQA keys and values keep
    their heads (FlashAttention reads them per query head group; no repeated copy)."""
    from torchtitan.models.llama3.infra import parallelize as tt_parallelize

    orig = F.scaled_dot_product_attention
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta" or attn_mask is not None or dropout_p:
            return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        return op(q, k, v, 0.0, is_causal, scale=scale)[0]  # GQA: k / v keep their heads, as on a GPU

    save_list = tt_parallelize._op_sac_save_list
    added = op not in save_list
    save_list.add(op)
    try:
        with mock.patch.object(F, "scaled_dot_product_attention", sdpa):
            yield
    finally:
        if added:
            save_list.discard(op)


@torch.library.custom_op("graph_trainer::fused_rms_norm", mutates_args=(),
                         schema="(Tensor x, int[] shape, Tensor? weight, float? eps) -> (Tensor, Tensor)")
def _fused_rms_norm_node(x, shape, weight, eps):
    """``aten._fused_rms_norm`` as one traced node: ``make_fx`` decomposes the aten op wherever it
    has a CompositeImplicitAutograd kernel (meta and CPU tensors on torch 2.13), which a CUDA trace
    never does. :func:`restore_fused_rms_norm` gives the node the aten op back."""
    return torch.ops.aten._fused_rms_norm.default(x, shape, weight, eps)


@_fused_rms_norm_node.register_fake
def _(x, shape, weight, eps):
    rstd_shape = tuple(x.shape[: x.dim() - len(shape)]) + (1,) * len(shape)
    return torch.empty_like(x), x.new_empty(rstd_shape, dtype=torch.float32)  # rstd: fp32, as CUDA's


@torch.distributed.tensor.experimental.register_sharding(torch.ops.graph_trainer.fused_rms_norm.default)
def _fused_rms_norm_sharding(x, shape, weight, eps):
    """DTensor placements of :func:`_fused_rms_norm_node` (TP's norms): all replicated, or ``x``
    (and both outputs) sharded on a dimension the norm does not reduce, the weight replicated."""
    from torch.distributed.tensor import Replicate, Shard

    w = None if weight is None else Replicate()
    return [([Replicate(), Replicate()], [Replicate(), None, w, None])] + [
        ([Shard(d), Shard(d)], [Shard(d), None, w, None]) for d in range(x.ndim - len(shape))]


def restore_fused_rms_norm(gm: torch.fx.GraphModule) -> int:
    """Retarget ``gm``'s :func:`_fused_rms_norm_node` nodes to ``aten._fused_rms_norm`` (the same
    schema and outputs), as a CUDA trace has them; returns how many."""
    nodes = gm.graph.find_nodes(op="call_function", target=torch.ops.graph_trainer.fused_rms_norm.default)
    for node in nodes:
        node.target = torch.ops.aten._fused_rms_norm.default
    if nodes:
        gm.recompile()
    return len(nodes)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as CUDA runs it (``aten._fused_rms_norm`` and its backward kernel), which keeps
    only the input and the fp32 ``rstd`` for the backward. On meta tensors the op decomposes
    into its fp32 pointwise steps under autograd, whose saved intermediates a GPU never holds."""

    @staticmethod
    def forward(ctx, x, shape, weight, eps):
        y, rstd = _fused_rms_norm_node(x, shape, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape = shape
        return y

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        dx, dw = torch.ops.aten._fused_rms_norm_backward.default(grad, x, ctx.shape, rstd, weight,
                                                                  [True, weight is not None])
        return dx, None, dw, None


@contextlib.contextmanager
def fused_rms_norm_on_meta():
    """Trace ``F.rms_norm`` on meta tensors as :class:`_FusedRMSNorm` (as a GPU runs it); after the
    trace, :func:`restore_fused_rms_norm` names its forward nodes ``aten._fused_rms_norm``."""
    orig = F.rms_norm

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if x.device.type != "meta":
            return orig(x, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(x, list(normalized_shape), weight, eps)

    with mock.patch.object(F, "rms_norm", rms_norm):
        yield


def dry_run(cfg) -> dict:
    """Trace one step of ``cfg`` on a fake ``NGPU``-rank process group; log and return the summary. Raises UserError:
    invalid layout for NGPU; a bad ``[projection]`` flag."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"

    from graph_trainer.compiler.memory_estimate import estimate_peak_memory
    from graph_trainer.compiler.memory_policy import DRY_RUN_DEVICES_GIB, HEADROOM, GiB
    from graph_trainer.compiler.pipeline import plan_pipeline, run_pipeline
    from graph_trainer.compiler.registry import registry
    from graph_trainer.distributed import parallelize
    from graph_trainer.model import block_layout, build_model, build_model_args, build_tokenizer, flavors, loss_fn
    from graph_trainer.projection import cost_model as P

    device, gpus_per_node, overlap = P.settings(cfg.projection)
    world = int(os.environ.get("NGPU", "8"))
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=world)
    parallelize._patch_torchtitan_device_type("cpu")
    flavor = flavors()[cfg.model.flavor]
    pdims = parallelize.build_parallel_dims(cfg, world, flavor.n_heads, flavor.n_kv_heads)
    args = build_model_args(cfg, build_tokenizer(cfg))
    model = build_model(args, "meta")
    nparams, flops_per_token = args.get_nparams_and_flops(model, cfg.training.seq_len)
    layout = block_layout(model)
    b, s = cfg.training.local_batch_size, cfg.training.seq_len
    # (SAC's save list is bound when distribute_for_trace applies AC)
    with fused_attention_on_meta(), fused_rms_norm_on_meta():
        tpar = parallelize.distribute_for_trace(model, cfg, pdims, torch.device("cpu"), 0, world)
        pdtype = torch.bfloat16 if cfg.training.mixed_precision_param == "bfloat16" else None
        tokens = torch.zeros(b, s, dtype=torch.long, device="meta")
        traced = tpar.trace(model, functools.partial(loss_fn, dp_group=tpar.dp_group), tokens, tokens, pdtype)
    gm = traced.gm
    restore_fused_rms_norm(gm)
    shard_bytes = sum(p.numel() * 4 for p in tpar.params)
    colls = collective_summary(gm)
    peak_before, _ = estimate_peak_memory(gm)
    # the memory policy for the configured budget, or for each device size of DRY_RUN_DEVICES_GIB
    given = cfg.compile.memory_budget_gib
    budgets = ([(given * GiB, "--compile.memory_budget_gib")] if given > 0 else
               [(d * (1 - HEADROOM) * GiB, f"a {d:g} GiB device less {HEADROOM:.0%}") for d in DRY_RUN_DEVICES_GIB])
    policies, plans, estimates = [], [], {}  # the graph estimates do not depend on the budget
    for budget, source in budgets:
        logger.info(f"memory budget {budget / GiB:.1f} GiB per rank ({source}):")
        pipeline, policy = plan_pipeline(cfg.compile, layout, gm, budget_bytes=int(budget), state_bytes=3 * shard_bytes,
                                         has_fsdp=tpar.sharded, device_type="cuda", tp_group_name=tpar.tp_group_name,
                                         peers=world > 1, estimates=estimates)
        policies.append({"budget_gib": round(budget / GiB, 2), "levers": policy.levers.flags(),
                         "predicted_peak_gib": round(policy.predicted_peak_bytes / GiB, 2),
                         "graph_estimate_gib": round(policy.graph_peak_bytes / GiB, 2),
                         "state_gib": round(policy.state_bytes / GiB, 2)})
        plans.append(pipeline)
    # the graph-level passes (compiling passes need real tensors) of the plan for the projected
    # device: the budget given, or the dry-run device size nearest to its memory
    chosen = 0 if len(plans) == 1 else min(range(len(plans)),
                                           key=lambda i: abs(DRY_RUN_DEVICES_GIB[i] - device.memory_gib))
    pipeline = [p for p in plans[chosen] if not registry()[p.name].compiles]
    # lazy: nothing runs this graph, so no pass needs to generate its code
    gm = run_pipeline(_LazyGraphModule.from_graphmodule(gm), traced.example_inputs, pipeline)
    names = [p.name for p in pipeline]
    peak_after, peak_node = estimate_peak_memory(gm)
    phases = Counter(n.meta.get("custom", {}).get("phase", "-") for n in gm.graph.nodes)

    # the projection, with what runs after the graph: the optimizer and clipping (HBM traffic),
    # the gradient norm's all-reduce (sharded layouts) and replicated DP's flat gradient all-reduce
    params = sum(p.numel() for p in tpar.params)
    flat = not tpar.sharded and world > 1  # parallelize.all_reduce_grads
    extra = [P.CollectiveOp("all_reduce", "dp", 4 * params)] if flat else []
    if tpar.sharded and world > 1:  # the squared norm of every gradient, fp32 (fsdp.sharded_grad_norm_)
        extra.append(P.CollectiveOp("all_reduce", "world" if tpar.norm_group is None else "dp_shard_tp",
                                    4 * len(tpar.params)))
    proj = P.project(P.graph_work(gm, group_dims(tpar)), P.Layout(pdims.dp_replicate, pdims.dp_shard, pdims.tp,
                     gpus_per_node), device, tokens_per_rank=b * s, flops_per_token=flops_per_token,
                     after_graph_bytes=P.after_graph_bytes(params, flat), extra_collectives=extra, overlap=overlap)
    summary = {
        "world_size": world, "layout": layout_name(pdims.dp_replicate, pdims.dp_shard, pdims.tp),
        "flavor": cfg.model.flavor, "params": nparams, "flops_per_token": flops_per_token,
        "nodes": len(gm.graph.nodes), "nodes_by_phase": dict(phases), "trace_time_s": traced.trace_time_s,
        "collectives": colls, "param_bytes_per_rank": shard_bytes, "grad_bytes_per_rank": shard_bytes,
        "optimizer_bytes_per_rank": 2 * shard_bytes,  # AdamW exp_avg + exp_avg_sq, fp32
        "graph_passes": names, "peak_graph_bytes_traced": peak_before, "peak_graph_bytes": peak_after,
        "memory_policies": policies, "projection": {**proj.to_dict(), "memory_policy": policies[chosen]},
    }
    lines = [
        f"dry run: llama3 {cfg.model.flavor}, {summary['layout']} on {world} fake ranks, "
        f"seq {s} x batch {b}; traced in {traced.trace_time_s:.1f}s",
        f"  graph: {summary['nodes']} nodes ({', '.join(f'{k} {v}' for k, v in phases.items())})",
        *(f"  {k}: {v['count']} ops, {v['bytes'] / GiB:.3f} GiB per rank per step" for k, v in sorted(colls.items())),
        f"  per rank: params {shard_bytes / GiB:.2f} GiB, grads {shard_bytes / GiB:.2f} GiB, "
        f"AdamW state {2 * shard_bytes / GiB:.2f} GiB (fp32)",
        f"  graph estimate (live intermediates in graph order, exact sizes; the prediction's input, not a "
        f"peak): {peak_before / GiB:.2f} GiB as traced, {peak_after / GiB:.2f} GiB after [{', '.join(names)}] "
        f"(peak at {peak_node})",
        *(f"  predicted peak per rank ({cfg.compile.inductor_compilation} Inductor): {p['predicted_peak_gib']:.1f} GiB "
          f"of a {p['budget_gib']:.1f} GiB budget with {p['levers']}" for p in policies),
        *proj.lines(),
    ]
    for line in lines:
        logger.info(line)
    return summary


def layout_name(replicate: int, shard: int, tp: int) -> str:
    """``FSDP8``, ``FSDP4xTP2``, ``HSDP2x4`` (replicate x shard), ``DP2`` (replicated alone), ``FSDP1xTP2``."""
    name = (f"HSDP{replicate}x{shard}" if shard > 1 else f"DP{replicate}") if replicate > 1 else f"FSDP{shard}"
    return name + (f"xTP{tp}" if tp > 1 else "")


def group_dims(tpar) -> dict[str, str]:
    """``{process group name: mesh dim}`` of a ``TraceParallel``'s replicate, FSDP, TP and
    data-parallel (``dp``, where it is none of the others) groups."""
    groups = [(tpar.replicate_group, "dp_replicate"), (tpar.fsdp_group, "dp_shard"),
              (tpar.tp_mesh.get_group() if tpar.tp_mesh is not None else None, "tp"), (tpar.dp_group, "dp")]
    return {group.group_name: dim for group, dim in reversed(groups) if group is not None}  # the first dim wins
