"""The ordered graph-pass pipeline: registry, the one default order, the builder, the runner.

Order (:data:`DEFAULT_ORDER`, the only place it is defined; ``[compile]`` flags in brackets)::

    remove_dead_code -> remove_noop_views
      -> sac_recompute                                   [sac.save]; op-level selective AC only
      -> reshard_after_forward                           [fsdp.keep_last_blocks]; FSDP only
      -> async_tp                                        [passes = async_tp]; TP only
      -> overlap_collectives                             (no-op without collectives)
      -> bucket_collectives                              [fsdp.bucket_blocks != 0]
      -> annotate_flex_attention_for_regional_inductor   (if FlexAttention is used)
      -> annotate_rmsnorm_for_regional_inductor          [numerics_changing_optim]
      -> annotate_pointwise_for_regional_inductor        [passes = annotate_pointwise]
      -> regional_inductor | full_inductor               [inductor_compilation]
      -> cudagraph                                       [passes = cudagraph]

:func:`build_pipeline` is the only place where a ``[compile]`` field becomes a pass
argument; :func:`plan_pipeline` first lets the memory policy
(:mod:`graph_trainer.passes.memory_policy`) pick the levers left on ``auto`` from the traced
graph; :func:`run_pipeline` runs the result in a plain loop and records what each pass
did (:mod:`graph_trainer.passes.pass_report`: the per-pass table, readable dumps with diffs,
TORCH_TRACE artifacts for tlparse). Every pass has the signature
``(gm, example_inputs, **options) -> gm`` and reports a short summary via ``gm.meta``
(:func:`graph_trainer.passes.common.set_pass_summary`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from graph_trainer.passes.common import collective_kind, has_recompute_tags, num_nodes, op_counts, pop_pass_summary
from graph_trainer.passes.annotate_flex_attention import annotate_flex_attention_for_regional_inductor_pass
from graph_trainer.passes.annotate_pointwise import annotate_pointwise_for_regional_inductor_pass
from graph_trainer.passes.annotate_rmsnorm import annotate_rmsnorm_for_regional_inductor_pass
from graph_trainer.passes.async_tp import async_tp_pass
from graph_trainer.passes.bucket_collectives import bucket_collectives_pass
from graph_trainer.passes.cudagraph import cudagraph_pass
from graph_trainer.passes.full_inductor import full_inductor_pass
from graph_trainer.passes.memory_policy import Levers, MemoryPolicy
from graph_trainer.passes.overlap_collectives import overlap_collectives_pass
from graph_trainer.passes.regional_inductor import regional_inductor_pass
from graph_trainer.passes.reshard_after_forward import reshard_after_forward_pass
from graph_trainer.passes.sac_recompute import sac_recompute_pass
from graph_trainer.passes.remove_dead_code import remove_dead_code_pass
from graph_trainer.passes.remove_noop_views import remove_noop_views_pass

logger = logging.getLogger("graph_trainer")

REMOVE_DEAD_CODE = "remove_dead_code"
REMOVE_NOOP_VIEWS = "remove_noop_views"
SAC_RECOMPUTE = "sac_recompute"
OVERLAP_COLLECTIVES = "overlap_collectives"
RESHARD_AFTER_FORWARD = "reshard_after_forward"
ASYNC_TP = "async_tp"
BUCKET_COLLECTIVES = "bucket_collectives"
ANNOTATE_FLEX_ATTENTION = "annotate_flex_attention_for_regional_inductor"
ANNOTATE_RMSNORM = "annotate_rmsnorm_for_regional_inductor"
ANNOTATE_POINTWISE = "annotate_pointwise_for_regional_inductor"
REGIONAL_INDUCTOR = "regional_inductor"
FULL_INDUCTOR = "full_inductor"
CUDAGRAPH = "cudagraph"

#: name -> pass. Names are the function names without the ``_pass`` suffix.
PASSES: dict[str, Callable[..., Any]] = {
    REMOVE_DEAD_CODE: remove_dead_code_pass,
    REMOVE_NOOP_VIEWS: remove_noop_views_pass,
    # memory-policy passes
    SAC_RECOMPUTE: sac_recompute_pass,
    RESHARD_AFTER_FORWARD: reshard_after_forward_pass,
    # after SAC's recompute copies exist, before the remaining collectives are scheduled
    ASYNC_TP: async_tp_pass,
    OVERLAP_COLLECTIVES: overlap_collectives_pass,
    BUCKET_COLLECTIVES: bucket_collectives_pass,
    ANNOTATE_FLEX_ATTENTION: annotate_flex_attention_for_regional_inductor_pass,
    ANNOTATE_RMSNORM: annotate_rmsnorm_for_regional_inductor_pass,
    ANNOTATE_POINTWISE: annotate_pointwise_for_regional_inductor_pass,
    REGIONAL_INDUCTOR: regional_inductor_pass,
    FULL_INDUCTOR: full_inductor_pass,
    CUDAGRAPH: cudagraph_pass,
}

#: The canonical order; resolved pass lists are always sorted by it.
DEFAULT_ORDER: list[str] = list(PASSES)

#: Accepted alternative spellings -> canonical name.
ALIASES: dict[str, str] = {
    **{f"{name}_pass": name for name in PASSES},
    "annotate_flex_attention": ANNOTATE_FLEX_ATTENTION,
    "annotate_rmsnorm": ANNOTATE_RMSNORM,
    "rmsnorm": ANNOTATE_RMSNORM,
    "annotate_pointwise": ANNOTATE_POINTWISE,
    "pointwise": ANNOTATE_POINTWISE,
    "dce": REMOVE_DEAD_CODE,
    "full_inductor_compilation": FULL_INDUCTOR,
    "micro_pipeline_tp": ASYNC_TP,
}

INDUCTOR_COMPILATION_MODES = ("regional", "full", "none")

#: Passes that change numerics: they need ``--compile.numerics_changing_optim``.
NUMERICS_CHANGING: frozenset[str] = frozenset({ANNOTATE_RMSNORM, ANNOTATE_POINTWISE})
#: Passes that compile the graph (they need real tensors; the dry run skips them).
COMPILING: frozenset[str] = frozenset({REGIONAL_INDUCTOR, FULL_INDUCTOR, CUDAGRAPH})


def canonical_pass_name(name: str) -> str:
    """Canonical registry name for ``name`` (or an alias).

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    key = name.strip()
    if key in PASSES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    raise ValueError(f"unknown graph pass {name!r}; valid passes: {', '.join(DEFAULT_ORDER)}")


def split_names(value: str | Iterable[str] | None) -> list[str]:
    """``"a, b,,c"`` (or a list of names) -> ``["a", "b", "c"]``."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return [v.strip() for v in items if v.strip()]


def resolve_pass_names(compile_cfg: Any, *, uses_flex_attention: bool = False) -> list[str]:
    """The pass names ``compile_cfg`` (the ``[compile]`` section) runs, in :data:`DEFAULT_ORDER`.

    The default list: the cleanup passes, ``sac_recompute`` (a no-op without op-level
    selective AC), ``reshard_after_forward`` and ``overlap_collectives`` (no-ops for graphs
    without FSDP / collectives), ``bucket_collectives`` (``fsdp.bucket_blocks`` not 0), the
    FlexAttention annotation (``uses_flex_attention``), the RMSNorm annotation
    (``numerics_changing_optim`` with ``inductor_compilation = "regional"``; with ``"full"``
    Inductor compiles every norm anyway) and the compile pass of ``inductor_compilation``.
    Then the passes named in ``passes`` are added and those in ``disable_passes`` removed.

    Raises:
        ValueError: unknown names or ``inductor_compilation``; a pass of
            :data:`NUMERICS_CHANGING` without ``numerics_changing_optim``; an annotation
            pass without a later ``regional_inductor`` (it only tags regions for it);
            ``regional_inductor`` together with ``full_inductor``.
    """
    inductor = compile_cfg.inductor_compilation
    if inductor not in INDUCTOR_COMPILATION_MODES:
        raise ValueError(
            f"--compile.inductor_compilation must be one of {', '.join(INDUCTOR_COMPILATION_MODES)}; got {inductor!r}"
        )
    names = [REMOVE_DEAD_CODE, REMOVE_NOOP_VIEWS, SAC_RECOMPUTE, RESHARD_AFTER_FORWARD, OVERLAP_COLLECTIVES]
    if compile_cfg.fsdp.bucket_blocks != 0:
        names.append(BUCKET_COLLECTIVES)
    if uses_flex_attention:
        names.append(ANNOTATE_FLEX_ATTENTION)
    if compile_cfg.numerics_changing_optim and inductor == "regional":
        names.append(ANNOTATE_RMSNORM)
    if inductor == "regional":
        names.append(REGIONAL_INDUCTOR)
    elif inductor == "full":
        names.append(FULL_INDUCTOR)
    added = [canonical_pass_name(n) for n in split_names(compile_cfg.passes)]
    disabled = {canonical_pass_name(n) for n in split_names(compile_cfg.disable_passes)}
    names = sorted({n for n in names + added if n not in disabled}, key=DEFAULT_ORDER.index)

    changing = [n for n in names if n in NUMERICS_CHANGING]
    if changing and not compile_cfg.numerics_changing_optim:
        raise ValueError(
            f"{', '.join(changing)} changes numerics (Inductor fuses bf16 chains in fp32): add "
            f"--compile.numerics_changing_optim to enable it"
        )
    for annotation in (ANNOTATE_RMSNORM, ANNOTATE_POINTWISE):
        if annotation in names and REGIONAL_INDUCTOR not in names:
            raise ValueError(
                f"the annotation pass {annotation} only has an effect when regional_inductor compiles "
                f"the tagged regions, but --compile.inductor_compilation is {inductor!r} and the passes "
                f"are {names}; use --compile.inductor_compilation regional or disable the annotation pass"
            )
    if REGIONAL_INDUCTOR in names and FULL_INDUCTOR in names:
        raise ValueError("regional_inductor and full_inductor are mutually exclusive")
    return names


@dataclass
class PipelineStep:
    """One pass of a pipeline with its options: ``step(gm, example_inputs)`` runs
    ``fn(gm, example_inputs, **options)``."""

    name: str
    fn: Callable[..., Any]
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        return self.fn(gm, example_inputs, **self.options)


def configured_levers(compile_cfg: Any, levers: Levers | None = None) -> tuple[Levers, set[str]]:
    """``(levers, fields the config sets)``: ``[compile.sac] save`` and ``[compile.fsdp]``
    ``keep_last_blocks`` / ``bucket_blocks`` where set; the others from ``levers`` (the
    memory policy's choice), else the leanest (``recompute``, 0, 0)."""
    fsdp = compile_cfg.fsdp
    given = {
        "save": compile_cfg.sac.save if compile_cfg.sac.save != "auto" else None,
        "keep_last_blocks": fsdp.keep_last_blocks if fsdp.keep_last_blocks >= 0 else None,
        "bucket_blocks": fsdp.bucket_blocks if fsdp.bucket_blocks >= 0 else None,
    }
    base = levers or Levers()
    merged = Levers(**{k: getattr(base, k) if v is None else v for k, v in given.items()})
    return merged, {k for k, v in given.items() if v is not None}


def lever_options(levers: Levers, layout: Any) -> dict[str, dict[str, Any]]:
    """Options of ``sac_recompute``, ``reshard_after_forward`` and ``bucket_collectives``
    for ``levers`` (blocks are converted to parameter / collective counts with ``layout``,
    the model's ``graph_trainer.model.BlockLayout``).

    Raises:
        ValueError: kept blocks or buckets without ``layout``.
    """
    if layout is None and (levers.bucket_blocks > 0 or levers.keep_last_blocks > 0):
        raise ValueError("--compile.fsdp.bucket_blocks / keep_last_blocks need the model's block layout")
    options: dict[str, dict[str, Any]] = {}
    if levers.save == "matmuls":
        options[SAC_RECOMPUTE] = {"save_ops": [torch.ops.aten.mm.default]}
    elif levers.save == "all":
        options[SAC_RECOMPUTE] = {"save_all": True}
    if levers.keep_last_blocks > 0:
        first = layout.params_of_first_blocks(layout.n_blocks - levers.keep_last_blocks)
        options[RESHARD_AFTER_FORWARD] = {"first_params": first}
    if levers.bucket_blocks > 0:
        options[BUCKET_COLLECTIVES] = {"bucket_size": levers.bucket_blocks * layout.params_per_block}
    return options


def build_pipeline(
    compile_cfg: Any,
    layout: Any = None,
    *,
    levers: Levers | None = None,
    deterministic: bool = False,
    uses_flex_attention: bool = False,
    tp_group_name: str | None = None,
) -> list[PipelineStep]:
    """The passes of ``compile_cfg`` (the ``[compile]`` section) with their options: the
    only place where a config field becomes a pass argument.

    Args:
        compile_cfg: ``graph_trainer.config.Compile`` (Inductor config fields may be
            dicts, as after ``parse_args``, or JSON strings; empty means the default).
        layout: the model's ``graph_trainer.model.BlockLayout``; needed when blocks are
            kept or bucketed (the config counts blocks, the passes parameters / collectives).
        levers: the memory policy's choice for the levers left on ``auto``
            (:func:`configured_levers`); ``None``: the leanest.
        deterministic: ``--debug.deterministic``; turns off the timed RMSNorm config pick.
        uses_flex_attention: add the FlexAttention annotation.
        tp_group_name: the TP process group's ``group_name`` for ``async_tp``; None: the
            pass finds it in the graph (the group of the all-gathers of activations).

    Raises:
        ValueError: as :func:`resolve_pass_names`; block options without ``layout``.
    """
    from graph_trainer.passes.annotate_rmsnorm import DEFAULT_RMSNORM_CANDIDATE_CONFIGS

    chosen, _ = configured_levers(compile_cfg, levers)
    options: dict[str, dict[str, Any]] = {
        ANNOTATE_RMSNORM: {
            "inductor_configs": _configs(compile_cfg.rmsnorm.inductor_configs),
            "candidate_configs": (
                DEFAULT_RMSNORM_CANDIDATE_CONFIGS if compile_cfg.rmsnorm.tune and not deterministic else None
            ),
        },
        FULL_INDUCTOR: {
            "inductor_configs": _configs(compile_cfg.full_inductor.configs),
            "pin_collectives": compile_cfg.full_inductor.pin_collectives,
        },
        ASYNC_TP: {"fuse": compile_cfg.async_tp.fuse, "tp_group_name": tp_group_name},
        **lever_options(chosen, layout),
    }
    names = resolve_pass_names(compile_cfg, uses_flex_attention=uses_flex_attention)
    if chosen.bucket_blocks == 0:
        names = [n for n in names if n != BUCKET_COLLECTIVES]
    return [PipelineStep(n, PASSES[n], dict(options.get(n, {}))) for n in names]


def block_gather_bytes(gm: torch.fx.GraphModule, layout: Any) -> int:
    """Mean bytes per rank of one transformer block's FSDP all-gather outputs in ``gm``
    (the block's gathered weights: what keeping it, or one more block in a bucket, costs);
    0 without FSDP all-gathers or ``layout``. The FSDP all-gathers come in graph order, one
    per parameter in the model's order (:mod:`graph_trainer.fsdp`)."""
    if layout is None or layout.n_blocks == 0:
        return 0
    sizes = [
        sum(t.numel() * t.element_size() for t in pytree.tree_leaves(n.meta.get("val")) if isinstance(t, torch.Tensor))
        for n in gm.graph.nodes if collective_kind(n) == "all_gather_into_tensor"
    ]
    blocks = sizes[layout.params_before: layout.params_of_first_blocks(layout.n_blocks)]
    return sum(blocks) // layout.n_blocks if len(blocks) == layout.n_blocks * layout.params_per_block else 0


def plan_pipeline(
    compile_cfg: Any,
    layout: Any,
    gm: torch.fx.GraphModule,
    *,
    budget_bytes: int,
    state_bytes: int,
    has_fsdp: bool,
    deterministic: bool = False,
    uses_flex_attention: bool = False,
    tp_group_name: str | None = None,
) -> tuple[list[PipelineStep], MemoryPolicy]:
    """:func:`build_pipeline` after the memory policy picked the levers the config leaves on
    ``auto`` for the traced graph ``gm`` (:func:`graph_trainer.passes.memory_policy.choose_levers`).

    Each estimate runs ``sac_recompute`` and ``reshard_after_forward`` with the candidate's
    options on a copy of ``gm`` (the cleanup passes first, once) and takes
    :func:`~graph_trainer.passes.memory_estimate.estimate_peak_memory`; ``gm`` is not changed.

    Args:
        budget_bytes: peak reserved bytes per rank to plan for.
        state_bytes: :func:`graph_trainer.passes.memory_policy.state_bytes`.
        has_fsdp: the step shards parameters with traced FSDP.
        tp_group_name: as :func:`build_pipeline`.

    Returns:
        ``(pipeline, policy)``; with every lever set by the config the policy only predicts
        the peak of that setting.
    """
    from graph_trainer.passes.memory_estimate import estimate_peak_memory
    from graph_trainer.passes.memory_policy import choose_levers

    fixed, fixed_fields = configured_levers(compile_cfg)
    disabled = {canonical_pass_name(n) for n in split_names(compile_cfg.disable_passes)}
    has_sac = SAC_RECOMPUTE not in disabled and has_recompute_tags(gm.graph)
    has_fsdp = has_fsdp and RESHARD_AFTER_FORWARD not in disabled
    clean = None

    def estimate(save: str) -> int:
        nonlocal clean
        if clean is None:
            clean = run_pipeline(copy.deepcopy(gm), None, [REMOVE_DEAD_CODE, REMOVE_NOOP_VIEWS], quiet=True)
        opts = lever_options(Levers(save, 0, 0), layout)
        steps = [PipelineStep(n, PASSES[n], opts.get(n, {})) for n in (SAC_RECOMPUTE, RESHARD_AFTER_FORWARD)
                 if n not in disabled]
        return estimate_peak_memory(run_pipeline(copy.deepcopy(clean), None, steps, quiet=True))[0]

    t0 = time.perf_counter()
    policy = choose_levers(
        estimate, n_blocks=layout.n_blocks if layout is not None else 0, block_bytes=block_gather_bytes(gm, layout),
        state=state_bytes, budget=budget_bytes, inductor=compile_cfg.inductor_compilation, fixed=fixed,
        fixed_fields=fixed_fields, has_fsdp=has_fsdp and layout is not None, has_sac=has_sac,
    )
    logger.info("%s [%.1fs]", policy.describe(), time.perf_counter() - t0)
    if not policy.fits:
        logger.warning("the predicted peak exceeds the memory budget (--compile.memory_budget_gib); the step may run out of memory")
    steps = build_pipeline(compile_cfg, layout, levers=policy.levers, deterministic=deterministic,
                           uses_flex_attention=uses_flex_attention, tp_group_name=tp_group_name)
    return steps, policy


def _default_step(name: str) -> PipelineStep:
    return PipelineStep(name, PASSES[name])


def _configs(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        return json.loads(value) if value.strip() else None
    return dict(value) if value else None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def run_pipeline(
    gm: torch.fx.GraphModule,
    example_inputs: Any,
    pipeline: Iterable[PipelineStep | str],
    *,
    dump_folder: str | None = None,
    quiet: bool = False,
    records: list[dict[str, Any]] | None = None,
    memory_estimates: bool | None = None,
) -> torch.fx.GraphModule:
    """Run the passes of ``pipeline`` in order and return the final module.

    ``pipeline``: :class:`PipelineStep` s (:func:`build_pipeline`) or pass names (run with
    their default options). Logs one line per pass on the ``graph_trainer`` logger: name,
    wall time, node count before -> after and the pass's own summary.

    Every pass gets a record (:func:`graph_trainer.passes.pass_report.pass_record`: time,
    nodes by kind, ops added / removed, regions, static peak memory before / after), appended
    to ``records`` when a list is given; ``format_pass_table(records)`` renders them.
    ``memory_estimates``: take the static peak estimate of every graph state (one linear walk
    each); default: not ``quiet``. Without it the memory fields are None.

    With ``dump_folder``, writes ``<dump_folder>/graphs/00_input.py``, one ``NN_<pass>.py``
    per pass (readable code of the graph after it, with every node's full ``custom``
    annotation), ``NN_<pass>.diff`` (unified diff against the previous graph; empty when the
    pass changed nothing) and ``summary.json`` (the records plus op counts per target;
    rewritten after each pass).

    With ``TORCH_TRACE`` set (and not ``quiet``), emits structured-trace artifacts for
    tlparse (:mod:`graph_trainer.passes.pass_report`): ``graph_before_passes``,
    ``graph_after_<pass>`` and ``graph_diff_<pass>`` (text), ``pass_record_<pass>`` (json)
    and, at the end, ``pass_table`` (text) and ``pass_records`` (json).

    ``quiet``: no log lines, no trace artifacts (the memory policy's trial runs).

    Raises:
        ValueError: an unknown pass name; whatever a pass raises.
    """
    from graph_trainer.passes import pass_report as report

    steps = [s if isinstance(s, PipelineStep) else _default_step(canonical_pass_name(s)) for s in pipeline]
    memory = not quiet if memory_estimates is None else memory_estimates
    trace = not quiet and report.trace_enabled()
    graphs_dir = os.path.join(dump_folder, "graphs") if dump_folder is not None else None
    run_records: list[dict[str, Any]] = []
    dumped: list[dict[str, Any]] = []
    text = report.readable_graph(gm) if graphs_dir is not None or trace else None
    if graphs_dir is not None:
        os.makedirs(graphs_dir, exist_ok=True)
        _write(os.path.join(graphs_dir, "00_input.py"), text)
        dumped.append({"index": 0, "pass": "input", "nodes": num_nodes(gm), "ops": op_counts(gm)})
    if trace:
        report.trace_artifact("graph_before_passes", lambda: text)

    pop_pass_summary(gm)
    before = report.snapshot(gm, memory=memory)
    prev_name = "00_input"
    for i, step in enumerate(steps, start=1):
        t0 = time.perf_counter()
        gm = step(gm, example_inputs)
        elapsed = time.perf_counter() - t0
        summary, stats = pop_pass_summary(gm)
        after = report.snapshot(gm, memory=memory)
        record = report.pass_record(i, step.name, elapsed, before, after, summary, stats)
        run_records.append(record)
        if records is not None:
            records.append(record)
        before = after
        if not quiet:
            logger.info(
                "graph pass %-46s %8.3fs  nodes %s -> %s  %s",
                step.name,
                elapsed,
                "n/a" if record["nodes_before"] is None else record["nodes_before"],
                "n/a" if record["nodes_after"] is None else record["nodes_after"],
                summary,
            )
        if text is None:
            continue
        name = f"{i:02d}_{step.name}"
        new_text = report.readable_graph(gm)
        diff = report.graph_diff(text, new_text, f"{prev_name}.py", f"{name}.py")
        text, prev_name = new_text, name
        if graphs_dir is not None:
            _write(os.path.join(graphs_dir, f"{name}.py"), text)
            _write(os.path.join(graphs_dir, f"{name}.diff"), diff)
            dumped.append({**record, "ops": op_counts(gm)})
            _write(os.path.join(graphs_dir, "summary.json"), json.dumps(dumped, indent=1))
        if trace:
            report.trace_artifact(f"graph_after_{step.name}", lambda: text)
            report.trace_artifact(f"graph_diff_{step.name}", lambda: diff)
            report.trace_artifact(f"pass_record_{step.name}", lambda: record, encoding="json")
    if trace:
        report.trace_artifact("pass_table", lambda: report.format_pass_table(run_records))
        report.trace_artifact("pass_records", lambda: run_records, encoding="json")
    return gm
