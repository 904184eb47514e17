"""The pipeline: build it from the config and the registry (:func:`build_pipeline`), let the memory policy pick
the levers left on ``auto`` (:func:`plan_pipeline`), run it and record what each pass did (:func:`run_pipeline`)."""

import copy
import dataclasses
import difflib
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from graph_trainer import logger
from graph_trainer.compiler import report
from graph_trainer.compiler.collectives import collective_kind
from graph_trainer.compiler.graph_values import val_bytes
from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.memory_policy import LEVER_PASSES, Levers, MemoryPolicy, choose_levers
from graph_trainer.compiler.node_meta import is_tagged_recompute, pop_pass_summary
from graph_trainer.compiler.ops import num_nodes, op_counts
from graph_trainer.compiler.registry import PassContext, PipelineStep, named_passes, pass_step, registry, resolve


def configured_levers(compile_cfg: Any, levers: Levers | None = None) -> tuple[Levers, set[str]]:
    """``(levers, fields the config sets)``: the levers the config sets (``cudagraph``: where ``--compile.passes`` or
    ``disable_passes`` names it), the others from ``levers`` (else the leanest)."""
    fsdp = compile_cfg.fsdp
    added, disabled = named_passes(compile_cfg)
    given = {
        "save": compile_cfg.sac.save if compile_cfg.sac.save != "auto" else None,
        "keep_last_blocks": fsdp.keep_last_blocks if fsdp.keep_last_blocks >= 0 else None,
        "bucket_blocks": fsdp.bucket_blocks if fsdp.bucket_blocks >= 0 else None,
        "cudagraph": ("cudagraph" not in disabled) if "cudagraph" in added | disabled else None,
    }
    merged = Levers(**{k: getattr(levers or Levers(), k) if v is None else v for k, v in given.items()})
    return merged, {k for k, v in given.items() if v is not None}


def build_pipeline(compile_cfg: Any, layout: Any = None, *, levers: Levers | None = None, deterministic: bool = False,
                   tp_group_name: str | None = None, device_type: str | None = None) -> list[PipelineStep]:
    """The passes ``compile_cfg`` runs, in the default order, with the arguments their declarations derive from
    it and the :class:`~.registry.PassContext` of the other arguments (``layout``: the model's ``BlockLayout``;
    ``levers``: the memory policy's choice, None: the leanest). ``ValueError`` as :func:`~.registry.resolve`, and
    for kept or bucketed blocks without ``layout``."""
    chosen, _ = configured_levers(compile_cfg, levers)
    ctx = PassContext(compile_cfg, layout, chosen, deterministic, tp_group_name=tp_group_name, device_type=device_type)
    return [pass_step(name, ctx) for name in resolve(ctx)]


def block_gather_bytes(gm: torch.fx.GraphModule, layout: Any) -> int:
    """Mean bytes per rank of one block's FSDP all-gather outputs in ``gm``; 0 without them or ``layout``."""
    if layout is None or layout.n_blocks == 0:
        return 0
    sizes = [val_bytes(n.meta.get("val")) for n in gm.graph.nodes if collective_kind(n) == "all_gather_into_tensor"]
    blocks = sizes[layout.params_before: layout.params_of_first_blocks(layout.n_blocks)]
    return sum(blocks) // layout.n_blocks if len(blocks) == layout.n_blocks * layout.params_per_block else 0


def plan_pipeline(compile_cfg: Any, layout: Any, gm: torch.fx.GraphModule, *, budget_bytes: int, state_bytes: int,
                  has_fsdp: bool, deterministic: bool = False, cudagraph: bool = False, device_type: str | None = None,
                  tp_group_name: str | None = None, peers: bool = False,
                  estimates: dict | None = None) -> tuple[list[PipelineStep], MemoryPolicy]:
    """``(pipeline, policy)``: :func:`build_pipeline` after :func:`~.memory_policy.choose_levers` picked the levers
    left on ``auto`` for the traced graph ``gm``, each estimate running the ``in_memory_trial`` passes on a copy.
    ``budget_bytes``: peak reserved bytes per rank; ``state_bytes``: :func:`~.memory_policy.state_bytes`;
    ``has_fsdp``: traced FSDP shards the parameters; ``cudagraph``: the step may replay as a CUDA graph;
    ``tp_group_name``: the TP group of the traced collectives (None: no TP); ``peers``: they run among several
    processes (the policy's calibration);
    ``estimates``: a dict shared by calls that differ in the budget only, which keeps each graph estimate."""
    fixed, fixed_fields = configured_levers(compile_cfg)
    ctx = PassContext(compile_cfg, layout, None, deterministic, device_type=device_type)
    names = resolve(ctx)
    trial = [n for n in names if registry()[n].in_memory_trial]
    # the trial passes before the first lever's pass do not depend on the candidate: run them once
    first = next((i for i, n in enumerate(trial) if n in LEVER_PASSES.values()), len(trial))
    has_sac = LEVER_PASSES["save"] in names and any(map(is_tagged_recompute, gm.graph.nodes))
    has_fsdp = has_fsdp and LEVER_PASSES["keep_last_blocks"] in names
    known = {} if estimates is None else estimates

    def estimate(save: str) -> int:
        if save in known:
            return known[save]
        if "clean" not in known:  # lazy: the trials never run the graphs, so no pass generates code
            known["clean"] = run_pipeline(_LazyGraphModule.from_graphmodule(copy.deepcopy(gm)), None, trial[:first],
                                          quiet=True)
        steps = [pass_step(n, dataclasses.replace(ctx, levers=Levers(save, 0, 0))) for n in trial[first:]]
        known[save] = estimate_peak_memory(run_pipeline(copy.deepcopy(known["clean"]), None, steps, quiet=True),
                                           fused=compile_cfg.inductor_compilation == "full")[0]
        return known[save]

    t0 = time.perf_counter()
    policy = choose_levers(estimate, n_blocks=layout.n_blocks if layout is not None else 0,
                           block_bytes=block_gather_bytes(gm, layout), state=state_bytes, budget=budget_bytes,
                           inductor=compile_cfg.inductor_compilation, fixed=fixed, fixed_fields=fixed_fields,
                           has_fsdp=has_fsdp and layout is not None, has_sac=has_sac,
                           cudagraph=cudagraph and compile_cfg.inductor_compilation != "full", peers=peers)
    logger.info("%s [%.1fs]", policy.describe(), time.perf_counter() - t0)
    if not policy.fits:
        logger.warning("the predicted peak exceeds the memory budget (--compile.memory_budget_gib); "
                       "the step may run out of memory")
    return build_pipeline(compile_cfg, layout, levers=policy.levers, deterministic=deterministic,
                          tp_group_name=tp_group_name, device_type=device_type), policy


def run_pipeline(gm: torch.fx.GraphModule, example_inputs: Any, pipeline: Iterable[PipelineStep | str], *,
                 dump_folder: str | None = None, quiet: bool = False,
                 records: list[dict[str, Any]] | None = None) -> torch.fx.GraphModule:
    """Run the passes of ``pipeline`` (:class:`PipelineStep` s or pass names) in order and return the final module;
    log one line per pass and append its :func:`~graph_trainer.compiler.report.pass_record` to ``records`` if given.
    ``dump_folder``: write ``graphs/`` there (the readable graph before and after each pass, diffs, ``summary.json``);
    with ``TORCH_TRACE`` the same as tlparse artifacts. ``quiet``: no logs, artifacts or memory estimates. Raises
    ``ValueError`` for an unknown pass name, and whatever a pass raises."""
    steps = [s if isinstance(s, PipelineStep) else pass_step(s) for s in pipeline]
    trace = not quiet and report.trace_enabled()
    graphs_dir = Path(dump_folder, "graphs") if dump_folder is not None else None
    run_records, dumped = [], []  # this call's pass records; graphs/summary.json's rows
    text = report.readable_graph(gm) if graphs_dir is not None or trace else None
    if graphs_dir is not None:
        graphs_dir.mkdir(parents=True, exist_ok=True)
        (graphs_dir / "00_input.py").write_text(text)
        dumped.append({"index": 0, "pass": "input", "nodes": num_nodes(gm), "ops": op_counts(gm)})
    if trace:
        report.trace_artifact("graph_before_passes", lambda: text)

    pop_pass_summary(gm)
    before = report.snapshot(gm, memory=not quiet)
    prev_name = "00_input"
    for i, step in enumerate(steps, start=1):
        t0 = time.perf_counter()
        gm = step(gm, example_inputs)
        elapsed = time.perf_counter() - t0
        summary, stats = pop_pass_summary(gm)
        after = report.snapshot(gm, memory=not quiet)
        record = report.pass_record(i, step.name, elapsed, before, after, summary, stats)
        run_records.append(record)
        if records is not None:
            records.append(record)
        before = after
        if not quiet:
            nodes = ["n/a" if n is None else n for n in (record["nodes_before"], record["nodes_after"])]
            logger.info("graph pass %-46s %8.3fs  nodes %s -> %s  %s", step.name, elapsed, *nodes, summary)
        if text is None:
            continue
        name = f"{i:02d}_{step.name}"
        new_text = report.readable_graph(gm)
        diff = "".join(difflib.unified_diff(text.splitlines(True), new_text.splitlines(True), f"{prev_name}.py",
                                            f"{name}.py"))
        text, prev_name = new_text, name
        if graphs_dir is not None:
            (graphs_dir / f"{name}.py").write_text(text)
            (graphs_dir / f"{name}.diff").write_text(diff)
            dumped.append({**record, "ops": op_counts(gm)})
            (graphs_dir / "summary.json").write_text(json.dumps(dumped, indent=1))
        if trace:
            report.trace_artifact(f"graph_after_{step.name}", lambda: text)
            report.trace_artifact(f"graph_diff_{step.name}", lambda: diff)
            report.trace_artifact(f"pass_record_{step.name}", lambda: record, encoding="json")
    if trace:
        report.trace_artifact("pass_table", lambda: report.format_pass_table(run_records))
        report.trace_artifact("pass_records", lambda: run_records, encoding="json")
    return gm
