"""``COMM_MODE=fake_backend``: trace one step of an NGPU-rank layout in one process.

The process joins a fake process group as rank 0 of ``NGPU`` ranks, builds the model
on the meta device (the 8B costs no memory), applies TP and traceable FSDP exactly as
training does (:func:`graph_trainer.distributed.parallelize.distribute_for_trace`),
traces forward + loss + backward with make_fx, and prints a graph summary:
node count, collectives by kind with bytes per rank, parameter / gradient /
optimizer-state bytes per rank, the memory policy's choice for ``--compile.memory_budget_gib``
(or for an 80 GB and a 141 GB device when it is 0) with its predicted peak
(:mod:`graph_trainer.compiler.memory_policy`), and the estimated peak of the step's intermediate
tensors (:mod:`graph_trainer.compiler.memory_estimate`) as traced and after the
pipeline's graph-level passes (the compiling passes are skipped: they need real tensors),
and the projected step on a GPU kind (:mod:`graph_trainer.projection.cost_model`): compute, exposed
communication by kind and mesh dimension, step time, tps/GPU and MFU, for the graph after the
passes of the memory policy's plan for that GPU's memory. Nothing is executed and no GPU is
needed.

The projection reads the ``[projection]`` flags (``graph_trainer.config.Projection``):
``--projection.device`` (``h100`` | ``h200``), ``--projection.gpus_per_node``,
``--projection.async_tp`` (TP collectives overlap with compute) and
``--projection.cost_constants`` (a JSON file of ``scripts/cost_constants.py``; default
``graph_trainer/projection/cost_constants/<device>.json`` when it exists, else datasheet values).
The world size is ``NGPU``, the launcher's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections import Counter, defaultdict

import torch
import torch.distributed as dist

logger = logging.getLogger("graph_trainer")


def _bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_bytes(v) for v in val)
    return 0


def collective_summary(gm: torch.fx.GraphModule) -> dict[str, dict[str, int]]:
    """``{op name: {"count": n, "bytes": output bytes per rank}}`` for ``_c10d_functional``
    collectives in ``gm`` (``wait_tensor`` excluded)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    from graph_trainer.compiler.common import collective_kind

    for n in gm.graph.nodes:
        if (name := collective_kind(n)) is not None:
            out[name]["count"] += 1
            out[name]["bytes"] += _bytes(n.meta.get("val"))
    return dict(out)


@contextlib.contextmanager
def fused_attention_on_meta():
    """Trace SDPA on meta tensors as a fused attention op, as a GPU runs it.

    On the meta device ``F.scaled_dot_product_attention`` falls back to the math
    backend, which materializes the ``[batch, heads, seq, seq]`` scores and their
    softmax (Llama3 8B at seq 8192: 4 GiB per layer in bf16, saved for the backward);
    on a GPU flash / cuDNN attention keeps only the output and a ``[batch, heads, seq]``
    logsumexp. Inside this context a causal, mask-free, dropout-free SDPA call on meta
    tensors becomes ``aten._scaled_dot_product_flash_attention_for_cpu`` (it has meta
    kernels and an autograd formula), and selective AC saves its output as torchtitan's
    save list does for the GPU fused attention ops; any other call is unchanged.
    With GQA the key / value heads are repeated first (SDPA's math path does the same;
    GPU kernels read them unrepeated), so the estimate keeps two ``[batch, heads, seq,
    head_dim]`` tensors per layer that a GPU does not hold (8B, seq 8192: 2 x 64 MiB).
    """
    import torch.nn.functional as F
    from torchtitan.models.llama3.infra import parallelize as tt_parallelize

    orig = F.scaled_dot_product_attention
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "meta" or attn_mask is not None or dropout_p:
            return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        if enable_gqa and k.shape[-3] != q.shape[-3]:  # as SDPA's math path does it
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        return op(q, k, v, 0.0, is_causal, scale=scale)[0]

    save_list = tt_parallelize._op_sac_save_list
    added = op not in save_list
    save_list.add(op)
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig
        if added:
            save_list.discard(op)


def dry_run(cfg) -> dict:
    """Trace one step of ``cfg`` on a fake ``NGPU``-rank process group; returns the summary.

    Raises:
        UserError: invalid layout for NGPU (see :func:`graph_trainer.distributed.parallelize.build_parallel_dims`);
            a bad ``[projection]`` flag (:func:`graph_trainer.projection.cost_model.settings`).
    """
    from graph_trainer.distributed import parallelize
    from graph_trainer.projection import cost_model as projection
    from graph_trainer.model import block_layout, build_model, build_model_args, build_tokenizer, flavors, loss_fn
    from graph_trainer.compiler.memory_estimate import estimate_peak_memory
    from graph_trainer.compiler.memory_policy import DRY_RUN_DEVICES_GIB, HEADROOM, GiB
    from graph_trainer.compiler.pipeline import plan_pipeline, run_pipeline
    from graph_trainer.compiler.registry import registry

    device, gpus_per_node, overlap = projection.settings(cfg.projection)
    world = int(os.environ.get("NGPU", "8"))
    if not dist.is_initialized():
        try:
            import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"
        except ImportError:
            pass
        dist.init_process_group("fake", rank=0, world_size=world)
    parallelize._patch_torchtitan_device_type("cpu")
    flavor = flavors()[cfg.model.flavor]
    pdims = parallelize.build_parallel_dims(cfg, world, flavor.n_heads, flavor.n_kv_heads)
    args = build_model_args(cfg, build_tokenizer(cfg))
    model = build_model(args, "meta")
    nparams, flops_per_token = args.get_nparams_and_flops(model, cfg.training.seq_len)
    layout = block_layout(model)
    with fused_attention_on_meta():  # (SAC's save list is bound when distribute_for_trace applies AC)
        tpar = parallelize.distribute_for_trace(model, cfg, pdims, torch.device("cpu"), 0, world)
        pdtype = torch.bfloat16 if cfg.training.mixed_precision_param == "bfloat16" else None
        shards = tpar.params
        b, s = cfg.training.local_batch_size, cfg.training.seq_len
        tokens = torch.zeros(b, s, dtype=torch.long, device="meta")
        traced = tpar.trace(model, functools.partial(loss_fn, dp_group=tpar.dp_group), tokens, tokens, pdtype)
    gm = traced.gm
    shard_bytes = sum(p.numel() * 4 for p in shards)
    colls = collective_summary(gm)
    peak_before, _ = estimate_peak_memory(gm)
    # the memory policy for the configured budget, or for each device size of DRY_RUN_DEVICES_GIB
    budgets = (
        [(cfg.compile.memory_budget_gib * GiB, "--compile.memory_budget_gib")] if cfg.compile.memory_budget_gib > 0
        else [(d * (1 - HEADROOM) * GiB, f"a {d:g} GiB device less {HEADROOM:.0%}") for d in DRY_RUN_DEVICES_GIB]
    )
    policies, plans = [], []
    for budget, source in budgets:
        logger.info(f"memory budget {budget / GiB:.1f} GiB per rank ({source}):")
        pipeline, policy = plan_pipeline(cfg.compile, layout, gm, budget_bytes=int(budget), state_bytes=3 * shard_bytes,
                                         has_fsdp=tpar.sharded)
        policies.append({"budget_gib": round(budget / GiB, 2), "levers": policy.levers.flags(),
                         "predicted_peak_gib": round(policy.predicted_peak_bytes / GiB, 2)})
        plans.append(pipeline)
    # the graph-level passes (compiling passes need real tensors) of the plan for the projected
    # device: the budget given, or the dry-run device size nearest to its memory
    chosen = 0 if len(plans) == 1 else min(range(len(plans)),
                                           key=lambda i: abs(DRY_RUN_DEVICES_GIB[i] - device.memory_gib))
    pipeline = [s for s in plans[chosen] if not registry()[s.name].compiles]
    gm = run_pipeline(gm, traced.example_inputs, pipeline)
    names = [s.name for s in pipeline]
    peak_after, peak_node = estimate_peak_memory(gm)
    phases = Counter(n.meta.get("custom", {}).get("phase", "-") for n in gm.graph.nodes)
    proj = _project(gm, tpar, pdims, device, gpus_per_node, overlap, shards, b * s, flops_per_token)
    summary = {
        "world_size": world,
        "layout": layout_name(pdims.dp_replicate, pdims.dp_shard, pdims.tp),
        "flavor": cfg.model.flavor,
        "params": nparams,
        "flops_per_token": flops_per_token,
        "nodes": len(gm.graph.nodes),
        "nodes_by_phase": dict(phases),
        "trace_time_s": traced.trace_time_s,
        "collectives": colls,
        "param_bytes_per_rank": shard_bytes,
        "grad_bytes_per_rank": shard_bytes,
        "optimizer_bytes_per_rank": 2 * shard_bytes,  # AdamW exp_avg + exp_avg_sq, fp32
        "graph_passes": names,
        "peak_graph_bytes_traced": peak_before,
        "peak_graph_bytes": peak_after,
        "memory_policies": policies,
        "projection": {**proj.to_dict(), "memory_policy": policies[chosen]},
    }
    gib = 2**30
    lines = [
        f"dry run: llama3 {cfg.model.flavor}, {summary['layout']} on {world} fake ranks, "
        f"seq {s} x batch {b}; traced in {traced.trace_time_s:.1f}s",
        f"  graph: {summary['nodes']} nodes ({', '.join(f'{k} {v}' for k, v in phases.items())})",
    ]
    for k, v in sorted(colls.items()):
        lines.append(f"  {k}: {v['count']} ops, {v['bytes'] / gib:.3f} GiB per rank per step")
    lines.append(
        f"  per rank: params {shard_bytes / gib:.2f} GiB, grads {shard_bytes / gib:.2f} GiB, "
        f"AdamW state {2 * shard_bytes / gib:.2f} GiB (fp32)"
    )
    lines.append(
        f"  estimated peak of the step's intermediates (graph order, exact sizes): "
        f"{peak_before / gib:.2f} GiB as traced, {peak_after / gib:.2f} GiB after "
        f"[{', '.join(names)}] (peak at {peak_node})"
    )
    for p in policies:
        lines.append(f"  memory policy for {p['budget_gib']:.1f} GiB per rank: {p['levers']} "
                     f"(predicted peak {p['predicted_peak_gib']:.1f} GiB)")
    lines += proj.lines()
    for line in lines:
        logger.info(line)
    return summary


def layout_name(replicate: int, shard: int, tp: int) -> str:
    """``FSDP8``, ``FSDP4xTP2``, ``HSDP2x4`` (replicate x shard), ``DP2`` (replicated alone),
    ``DP2xTP2``, ``FSDP1xTP2`` (TP alone)."""
    if replicate > 1:
        name = f"HSDP{replicate}x{shard}" if shard > 1 else f"DP{replicate}"
    else:
        name = f"FSDP{shard}"
    return name + (f"xTP{tp}" if tp > 1 else "")


def group_dims(tpar) -> dict[str, str]:
    """``{process group name: mesh dimension}`` of a :class:`graph_trainer.distributed.parallelize.TraceParallel`:
    its replicate (``dp_replicate``), FSDP (``dp_shard``) and TP (``tp``) groups, and the
    data-parallel group (``dp``: replicate x shard flattened, the world under replicated DP
    alone) where it is none of those."""
    dims: dict[str, str] = {}
    groups = [(getattr(tpar, "replicate_group", None), "dp_replicate"), (tpar.fsdp_group, "dp_shard"),
              (tpar.tp_mesh.get_group() if tpar.tp_mesh is not None else None, "tp"), (tpar.dp_group, "dp")]
    for group, dim in groups:
        if group is not None:
            dims.setdefault(group.group_name, dim)
    return dims


def _project(gm, tpar, pdims, device, gpus_per_node, overlap, shards, tokens, flops_per_token):
    """The projection of the step graph ``gm`` (:mod:`graph_trainer.projection.cost_model`), with what runs
    after the graph: the optimizer and clipping (HBM traffic), the gradient norm's all-reduce
    (sharded layouts) and replicated DP's flat gradient all-reduce."""
    from graph_trainer.projection import cost_model as P

    world = pdims.dp_replicate * pdims.dp_shard * pdims.tp
    params = sum(p.numel() for p in shards)
    flat = not tpar.sharded and world > 1  # parallelize.all_reduce_grads after the graph
    extra = []
    if tpar.sharded and world > 1:  # the squared norm of every gradient, fp32 (fsdp.sharded_grad_norm_)
        extra.append(P.CollectiveOp("all_reduce", "world" if getattr(tpar, "norm_group", None) is None
                                    else "dp_shard_tp", 4 * len(shards)))
    if flat:
        extra.append(P.CollectiveOp("all_reduce", "dp", 4 * params))
    layout = P.Layout(pdims.dp_replicate, pdims.dp_shard, pdims.tp, gpus_per_node)
    return P.project(P.graph_work(gm, group_dims(tpar)), layout, device, tokens_per_rank=tokens,
                     flops_per_token=flops_per_token, after_graph_bytes=P.after_graph_bytes(params, flat),
                     extra_collectives=extra, overlap=overlap)
