"""The training step as an object: one call of the train loop produces the gradients.

``aot_fx_trace`` (:class:`TracedTrainStep`): the first call traces forward + loss + backward into one FX graph and runs
the pass pipeline over it; every call replays it. ``eager`` / ``jit`` (:class:`EagerTrainStep`):
``loss_fn(model(tokens), labels).backward()`` on the torchtitan-parallelized model. Both have ``step(tokens, labels) ->
loss``, ``clip_grad_norm_``, ``global_loss``, ``params``, ``opt_module`` (what the optimizer and the checkpointer see)
and ``stats`` (for the run summary)."""

import functools
import os
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor.parallel import loss_parallel
from torch.fx._lazy_graph_module import _LazyGraphModule

from graph_trainer import logger, numerics
from graph_trainer.compiler import graph_cache
from graph_trainer.compiler.graph_values import placeholder_vals
from graph_trainer.compiler.memory_policy import GiB, default_budget_bytes, state_bytes
from graph_trainer.compiler.pipeline import plan_pipeline, run_pipeline
from graph_trainer.compiler.report import format_pass_table
from graph_trainer.distributed import parallelize
from graph_trainer.metrics import keep_previous
from graph_trainer.model import block_layout, loss_fn
from graph_trainer.trace import TracedStep


class _Step:
    """What both steps share: the global loss and writing step 1's numerics records."""

    dp_group = None
    record_dir: str | None = None
    rank = 0
    hash_view = None  # (i, t) -> t as hashed (--debug.state_hashes): the param's own layout

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' 0-d ``loss`` over ``dp_group`` (ProcessGroup, 1-D DeviceMesh or None): the global
        batch's mean token loss, as torchtitan logs it (TP ranks hold the same loss). A 0-d tensor on ``loss``'s
        device, the host not waiting for it."""
        loss = loss.detach()
        if hasattr(loss, "full_tensor"):  # TP loss parallel: a replicated DTensor
            loss = loss.full_tensor()
        if self.dp_group is not None:
            loss = funcol.wait_tensor(funcol.all_reduce(loss, "sum", self.dp_group))
        return loss

    def _save_records(self, records: dict, loss, named_grads, mode: str) -> None:
        """Add loss and gradients to ``records``, write them and turn recording off (step 1 only)."""
        numerics.add_step_outputs(records, loss, named_grads)
        path = numerics.save(self.record_dir, self.rank, records, {"mode": mode, "rank": self.rank})
        logger.info(f"Recorded {len(records)} op outputs of step 1 in {path}")
        self.record_dir = None


class TracedTrainStep(_Step):
    """``aot_fx_trace``: trace once, run the pass pipeline, replay. ``model`` / ``tpar``: from
    ``distribute_for_trace``; ``pipeline``: ``PipelineStep`` s, or ``plan_pipeline`` of the traced graph;
    ``param_dtype``: compute dtype (None: the parameters'); ``dump_folder``: where ``graphs/`` goes;
    ``record_dir``: step 1's op records; ``cache_path``: this run's graph cache entry."""

    def __init__(self, model, tpar, pipeline, param_dtype: torch.dtype | None, dump_folder: str | None = None,
                 record_dir: str | None = None, rank: int = 0, cache_path: str | None = None):
        self.model, self.tpar, self.record_dir, self.rank = model, tpar, record_dir, rank
        self.cache_path = Path(cache_path) if cache_path else None
        self.pipeline = pipeline if callable(pipeline) else list(pipeline)
        self.param_dtype, self.dump_folder = param_dtype, dump_folder
        self.params, self.opt_module, self.dp_group = tpar.params, tpar.opt_module, tpar.dp_group
        self.buffers = list(model.buffers())
        self.graph = None  # graph_trainer.trace.TracedStep after the first call
        self.stats: dict = {}

    def compile(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Trace the step for ``[B, S]`` int64 batches shaped like ``tokens`` / ``labels`` and run
        the pipeline over the graph (the first call does it)."""
        t0 = time.perf_counter()
        cached = graph_cache.load(self.cache_path) if self.cache_path else None
        if cached is not None:
            self.pipeline, self.stats = cached["steps"], dict(cached["stats"])
            steps, names = ", ".join(s.name for s in self.pipeline), (cached["param_names"], cached["buffer_names"])
            if compiled := cached.get("compiled"):  # nothing left to run
                traced = TracedStep(compiled, *names, 0.0)
                what = f"the compiled step {graph_cache.compiled_path(self.cache_path)}"
                skipped = f"no trace, memory policy, passes or [{steps}]"
            else:
                gm = cached["gm"]
                traced = TracedStep(gm, *names, 0.0, placeholder_vals(gm))
                what = f"{self.cache_path} ({len(gm.graph.nodes)} nodes)"
                skipped = f"no trace, memory policy or passes before [{steps}]"
            logger.info(f"graph cache: loaded {what} in {time.perf_counter() - t0:.2f}s: {skipped}; memory policy as "
                        f"cached: {self.stats.get('memory_policy', '-')}, predicted peak "
                        f"{self.stats.get('predicted_peak_gib')} GiB")
            if not compiled:
                records = list(self.stats.get("passes", []))
                traced.gm = run_pipeline(traced.gm, traced.example_inputs, self.pipeline, records=records)
                self.stats["passes"] = records
            self.stats.update(trace_time_s=0.0, compile_time_s=time.perf_counter() - t0,
                              graph_cache="compiled" if compiled else "hit")
            self.graph = traced
            return
        logger.info("Tracing the training step (forward + loss + backward) into one FX graph ...")
        loss = functools.partial(loss_fn, dp_group=self.dp_group)
        traced = self.tpar.trace(self.model, loss, tokens, labels, self.param_dtype)
        n_nodes = len(traced.gm.graph.nodes)
        if self.record_dir:  # op identities, fixed before any pass moves a node
            numerics.assign_keys(traced.gm)
        ops = Counter(str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function")
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
        logger.info(f"Traced the training step in {traced.trace_time_s:.2f}s: one graph, {n_nodes} nodes "
                    f"({len(traced.param_names)} params -> {len(traced.param_names)} grads); top ops: {top}")
        t0 = time.perf_counter()
        if callable(self.pipeline):
            self.pipeline, policy = self.pipeline(traced.gm)
            self.stats.update(
                memory_policy=policy.levers.flags(), memory_budget_gib=round(policy.budget_bytes / GiB, 2),
                predicted_peak_gib=round(policy.predicted_peak_bytes / GiB, 2),
                graph_estimate_gib=round(policy.graph_peak_bytes / GiB, 2),
                state_gib=round(policy.state_bytes / GiB, 2))
        records: list[dict] = []  # one per pass (graph_trainer.compiler.report.pass_record)
        # lazy: a pass's recompile() only marks the code stale; it is generated once, at the first call
        gm = _LazyGraphModule.from_graphmodule(traced.gm)
        if self.cache_path:  # the passes before the first compiling one, the cache entry, the rest
            cut = graph_cache.compile_index(self.pipeline)
            gm = run_pipeline(gm, traced.example_inputs, self.pipeline[:cut], records=records)
            rest, names = self.pipeline[cut:], (traced.param_names, traced.buffer_names)
            entry = {**self.stats, "trace_time_s": traced.trace_time_s, "graph_nodes": n_nodes, "passes": list(records)}
            if not graph_cache.stores_compiled(rest):
                graph_cache.save(self.cache_path, gm, *names, rest, entry)
                traced.gm = run_pipeline(gm, traced.example_inputs, rest, records=records)
            else:  # the compiled step is the entry: no graph pickled
                with graph_cache.recording():
                    traced.gm = run_pipeline(gm, traced.example_inputs, rest, records=records)
                    saved = graph_cache.save_compiled(self.cache_path, traced.gm, rest)
                if saved:
                    graph_cache.save(self.cache_path, traced.gm, *names, rest, entry, graph=False)
        else:
            traced.gm = run_pipeline(gm, traced.example_inputs, self.pipeline, dump_folder=self.dump_folder,
                                     records=records)
        compile_s = time.perf_counter() - t0
        logger.info(f"Pass pipeline [{', '.join(s.name for s in self.pipeline)}] took {compile_s:.2f}s")
        logger.info("Per-pass report (nodes by kind, regions, static peak estimate):\n%s", format_pass_table(records))
        self.stats.update(trace_time_s=traced.trace_time_s, compile_time_s=compile_s, graph_nodes=n_nodes,
                          passes=records)
        self.graph = traced

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Run the step: sets ``p.grad`` of every parameter in :attr:`params`; returns this rank's loss (0-d fp32)."""
        if self.graph is None:
            self.compile(tokens, labels)
        records: dict = {}  # a fully compiled graph (not a GraphModule) records its outputs only
        if self.record_dir and isinstance(self.graph.gm, torch.fx.GraphModule):
            recorder = numerics.GraphRecorder(self.graph.gm)
            with torch.no_grad():
                out = recorder.run(*self.params, *self.buffers, tokens, labels)
            loss, grads, records = out[0], list(out[1:]), recorder.records
        else:
            loss, grads = self.graph(self.params, self.buffers, tokens, labels)
        if not self.tpar.sharded:
            parallelize.all_reduce_grads(grads)  # replicated DP: sum (no-op on one rank)
        for p, g in zip(self.params, grads):
            p.grad = g
        if self.record_dir:
            self._save_records(records, loss, list(zip(self.graph.param_names, grads)), "aot_fx_trace")
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm (over all ranks when sharded); returns it."""
        return self.tpar.clip_grad_norm_(max_norm)

    def hash_view(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """``t`` shaped like param ``i`` in the eager baseline's local shape (``--debug.state_hashes``)."""
        return self.tpar.as_fsdp2_local(i, t)


class EagerTrainStep(_Step):
    """``eager`` / ``jit``: autograd on the model after ``parallelize_eager``; ``dp_group``: torchtitan's
    ``batch`` mesh or None; ``loss_parallel``: under TP's ``loss_parallel()``; ``record_dir`` as traced."""

    def __init__(self, model, dp_group=None, loss_parallel: bool = False, record_dir: str | None = None, rank: int = 0):
        self.model, self.dp_group, self.loss_parallel = model, dp_group, loss_parallel
        self.record_dir, self.rank = record_dir, rank
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt_module = model
        self.stats: dict = {}

    def __call__(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward, loss, backward (``p.grad`` accumulates); returns this rank's loss."""
        recorder = numerics.EagerRecorder() if self.record_dir else None
        with loss_parallel() if self.loss_parallel else nullcontext():  # as torchtitan's train_context
            with numerics.record_eager_forward(self.model, recorder) if recorder else nullcontext():
                loss = loss_fn(self.model(tokens), labels, self.dp_group)
            if recorder:
                recorder.phase = "backward"
            with recorder or nullcontext():
                loss.backward()
        if recorder:
            grads = [(n, p.grad) for n, p in self.model.named_parameters() if p.requires_grad]
            self._save_records(recorder.records, loss, grads, "eager")
        return loss

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torchtitan's ``clip_grad_norm_`` over :attr:`params`; returns the total norm."""
        from torchtitan.distributed.utils import clip_grad_norm_

        return clip_grad_norm_(self.params, max_norm, foreach=True)


def real_peers(world_size: int, comm_mode: str) -> bool:
    """Whether the step's collectives run among several processes (NCCL), not as one process's local copies."""
    return world_size > 1 and comm_mode != "fake_collectives"


def may_replay_as_cuda_graph(device: torch.device, world_size: int, comm_mode: str, record_dir: str | None) -> bool:
    """Whether the memory policy may replay the traced step as a CUDA graph: on CUDA, in one process (no
    real NCCL peers to capture), not while step 1 records numerics."""
    return device.type == "cuda" and not record_dir and not real_peers(world_size, comm_mode)


def build_train_step(cfg, model, parallel_dims, device: torch.device, rank: int, world_size: int):
    """The step of ``cfg.compile.mode`` for ``model`` (weights initialised on ``device``):
    :class:`TracedTrainStep` or :class:`EagerTrainStep`."""
    record_dir = cfg.debug.record_numerics or None
    if cfg.compile.mode != "aot_fx_trace":
        cfg.compile.enable = cfg.compile.mode == "jit"
        cfg.compile.components = ["model"]
        model = parallelize.parallelize_eager(model, parallel_dims, cfg, device)
        dp = parallel_dims.get_optional_mesh("batch") if world_size > 1 and parallel_dims.dp_enabled else None
        loss_par = parallel_dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
        return EagerTrainStep(model, dp, loss_parallel=loss_par, record_dir=record_dir, rank=rank)

    layout = block_layout(model)
    tpar = parallelize.distribute_for_trace(model, cfg, parallel_dims, device, rank, world_size)
    budget, source = ((int(cfg.compile.memory_budget_gib * GiB), "--compile.memory_budget_gib")
                      if cfg.compile.memory_budget_gib > 0 else default_budget_bytes(device))
    logger.info(f"Memory budget {budget / GiB:.1f} GiB per rank ({source})")
    pipeline = functools.partial(plan_pipeline, cfg.compile, layout, budget_bytes=budget,
                                 state_bytes=state_bytes(tpar.params), has_fsdp=tpar.sharded,
                                 deterministic=cfg.debug.deterministic, device_type=device.type,
                                 tp_group_name=tpar.tp_group_name, peers=real_peers(world_size, cfg.comm.mode),
                                 cudagraph=may_replay_as_cuda_graph(device, world_size, cfg.comm.mode, record_dir))
    pdtype = parallelize.DTYPES[cfg.training.mixed_precision_param]
    dump = None
    if cfg.compile.dump_graphs and rank == 0:  # one rank writes the graphs; an older dump is kept
        dump = cfg.job.dump_folder
        if kept := keep_previous(os.path.join(dump, "graphs")):
            logger.info(f"The earlier {os.path.join(dump, 'graphs')} is kept as {kept}")
    cache_path, folder = None, graph_cache.cache_dir(cfg.compile.graph_cache_dir, cfg.compile.inductor_compilation)
    if folder and not (dump or record_dir):
        cache_path = os.path.join(folder, f"{graph_cache.cache_key(cfg, rank, world_size, device)}.pkl")
    elif folder:
        logger.info("graph cache: off with --compile.dump_graphs / --debug.record_numerics")
    return TracedTrainStep(model, tpar, pipeline, None if pdtype == torch.float32 else pdtype, dump_folder=dump,
                           record_dir=record_dir, rank=rank, cache_path=cache_path)
