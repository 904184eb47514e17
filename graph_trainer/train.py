"""The training loop: config -> model/parallelize -> trace -> passes -> run -> metrics.

Run through ``./run_train.sh`` (torchrun) or ``python -m graph_trainer.train
--job.config_file train_configs/debug_model.toml``. One step of ``aot_fx_trace``::

    loss, grads = traced_step(params, buffers, tokens, labels)   # one FX graph
    p.grad = g; clip_grad_norm_; optimizer.step(); lr_scheduler.step()   # eager

``eager`` and ``jit`` run ``loss_fn(model(tokens), labels).backward()`` on the
torchtitan-parallelized model instead.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import time

import torch

from graph_trainer.config import memory_pass_options, parse_args, split_names
from graph_trainer.errors import UserError

logger = logging.getLogger("graph_trainer")

def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy. ``logits [B, S, V]`` (any float dtype, upcast to fp32),
    ``labels [B, S]`` int64 (-100 ignored). Returns a 0-d fp32 tensor."""
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100
    )


def setup_logging(rank: int = 0) -> None:
    """torchtitan's log format on stdout, for this project's and torchtitan's loggers."""
    from torchtitan.tools.logging import init_logger

    init_logger()
    fmt = logging.Formatter("[graph_trainer] %(asctime)s - %(levelname)s - %(message)s")
    logger.handlers.clear()
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(fmt)
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def build_tokenizer(cfg):
    """torchtitan's HuggingFaceTokenizer from ``--model.hf_assets_path`` or the embedded one."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from graph_trainer import data

    path = data.resolve_tokenizer_path(cfg.model.hf_assets_path, vocab_size=2048)
    return HuggingFaceTokenizer(path)


def build_model_args(cfg, tokenizer):
    """A copy of the flavor's ``TransformerModelArgs``, updated from the config.

    The flavor's vocab size is kept (the 8B keeps 128256 whatever the tokenizer).

    Raises:
        UserError: the tokenizer has more tokens than the model's embedding.
    """
    from graph_trainer.llama3 import llama3_args

    args = copy.deepcopy(llama3_args[cfg.model.flavor])
    args.update_from_config(cfg)
    if tokenizer.get_vocab_size() > args.vocab_size:
        raise UserError(
            f"The tokenizer has {tokenizer.get_vocab_size()} tokens but flavor "
            f"'{cfg.model.flavor}' embeds {args.vocab_size}. Use a matching --model.hf_assets_path."
        )
    if cfg.training.dataset != "c4_test" or cfg.model.hf_assets_path not in (None, "", "embedded"):
        pass
    return args


def train(cfg) -> dict:
    """Train for ``cfg.training.steps`` steps; returns the metrics summary (rank 0)."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    from graph_trainer import data, parallelize
    from graph_trainer.llama3 import Transformer
    from graph_trainer.metrics import MetricsLogger

    data.register_datasets()
    data.check_dataset(cfg.training.dataset, cfg.training.dataset_path)
    mode = cfg.compile.mode
    if mode == "aot_fx_trace":  # fail on bad pass lists before building anything
        from graph_trainer.passes import resolve_pass_names

        try:
            pass_names = resolve_pass_names(
                passes=split_names(cfg.compile.passes) or None,
                disable_passes=split_names(cfg.compile.disable_passes),
                numerics_changing_optim=cfg.compile.numerics_changing_optim,
                inductor_compilation=cfg.compile.inductor_compilation,
                uses_flex_attention=False,
                cudagraphs=cfg.compile.cudagraphs,
                pointwise_regions=cfg.compile.pointwise_regions,
                bucket_collectives=cfg.compile.bucket_collectives,
            )
        except ValueError as e:
            raise UserError(str(e)) from None

    from graph_trainer.llama3 import llama3_args

    flavor = llama3_args[cfg.model.flavor]
    device, rank, world_size = parallelize.init_device_and_dist()
    parallel_dims = parallelize.build_parallel_dims(cfg, world_size, flavor.n_heads, flavor.n_kv_heads)
    if mode == "aot_fx_trace":  # before anything is allocated
        parallelize.check_trace_layout(parallel_dims)
    from graph_trainer.determinism import apply_determinism

    determinism = apply_determinism(cfg.debug.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)

    tokenizer = build_tokenizer(cfg)
    model_args = build_model_args(cfg, tokenizer)
    dp_rank, dp_size = (rank // parallel_dims.tp, world_size // parallel_dims.tp)
    dataloader = build_text_dataloader(dp_size, dp_rank, tokenizer, cfg)

    t0 = time.perf_counter()
    with torch.device(device):
        model = Transformer(model_args)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    nparams, flops_per_token = model_args.get_nparams_and_flops(model, cfg.training.seq_len)
    logger.info(
        f"Model llama3 {cfg.model.flavor}: {nparams:,} params (without embedding), "
        f"{flops_per_token:,} FLOPs/token, built in {time.perf_counter() - t0:.1f}s on {device}; "
        f"mode {mode}, world {world_size}"
    )

    tpar = None
    if mode == "aot_fx_trace":  # TP plan -> AC wrappers -> traceable FSDP shards
        tpar = parallelize.distribute_for_trace(model, cfg, parallel_dims, device, rank, world_size)
        params, opt_module = tpar.params, tpar.opt_module
        buffers = list(model.buffers())
    else:
        cfg.compile.enable = mode == "jit"
        cfg.compile.components = ["model"]
        model = parallelize.parallelize_eager(model, parallel_dims, cfg, device)
        params = [p for p in model.parameters() if p.requires_grad]
        buffers = list(model.buffers())
        opt_module = model

    optimizers = build_optimizers([opt_module], cfg.optimizer, parallel_dims)
    lr_schedulers = build_lr_schedulers(optimizers, cfg.lr_scheduler, cfg.training.steps)

    metrics = MetricsLogger(
        device,
        flops_per_token,
        non_dp_size=parallel_dims.tp,
        dump_folder=cfg.job.dump_folder,
        enable_tensorboard=cfg.metrics.enable_tensorboard,
        tb_folder=cfg.metrics.save_tb_folder,
        rank=rank,
    )
    from graph_trainer.checkpoint import Checkpointer

    layout = f"dp_shard{parallel_dims.dp_shard}_dp_replicate{parallel_dims.dp_replicate}_tp{parallel_dims.tp}"
    meta = {"flavor": cfg.model.flavor, "mode": mode, "layout": layout}
    checkpointer = Checkpointer(
        cfg, dataloader, opt_module, optimizers, lr_schedulers, device, rank, meta
    )
    start_step = checkpointer.load_latest(cfg.checkpoint.load_step)

    param_dtype = parallelize.DTYPES[cfg.training.mixed_precision_param]
    traced = None
    extra: dict = {"mode": mode, "device": str(device), "torch": torch.__version__, **determinism}
    if start_step:
        extra["resumed_from_step"] = start_step
    data_iter = iter(dataloader)
    loss = None
    from graph_trainer.profiling import maybe_start_profiler

    profiler = maybe_start_profiler(cfg.profiling, cfg.job.dump_folder, rank, start_step)
    for step in range(start_step + 1, cfg.training.steps + 1):
        t_data = time.perf_counter()
        input_dict, labels = next(data_iter)
        tokens = input_dict["input"].to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        data_time = time.perf_counter() - t_data

        optimizers.zero_grad()
        if mode == "aot_fx_trace":
            if traced is None:
                traced = _trace_and_compile(model, tokens, labels, param_dtype, pass_names, cfg, extra, tpar)
            loss, grads = traced(params, buffers, tokens, labels)
            if not tpar.sharded:
                parallelize.all_reduce_grads(grads)  # replicated DP (no-op on one rank)
            for p, g in zip(params, grads):
                p.grad = g
            del grads
        else:
            loss = loss_fn(model(tokens), labels)
            loss.backward()
        if tpar is not None:
            grad_norm = tpar.clip_grad_norm_(cfg.training.max_norm)
        else:
            grad_norm = clip_grad_norm_(params, cfg.training.max_norm, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        metrics.record_step(tokens.numel(), data_time)

        last = step == cfg.training.steps
        saving = checkpointer.enabled and (step % cfg.checkpoint.interval == 0 or last)
        if step == start_step + 1 or step % cfg.metrics.log_freq == 0 or last or saving:
            loss_val = _global_mean(loss.detach(), world_size)
            bad = [f"loss is {v}" for v in (loss_val,) if not math.isfinite(v)]
            bad += [f"grad norm is {v}" for v in (float(grad_norm),) if not math.isfinite(v)]
            if bad:  # checked before any save: the last good checkpoint stays
                raise UserError(
                    f"{' and '.join(bad).capitalize()} at step {step}; stopping (no checkpoint of this state is "
                    f"written). Lower --optimizer.lr, check the data, or resume from the last good "
                    f"checkpoint in {checkpointer.folder if checkpointer.enabled else '(checkpointing off)'}."
                )
            lr = lr_schedulers.schedulers[0].get_last_lr()[0]
            metrics.log(step, loss_val, float(grad_norm), lr)
        checkpointer.save(step, last_step=last)
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.stop()
    checkpointer.close()
    if cfg.debug.state_hashes:
        from graph_trainer.determinism import optimizer_tensors, state_hashes

        hashes = state_hashes(params, optimizer_tensors(getattr(optimizers, "optimizers", [optimizers]), params))
        extra["state_hashes"] = hashes
        logger.info("final state sha256: %s", hashes)
    steps = cfg.training.steps - start_step
    summary = metrics.summary(exclude_steps=2 if steps >= 5 else 1, extra=extra)
    metrics.close()
    return summary


def _trace_and_compile(model, tokens, labels, param_dtype, pass_names, cfg, extra, tpar):
    from graph_trainer.passes import DEFAULT_RMSNORM_CANDIDATE_CONFIGS, run_passes
    from graph_trainer.trace import ops_by_kind

    pdtype = None if param_dtype == torch.float32 else param_dtype
    traced = tpar.trace(model, loss_fn, tokens, labels, pdtype)
    gm = traced.gm
    n_nodes = len(gm.graph.nodes)
    top = ", ".join(f"{k} {v}" for k, v in ops_by_kind(gm).most_common(6))
    logger.info(
        f"Traced the training step in {traced.trace_time_s:.2f}s: one graph, {n_nodes} nodes "
        f"({len(traced.param_names)} params -> {len(traced.param_names)} grads); top ops: {top}"
    )
    t0 = time.perf_counter()
    dump = os.path.join(cfg.job.dump_folder) if cfg.compile.dump_graphs else None
    tune = cfg.compile.rmsnorm_tune and not cfg.debug.deterministic
    if cfg.compile.rmsnorm_tune and cfg.debug.deterministic and any("rmsnorm" in n for n in pass_names):
        logger.info("--debug.deterministic: RMSNorm regions use Inductor's defaults (no timed config pick)")
    traced.gm = run_passes(
        gm,
        traced.example_inputs,
        pass_names,
        rmsnorm_inductor_configs=cfg.compile.rmsnorm_inductor_configs or None,
        rmsnorm_candidate_configs=DEFAULT_RMSNORM_CANDIDATE_CONFIGS if tune else None,
        full_inductor_configs=cfg.compile.full_inductor_configs or None,
        pin_collectives=cfg.compile.pin_collectives,
        dump_folder=dump,
        **memory_pass_options(cfg.compile),
    )
    compile_s = time.perf_counter() - t0
    logger.info(f"Pass pipeline [{', '.join(pass_names)}] took {compile_s:.2f}s")
    extra.update(trace_time_s=traced.trace_time_s, compile_time_s=compile_s, graph_nodes=n_nodes)
    return traced


def _global_mean(t: torch.Tensor, world_size: int) -> float:
    if world_size > 1:
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= world_size
    return float(t)


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, train, report. Returns the exit code (2 for user errors)."""
    import torch.distributed as dist

    setup_logging()
    try:
        cfg = parse_args(argv)
        if cfg.comm.mode == "fake_backend":
            from graph_trainer.dry_run import dry_run

            dry_run(cfg)
        else:
            train(cfg)
            if dist.is_initialized() and dist.get_world_size() > 1:
                # Let every rank finish its last collective before any rank tears down: a
                # rank destroying its gloo group while a peer still talks to it aborted at
                # exit ("terminate called without an active exception", 1 in ~5 TP2 CPU runs).
                dist.barrier(device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None)
    except UserError as e:
        print(f"\nerror: {e}\n", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
