"""Configuration: torchtitan's JobConfig plus this project's ``[compile]`` fields.

The extension is a torchtitan ``--job.custom_config_module`` (the TOML files set
``[job] custom_config_module = "graph_trainer.config"``); :func:`parse_args`
always merges it, so it is present whether or not the TOML names it.

Precedence: CLI ``--section.key value`` > TOML file > dataclass defaults.

Flag aliases accepted for commands written against newer torchtitan:
``--dataloader.dataset[_path]`` -> ``--training.dataset[_path]`` and
``--profiler.*`` -> ``--profiling.*``.
"""


import difflib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from graph_trainer.errors import UserError

COMPILE_MODES = ("eager", "jit", "aot_fx_trace")
INDUCTOR_COMPILATION = ("regional", "full", "none")
AC_MODES = ("none", "selective", "full")

# CONFIG=<name> (run_train.sh) -> TOML file under train_configs/.
CONFIG_NAMES = {
    "graph_trainer_llama3_debugmodel": "debug_model.toml",
    "graph_trainer_llama3_1b": "llama3_1b.toml",
    "graph_trainer_llama3_8b": "llama3_8b.toml",
}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_CONFIGS = os.path.join(REPO_ROOT, "train_configs")


@dataclass
class Compile:
    """``[compile]`` — how the training step is captured and compiled.

    torchtitan's own ``enable`` / ``components`` / ``backend`` stay as they are
    and are used by ``mode = "jit"`` (per-TransformerBlock torch.compile).
    """

    mode: str = "aot_fx_trace"
    """eager: compile nothing; jit: torchtitan's per-block torch.compile;
    aot_fx_trace: trace forward+loss+backward into one FX graph and run the pass pipeline."""

    inductor_compilation: str = "regional"
    """aot_fx_trace only. regional: compile regions tagged ``compile_with_inductor``;
    full: the whole graph through Inductor; none: run the traced graph uncompiled."""

    numerics_changing_optim: bool = False
    """Enable passes that change numerics (the RMSNorm annotation pass)."""

    passes: str = ""
    """Comma-separated pass names replacing the default order (empty: the default)."""

    disable_passes: str = ""
    """Comma-separated pass names removed from the pipeline."""

    rmsnorm_inductor_configs: str = ""
    """Inductor configs of the RMSNorm regions: JSON on the CLI, a table in TOML.
    Empty: the measured default (graph_trainer.passes.annotate_rmsnorm)."""

    rmsnorm_tune: bool = True
    """RMSNorm regions (--compile.numerics_changing_optim): also compile each distinct
    region with each of DEFAULT_RMSNORM_CANDIDATE_CONFIGS (the norm backward's mix-order
    reduction split size), time all on CUDA and keep a candidate only when it beats
    Inductor's defaults by 2 %. About a second of compile per candidate and distinct region;
    84-89 -> 93-94 % of copy bandwidth on an H100 (docs/perf.md). No effect on CPU, and off
    with --debug.deterministic (the pick depends on timings)."""

    dump_graphs: bool = False
    """Write the graph before the first pass and after each pass to <dump_folder>/graphs/."""

    pointwise_regions: bool = False
    """With --compile.numerics_changing_optim: also compile every chain of pointwise ops
    (SwiGLU, residual adds, casts, loss) inside one module and phase as its own region
    (annotate_pointwise_for_regional_inductor)."""

    full_inductor_configs: str = ""
    """--compile.inductor_compilation full: ``torch._inductor.config`` overrides for the
    whole-graph compile, JSON on the CLI (a table in TOML), dotted keys, e.g.
    ``{"aten_distributed_optimizations.enable_overlap_scheduling": true}``."""

    pin_collectives: bool = True
    """With --compile.inductor_compilation full (ignored otherwise): keep overlap_collectives'
    placement of every collective and wait (under the same matmuls) inside Inductor's
    schedule (graph_trainer.passes.pin_collectives). Without it (--compile.no-pin_collectives),
    Inductor's peak-memory reordering waits for each collective right after issuing it: no
    overlap (8B FSDP2, 2x H200: +6.4 % tps with it, docs/perf.md)."""

    bucket_collectives: int = 0
    """> 1: add the bucket_collectives pass after overlap_collectives, merging up to N
    consecutive FSDP all-gathers / reduce-scatters into one collective (9 = one Llama3
    block, as FSDP2 groups them). 0 / 1: one collective per parameter. 8B FSDP2, 2x H200,
    full-graph Inductor: 9 gave about +2 % tps and +1.2 GiB, 18 another +1 % and +2.9 GiB
    (docs/perf.md)."""

    reshard_first_params: int = -1
    """reshard_after_forward re-gathers only the first N FSDP parameters in forward order
    (Llama3: the embedding, then 9 per block, so 1 + 9 * L covers the first L blocks); the
    others keep their forward copy for the backward (more memory, fewer all-gathers; 8B:
    0.41 GiB per kept block). -1: all of them."""

    cudagraphs: bool = False
    """Append cudagraph_pass to the pipeline (CUDA only)."""

    sac_save_matmuls: bool = False
    """Op-level selective AC under aot_fx_trace: keep every matmul output of a block instead
    of recomputing the ones torchtitan's policy leaves to recompute (wk, wo, w3); the
    sac_recompute pass then recomputes only the cheap non-matmul ops. More memory, no
    matmul recompute. Numerics unchanged."""


@dataclass
class Debug:
    """Fields added to torchtitan's ``[debug]`` (which has ``seed`` and ``deterministic``)."""

    state_hashes: bool = False
    """At the end of training, compute sha256 of the final parameters, gradients and
    optimizer state (all ranks) and record them in the metrics.jsonl summary."""


@dataclass
class JobConfig:
    """The fields this project adds to torchtitan's JobConfig (merged by torchtitan)."""

    compile: Compile = field(default_factory=Compile)
    debug: Debug = field(default_factory=Debug)


def split_names(value: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def memory_pass_options(compile_cfg) -> dict[str, Any]:
    """``run_passes`` keyword arguments of the graph-level memory / collective passes, from
    ``[compile]``: ``sac_save_matmuls``, ``reshard_first_params`` (None for all, from -1)
    and ``bucket_size`` (None unless ``bucket_collectives > 1``). Shared by training and
    the dry run, so both run the same pipeline."""
    return {
        "sac_save_matmuls": compile_cfg.sac_save_matmuls,
        "reshard_first_params": None if compile_cfg.reshard_first_params < 0 else compile_cfg.reshard_first_params,
        "bucket_size": compile_cfg.bucket_collectives if compile_cfg.bucket_collectives > 1 else None,
    }


def rewrite_aliases(argv: list[str]) -> list[str]:
    """Map newer torchtitan flag spellings to torchtitan 0.2.2's.

    ``--dataloader.dataset`` / ``--dataloader.dataset_path`` -> ``--training.*``;
    ``--profiler.X`` -> ``--profiling.X`` (``--profiler.no-enable_profiling`` too).
    """
    out = []
    for arg in argv:
        key, eq, val = arg.partition("=")
        for old, new in (
            ("--dataloader.dataset", "--training.dataset"),
            ("--profiler.", "--profiling."),
        ):
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out.append(key + eq + val)
    return out


def resolve_config_file(argv: list[str]) -> list[str]:
    """Ensure ``--job.config_file`` names an existing TOML file.

    ``CONFIG=<name>`` in the environment (see :data:`CONFIG_NAMES`) selects a file
    when no ``--job.config_file`` is given.

    Raises:
        UserError: the file does not exist, or CONFIG names no known config.
    """
    path = None
    for i, arg in enumerate(argv):
        key, eq, val = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            path = val if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    if path is None and os.environ.get("CONFIG"):
        name = os.environ["CONFIG"]
        fname = CONFIG_NAMES.get(name) or (name if name.endswith(".toml") else None)
        if fname is None:
            raise UserError(
                f"CONFIG={name} is not a known config name. Known names: "
                f"{', '.join(sorted(CONFIG_NAMES))}; or set CONFIG_FILE=path/to/file.toml."
            )
        path = os.path.join(TRAIN_CONFIGS, fname)
        argv = ["--job.config_file", path] + argv
    if path is not None and not os.path.isfile(path):
        raise UserError(
            f"Config file '{path}' does not exist. Pass an existing TOML file with "
            f"CONFIG_FILE=... (run_train.sh) or --job.config_file; the shipped ones are in "
            f"{TRAIN_CONFIGS}: {', '.join(sorted(os.listdir(TRAIN_CONFIGS)))}."
        )
    return argv


def _parse_inductor_configs(value: Any, flag: str = "--compile.rmsnorm_inductor_configs") -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{flag} must be a JSON object, e.g. "
            f"'{{\"coordinate_descent_tuning\": true}}'; got {value!r} ({e})."
        ) from None
    if not isinstance(parsed, dict):
        raise UserError(f"{flag} must be a JSON object, got {value!r}.")
    return parsed


def _config_manager_cls():
    from torchtitan.config import ConfigManager

    class _Manager(ConfigManager):
        """torchtitan's ConfigManager, with TOML tables allowed for rmsnorm_inductor_configs."""

        def _maybe_load_toml(self, args):
            values = super()._maybe_load_toml(args)
            comp = (values or {}).get("compile", {})
            for key in ("rmsnorm_inductor_configs", "full_inductor_configs"):
                if isinstance(comp.get(key), dict):
                    comp[key] = json.dumps(comp[key])
            return values

    return _Manager


def parse_args(argv: list[str] | None = None):
    """Parse CLI + TOML into a merged JobConfig (torchtitan's + :class:`JobConfig`).

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The merged JobConfig dataclass instance; ``cfg.compile.rmsnorm_inductor_configs``
        is converted to a ``dict``.

    Raises:
        UserError: missing config file, unknown compile mode / inductor compilation /
            AC mode / flavor, malformed JSON.
    """
    from torchtitan.config import JobConfig as TitanJobConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = resolve_config_file(rewrite_aliases(argv))
    manager_cls = _config_manager_cls()
    merged = manager_cls._merge_configs(TitanJobConfig, JobConfig)
    try:
        cfg = manager_cls(config_cls=merged).parse_args(argv)
    except SystemExit as e:  # tyro printed its own message (unknown flag, bad value)
        if e.code not in (0, None):
            raise UserError(
                "Could not parse the command line (see the message above). Flags are "
                "--section.key value, e.g. --training.steps 10; --help lists them."
            ) from None
        raise
    except ValueError as e:  # TOML with unknown fields
        raise UserError(str(e)) from None
    cfg.compile.rmsnorm_inductor_configs = _parse_inductor_configs(
        cfg.compile.rmsnorm_inductor_configs
    )
    cfg.compile.full_inductor_configs = _parse_inductor_configs(
        cfg.compile.full_inductor_configs, "--compile.full_inductor_configs"
    )
    validate(cfg)
    return cfg


def _choice_error(what: str, value: str, valid) -> UserError:
    close = difflib.get_close_matches(str(value), list(valid), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return UserError(f"Unknown {what} '{value}'. Valid values: {', '.join(valid)}.{hint}")


def validate(cfg) -> None:
    """Reject settings that cannot work, before anything is built.

    Raises:
        UserError: unknown compile mode, inductor compilation, AC mode or flavor;
            full-graph-only flags without ``--compile.inductor_compilation full``.
    """
    if cfg.compile.mode not in COMPILE_MODES:
        raise _choice_error("--compile.mode", cfg.compile.mode, COMPILE_MODES)
    if cfg.compile.inductor_compilation not in INDUCTOR_COMPILATION:
        raise _choice_error(
            "--compile.inductor_compilation", cfg.compile.inductor_compilation, INDUCTOR_COMPILATION
        )
    if cfg.activation_checkpoint.mode not in AC_MODES:
        raise _choice_error("--activation_checkpoint.mode", cfg.activation_checkpoint.mode, AC_MODES)
    if cfg.model.name != "llama3":
        raise _choice_error("--model.name", cfg.model.name, ["llama3"])
    from graph_trainer.llama3 import llama3_args

    if cfg.model.flavor not in llama3_args:
        raise _choice_error("--model.flavor", cfg.model.flavor, sorted(llama3_args))
    if cfg.training.steps < 1:
        raise UserError(f"--training.steps must be >= 1, got {cfg.training.steps}.")
    full = cfg.compile.mode == "aot_fx_trace" and cfg.compile.inductor_compilation == "full"
    if cfg.compile.full_inductor_configs and not full:
        raise UserError(
            "--compile.full_inductor_configs applies to the whole-graph Inductor compile only: add "
            "--compile.inductor_compilation full (with --compile.mode aot_fx_trace)."
        )
    prof = cfg.profiling
    if prof.enable_profiling and prof.profile_freq < prof.profiler_warmup + prof.profiler_active:
        raise UserError(
            f"--profiling.profile_freq ({prof.profile_freq}) must be >= --profiling.profiler_warmup "
            f"({prof.profiler_warmup}) + --profiling.profiler_active ({prof.profiler_active})."
        )


def _check_main(argv: list[str]) -> int:
    """``python -m graph_trainer.config ARGS``: validate a command line; exit 2 on errors.

    run_train.sh calls this before torchrun so bad input gives one paragraph, not a
    wall of per-rank failures.
    """
    try:
        parse_args(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_check_main(sys.argv[1:]))
