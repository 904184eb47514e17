"""The training loop: config -> model -> layout + step -> loop -> metrics.

Run through ``./run_train.sh`` (torchrun) or ``python -m graph_trainer.train --job.config_file ...``. The step
(:mod:`graph_trainer.step`) hides the mode; everything after the gradients is eager."""

import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.tools.logging import init_logger

from graph_trainer import data, logger
from graph_trainer.checkpoint import Checkpointer
from graph_trainer.compiler.passes.cudagraph import release_cuda_graphs
from graph_trainer.config import parse_args
from graph_trainer.determinism import apply_determinism, state_hashes
from graph_trainer.distributed import parallelize
from graph_trainer.errors import UserError
from graph_trainer.metrics import MetricsLogger
from graph_trainer.model import build_model, build_model_args, build_tokenizer, flavors
from graph_trainer.step import build_train_step
from graph_trainer.tools.profiling import StepProfiler


def setup_logging() -> None:
    """torchtitan's log format on stdout, for this project's and torchtitan's loggers."""
    init_logger()
    logger.handlers.clear()
    logger.addHandler(logging.StreamHandler(sys.stdout))
    logger.handlers[0].setFormatter(logging.Formatter("[graph_trainer] %(asctime)s - %(levelname)s - %(message)s"))
    logger.setLevel(logging.INFO)
    logger.propagate = False


def train(cfg) -> dict:
    """Train for ``cfg.training.steps`` steps; returns the metrics summary (rank 0). Raises UserError: bad data /
    layout / tokenizer, a non-finite loss or gradient norm."""
    # Data and layout first: both fail fast on bad input, before any memory is allocated.
    data.register_datasets()
    data.check_dataset(cfg.training.dataset, cfg.training.dataset_path)
    mode = cfg.compile.mode
    flavor = flavors()[cfg.model.flavor]
    fake = cfg.comm.mode == "fake_collectives"  # (no checkpoints: config.validate)
    device, rank, world_size = parallelize.init_device_and_dist(int(os.environ.get("NGPU", "1")) if fake else 0)
    if fake:
        logger.info(f"COMM_MODE=fake_collectives: rank 0 of {world_size} ranks on {device}, every collective a "
                    "local copy. tps, MFU and memory are this rank's compute and host time without communication; "
                    "losses and gradient norms are meaningless.")
    parallel_dims = parallelize.build_parallel_dims(cfg, world_size, flavor.n_heads, flavor.n_kv_heads)
    determinism = apply_determinism(cfg.debug.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)

    # Model: built whole on the device, then sharded / wrapped by the step builder.
    t0 = time.perf_counter()
    tokenizer = build_tokenizer(cfg)
    model_args = build_model_args(cfg, tokenizer)
    dp_rank, dp_size = rank // parallel_dims.tp, world_size // parallel_dims.tp  # TP ranks share a batch
    if cfg.training.dataloader.num_workers < 0:  # auto (config.DataLoader)
        cfg.training.dataloader.num_workers = 1 if device.type == "cuda" else 0
    dataloader = build_text_dataloader(dp_size, dp_rank, tokenizer, cfg)
    logger.info(f"Tokenizer ({tokenizer.get_vocab_size():,} tokens) and data ({cfg.training.dataset}) "
                f"ready in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    # fake_collectives, traced FSDP / TP: built on the meta device; distribute_for_trace allocates
    # rank 0's shards, so one GPU holds one rank of a model that no GPU holds whole
    meta = fake and mode == "aot_fx_trace" and (parallel_dims.tp > 1 or parallel_dims.dp_shard > 1)
    model = build_model(model_args, "meta" if meta else device)
    if meta:
        with torch.no_grad():
            model.init_weights(buffer_device=device)  # buffers (RoPE) on the device; parameters stay meta
        logger.info(f"Model built on the meta device; rank 0's shards are allocated on {device} (N(0, 0.02), norms 1)")
    nparams, flops_per_token = model_args.get_nparams_and_flops(model, cfg.training.seq_len)
    logger.info(f"Model llama3 {cfg.model.flavor}: {nparams:,} params (without embedding), {flops_per_token:,} "
                f"FLOPs/token, built in {time.perf_counter() - t0:.1f}s on {device}; mode {mode}, world {world_size}")
    step_fn = build_train_step(cfg, model, parallel_dims, device, rank, world_size)

    # Optimizer, schedule, metrics and checkpoints see what the step updates.
    optimizers = build_optimizers([step_fn.opt_module], cfg.optimizer, parallel_dims)
    lr_schedulers = build_lr_schedulers(optimizers, cfg.lr_scheduler, cfg.training.steps)
    layout = parallelize.layout_key(parallel_dims.dp_replicate, parallel_dims.dp_shard, parallel_dims.tp)
    meta = {"flavor": cfg.model.flavor, "mode": mode, "layout": layout}
    checkpointer = Checkpointer(cfg, dataloader, step_fn.opt_module, optimizers, lr_schedulers, device, rank, meta)
    start_step = checkpointer.load_latest(cfg.checkpoint.load_step)
    if start_step >= cfg.training.steps:  # a finished run's command again: nothing to train, nothing written
        checkpointer.close()
        logger.info(f"The run is already complete at step {start_step} (--training.steps {cfg.training.steps}); its "
                    f"checkpoint is {checkpointer.folder}/step-{start_step}. Raise --training.steps to train further.")
        return {"resumed_from_step": start_step, "already_complete": True}
    metrics = MetricsLogger(device, flops_per_token, non_dp_size=parallel_dims.tp, dump_folder=cfg.job.dump_folder,
                            enable_tensorboard=cfg.metrics.enable_tensorboard, tb_folder=cfg.metrics.save_tb_folder,
                            rank=rank, resume_step=start_step)
    logger.info("Outputs: " + "; ".join(metrics.outputs(cfg, checkpointer.folder if checkpointer.enabled else None)))
    extra: dict = {"mode": mode, "device": str(device), "torch": torch.__version__, **determinism,
                   **({"comm_mode": cfg.comm.mode} if fake else {}),
                   **({"resumed_from_step": start_step} if start_step else {})}

    def log(window) -> None:
        """Check a closed window's loss and grad norm, then log it (before any checkpoint of its state is written)."""
        checked = dict(zip(("loss", "grad norm"), window.read()))
        bad = [f"{k} is {v}" for k, v in checked.items() if not math.isfinite(v)]
        if bad and not fake:  # the last good checkpoint stays (fake collectives: values meaningless)
            where = checkpointer.folder if checkpointer.enabled else "(checkpointing off)"
            raise UserError(f"{' and '.join(bad).capitalize()} at step {window.step}; stopping (no checkpoint of "
                            f"this state is written). Lower --optimizer.lr, check the data, or resume from the last "
                            f"good checkpoint in {where}.")
        metrics.log_window(window)

    data_iter = iter(dataloader)
    prof = cfg.profiling
    profiler = StepProfiler(prof, cfg.job.dump_folder, rank, start_step) if prof.enable_profiling else None
    pending = None  # a logged step's window, read once the next step is issued: the device never waits for the host
    for step in range(start_step + 1, cfg.training.steps + 1):
        t_data = time.perf_counter()
        input_dict, labels = next(data_iter)
        tokens, labels = input_dict["input"].to(device, non_blocking=True), labels.to(device, non_blocking=True)
        data_time = time.perf_counter() - t_data
        optimizers.zero_grad()  # gradients (the first traced step also traces and compiles), then eager update
        loss = step_fn(tokens, labels)
        grad_norm = step_fn.clip_grad_norm_(cfg.training.max_norm)
        optimizers.step()
        lr_schedulers.step()
        metrics.record_step(tokens.numel(), data_time)
        if pending is not None:
            log(pending)
            pending = None

        last = step == cfg.training.steps
        saving = checkpointer.enabled and (step % cfg.checkpoint.interval == 0 or last)
        if step == start_step + 1 or step % cfg.metrics.log_freq == 0 or last or saving:
            lr = lr_schedulers.schedulers[0].get_last_lr()[0]
            pending = metrics.close_window(step, step_fn.global_loss(loss), grad_norm, lr)
            if step == start_step + 1 or last or saving:  # now: the first step's line, a checked checkpoint
                log(pending)
                pending = None
        checkpointer.save(step, last_step=last)
        if profiler is not None:
            profiler.step()

    if profiler is not None:
        profiler.stop()
    checkpointer.close()
    extra.update(step_fn.stats)
    if device.type == "cuda":  # next to the reserved peak of every row: the allocated one
        extra["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if cfg.debug.state_hashes:
        opts = getattr(optimizers, "optimizers", [optimizers])
        extra["state_hashes"] = hashes = state_hashes(step_fn.params, opts, step_fn.hash_view)
        logger.info("final state sha256: %s", hashes)
    summary = metrics.summary(exclude_steps=2 if cfg.training.steps - start_step >= 5 else 1, extra=extra)
    metrics.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, train, report. Returns the exit code (2 for user errors)."""
    setup_logging()
    try:
        cfg = parse_args(argv)
        if cfg.comm.mode == "fake_backend":
            from graph_trainer.projection.dry_run import dry_run

            dry_run(cfg)
        else:
            train(cfg)
            if dist.is_initialized() and dist.get_world_size() > 1:
                # every rank finishes its last collective before any tears down (gloo aborts otherwise)
                dist.barrier(device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None)
    except UserError as e:
        print(f"\nerror: {e}\n", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            release_cuda_graphs()  # a live graph that captured NCCL collectives hangs the destroy
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
