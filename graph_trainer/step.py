"""The training step as an object: what one call of the train loop does to produce gradients.

``aot_fx_trace`` (:class:`TracedTrainStep`): the first call traces forward + loss + backward
into one FX graph (:mod:`graph_trainer.trace`), runs the pass pipeline over it
(:func:`graph_trainer.compiler.pipeline.run_pipeline`) and keeps the result; every call
replays it::

    loss, grads = graph(params, buffers, tokens, labels)   # one FX graph
    p.grad = g                                             # for the optimizer

``eager`` / ``jit`` (:class:`EagerTrainStep`): ``loss_fn(model(tokens), labels).backward()``
on the torchtitan-parallelized model.

Every mode computes torchtitan's gradient: each rank's loss is its token cross-entropy sum
over the global batch's valid-token count (:func:`graph_trainer.model.loss_fn`), and the
gradients are summed over the data-parallel ranks (traced FSDP reduce-scatters with ``sum``;
torchtitan's FSDP2 has its gradient division turned off). So ``eager``, ``jit`` and the traced
step report the same loss and gradient norm in every layout.

Both have the same interface: ``step(tokens, labels) -> loss``, ``step.clip_grad_norm_(max_norm)``,
``step.global_loss(loss)``, ``step.params`` (what the optimizer updates), ``step.opt_module``
(what the optimizer builder and the checkpointer see) and ``step.stats`` (trace / compile
times for the run summary).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from graph_trainer.model import loss_fn

logger = logging.getLogger("graph_trainer")


class TracedTrainStep:
    """``aot_fx_trace``: trace once, run the pass pipeline, replay.

    Args:
        model: the model prepared by :func:`graph_trainer.distributed.parallelize.distribute_for_trace`.
        tpar: its :class:`graph_trainer.distributed.parallelize.TraceParallel` (placeholders, FSDP / TP).
        pipeline: :class:`graph_trainer.compiler.pipeline.PipelineStep` s to run on the graph,
            or a function of the traced graph returning them
            (:func:`graph_trainer.compiler.pipeline.plan_pipeline`'s result).
        param_dtype: compute dtype of the parameters inside the graph (``None``: their own).
        dump_folder: with ``--compile.dump_graphs``, where ``graphs/`` is written.
        record_dir: with ``--debug.record_numerics``, where step 1 records every op's output
            (:mod:`graph_trainer.numerics`); ``rank``: this rank (the file name).
    """

    def __init__(self, model, tpar, pipeline, param_dtype: torch.dtype | None, dump_folder: str | None = None,
                 record_dir: str | None = None, rank: int = 0):
        self.model, self.tpar = model, tpar
        self.record_dir, self.rank = record_dir, rank
        self.pipeline = pipeline if callable(pipeline) else list(pipeline)
        self.param_dtype, self.dump_folder = param_dtype, dump_folder
        self.params = tpar.params
        self.opt_module = tpar.opt_module
        self.dp_group = tpar.dp_group
        self.buffers = list(model.buffers())
        self.graph = None  # graph_trainer.trace.TracedStep after the first call
        self.stats: dict = {}

    def compile(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Trace the step for batches shaped like ``tokens`` / ``labels`` ``[B, S]`` int64 and
        run the pipeline over the graph (the first call does it)."""
        from graph_trainer.compiler.report import format_pass_table
        from graph_trainer.compiler.pipeline import run_pipeline
        from graph_trainer.trace import ops_by_kind

        logger.info("Tracing the training step (forward + loss + backward) into one FX graph ...")
        loss = functools.partial(loss_fn, dp_group=self.dp_group)
        traced = self.tpar.trace(self.model, loss, tokens, labels, self.param_dtype)
        n_nodes = len(traced.gm.graph.nodes)
        if self.record_dir:  # op identities, fixed before any pass moves a node
            from graph_trainer.numerics import assign_keys

            assign_keys(traced.gm)
        top = ", ".join(f"{k} {v}" for k, v in ops_by_kind(traced.gm).most_common(6))
        logger.info(
            f"Traced the training step in {traced.trace_time_s:.2f}s: one graph, {n_nodes} nodes "
            f"({len(traced.param_names)} params -> {len(traced.param_names)} grads); top ops: {top}"
        )
        t0 = time.perf_counter()
        if callable(self.pipeline):
            self.pipeline, policy = self.pipeline(traced.gm)
            gib = 2**30
            self.stats.update(
                memory_policy=policy.levers.flags(), memory_budget_gib=round(policy.budget_bytes / gib, 2),
                predicted_peak_gib=round(policy.predicted_peak_bytes / gib, 2),
                graph_estimate_gib=round(policy.graph_peak_bytes / gib, 2), state_gib=round(policy.state_bytes / gib, 2),
            )
        records: list[dict] = []  # one per pass (graph_trainer.compiler.report.pass_record)
        traced.gm = run_pipeline(traced.gm, traced.example_inputs, self.pipeline, dump_folder=self.dump_folder,
                                 records=records)
        compile_s = time.perf_counter() - t0
        logger.info(f"Pass pipeline [{', '.join(s.name for s in self.pipeline)}] took {compile_s:.2f}s")
        logger.info("Per-pass report (nodes by kind, regions, static peak estimate):\n%s", format_pass_table(records))
        self.stats.update(trace_time_s=traced.trace_time_s, compile_time_s=compile_s, graph_nodes=n_nodes, passes=records)
        self.graph = traced

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Run the step: sets ``p.grad`` of every parameter in :attr:`params`; returns this
        rank's loss (0-d fp32)."""
        if self.graph is None:
            self.compile(tokens, labels)
        records = None
        if self.record_dir:
            from graph_trainer.numerics import GraphRecorder

            gm, flat = self.graph.gm, [*self.params, *self.buffers, tokens, labels]
            if isinstance(gm, torch.fx.GraphModule):  # a fully compiled graph: outputs only
                recorder = GraphRecorder(gm)
                with torch.no_grad():
                    out = recorder.run(*flat)
                loss, grads, records = out[0], list(out[1:]), recorder.records
            else:
                loss, grads = self.graph(self.params, self.buffers, tokens, labels)
                records = {}
        else:
            loss, grads = self.graph(self.params, self.buffers, tokens, labels)
        if not self.tpar.sharded:
            from graph_trainer.distributed.parallelize import all_reduce_grads

            all_reduce_grads(grads)  # replicated DP: sum (no-op on one rank)
        for p, g in zip(self.params, grads):
            p.grad = g
        if records is not None:
            _save_records(self, records, loss, list(zip(self.graph.param_names, grads)), "aot_fx_trace")
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm (over all ranks when sharded); returns it."""
        return self.tpar.clip_grad_norm_(max_norm)

    def global_loss(self, loss: torch.Tensor) -> float:
        """The global batch's mean token loss from this rank's ``loss`` (see :func:`global_loss`)."""
        return global_loss(loss, self.dp_group)


class EagerTrainStep:
    """``eager`` / ``jit``: autograd on the torchtitan-parallelized ``model``.

    Args:
        model: the model after :func:`graph_trainer.distributed.parallelize.parallelize_eager`.
        dp_group: the data-parallel ranks (torchtitan's ``batch`` mesh), or None.
        loss_parallel: run forward, loss and backward under TP's ``loss_parallel()``.
        record_dir / rank: as :class:`TracedTrainStep` (ops recorded by a dispatch mode).
    """

    def __init__(self, model, dp_group=None, loss_parallel: bool = False, record_dir: str | None = None,
                 rank: int = 0):
        self.model, self.dp_group, self.loss_parallel = model, dp_group, loss_parallel
        self.record_dir, self.rank = record_dir, rank
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt_module = model
        self.stats: dict = {}

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward, loss, backward (``p.grad`` accumulates); returns this rank's loss."""
        import contextlib

        from torch.distributed.tensor.parallel import loss_parallel

        if self.record_dir:
            from graph_trainer.numerics import EagerRecorder, record_eager_forward

            recorder = EagerRecorder()
            fwd, bwd = record_eager_forward(self.model, recorder), recorder
        else:
            fwd = bwd = contextlib.nullcontext()
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():  # as torchtitan's train_context
            with fwd:
                loss = loss_fn(self.model(tokens), labels, self.dp_group)
            if self.record_dir:
                recorder.phase = "backward"
            with bwd:
                loss.backward()
        if self.record_dir:
            grads = [(n, p.grad) for n, p in self.model.named_parameters() if p.requires_grad]
            _save_records(self, recorder.records, loss, grads, "eager")
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torchtitan's ``clip_grad_norm_`` over :attr:`params`; returns the total norm."""
        from torchtitan.distributed.utils import clip_grad_norm_

        return clip_grad_norm_(self.params, max_norm, foreach=True)

    def global_loss(self, loss: torch.Tensor) -> float:
        """The global batch's mean token loss from this rank's ``loss`` (see :func:`global_loss`)."""
        return global_loss(loss, self.dp_group)


def _save_records(step, records: dict, loss, named_grads, mode: str) -> None:
    """Add the step's loss and gradients to ``records``, write them (graph_trainer.numerics)
    and turn recording off (step 1 only)."""
    from graph_trainer.numerics import add_step_outputs, save

    add_step_outputs(records, loss, named_grads)
    path = save(step.record_dir, step.rank, records, {"mode": mode, "rank": step.rank})
    logger.info(f"Recorded {len(records)} op outputs of step 1 in {path}")
    step.record_dir = None


def global_loss(loss: torch.Tensor, dp_group=None) -> float:
    """Sum of the ranks' ``loss`` (0-d; each is a token-loss sum over the global token count,
    :func:`graph_trainer.model.loss_fn`) over ``dp_group`` (ProcessGroup, 1-D DeviceMesh or
    ``None`` for one rank): the global batch's mean token loss, as torchtitan logs it. TP ranks
    hold the same loss and are not summed."""
    loss = loss.detach()
    if hasattr(loss, "full_tensor"):  # TP loss parallel: a replicated DTensor
        loss = loss.full_tensor()
    if dp_group is not None:
        import torch.distributed._functional_collectives as funcol

        loss = funcol.wait_tensor(funcol.all_reduce(loss, "sum", dp_group))
    return float(loss)


def build_train_step(cfg, model, parallel_dims, device: torch.device, rank: int, world_size: int):
    """The step of ``cfg.compile.mode`` for ``model`` (built on ``device``, weights initialised).

    ``aot_fx_trace``: TP plan, AC wrappers and traceable FSDP shards
    (:func:`graph_trainer.distributed.parallelize.distribute_for_trace`), and the pass pipeline of
    ``[compile]`` (:func:`graph_trainer.compiler.pipeline.build_pipeline`). ``eager`` / ``jit``:
    torchtitan's parallelization (per-block torch.compile for ``jit``).

    Returns:
        :class:`TracedTrainStep` or :class:`EagerTrainStep`.
    """
    from graph_trainer.distributed import parallelize

    if cfg.compile.mode != "aot_fx_trace":
        cfg.compile.enable = cfg.compile.mode == "jit"
        cfg.compile.components = ["model"]
        model = parallelize.parallelize_eager(model, parallel_dims, cfg, device)
        dp = parallel_dims.get_optional_mesh("batch") if world_size > 1 and parallel_dims.dp_enabled else None
        return EagerTrainStep(model, dp, loss_parallel=parallel_dims.tp > 1 and not cfg.parallelism.disable_loss_parallel,
                              record_dir=cfg.debug.record_numerics or None, rank=rank)

    import functools

    from graph_trainer.model import block_layout
    from graph_trainer.compiler.memory_policy import GiB, default_budget_bytes, state_bytes
    from graph_trainer.compiler.pipeline import plan_pipeline

    layout = block_layout(model)
    tpar = parallelize.distribute_for_trace(model, cfg, parallel_dims, device, rank, world_size)
    if cfg.compile.memory_budget_gib > 0:
        budget, source = int(cfg.compile.memory_budget_gib * GiB), "--compile.memory_budget_gib"
    else:
        budget, source = default_budget_bytes(device)
    logger.info(f"Memory budget {budget / GiB:.1f} GiB per rank ({source})")
    pipeline = functools.partial(
        plan_pipeline, cfg.compile, layout, budget_bytes=budget, state_bytes=state_bytes(tpar.params),
        has_fsdp=tpar.sharded, deterministic=cfg.debug.deterministic,
    )
    pdtype = parallelize.DTYPES[cfg.training.mixed_precision_param]
    dump = None
    if cfg.compile.dump_graphs and rank == 0:  # one rank writes the graphs; an older dump is kept
        from graph_trainer.metrics import keep_previous

        dump = cfg.job.dump_folder
        if kept := keep_previous(os.path.join(dump, "graphs")):
            logger.info(f"The earlier {os.path.join(dump, 'graphs')} is kept as {kept}")
    return TracedTrainStep(model, tpar, pipeline, None if pdtype == torch.float32 else pdtype, dump_folder=dump,
                           record_dir=cfg.debug.record_numerics or None, rank=rank)
