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
from typing import Any, Literal, get_args

from graph_trainer.errors import UserError

CompileMode = Literal["eager", "jit", "aot_fx_trace"]
InductorCompilation = Literal["regional", "full", "none"]
COMPILE_MODES = get_args(CompileMode)
INDUCTOR_COMPILATION = get_args(InductorCompilation)
AC_MODES = ("none", "selective", "full")

# CONFIG=<name> (run_train.sh) -> TOML file under train_configs/.
CONFIG_NAMES = {
    "graph_trainer_llama3_debugmodel": "debug_model.toml",
    "graph_trainer_llama3_debug_model": "debug_model.toml",
    "graph_trainer_llama3_1b": "llama3_1b.toml",
    "graph_trainer_llama3_8b": "llama3_8b.toml",
}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_CONFIGS = os.path.join(REPO_ROOT, "train_configs")


@dataclass
class RMSNorm:
    """``[compile.rmsnorm]`` — options of ``annotate_rmsnorm_for_regional_inductor``
    (enabled by ``--compile.numerics_changing_optim``)."""

    inductor_configs: str = ""
    """Inductor configs of the RMSNorm regions: JSON on the CLI, a table in TOML.
    Empty: DEFAULT_RMSNORM_INDUCTOR_CONFIGS (graph_trainer.passes.annotate_rmsnorm)."""

    tune: bool = True
    """Also compile each distinct RMSNorm region with each of DEFAULT_RMSNORM_CANDIDATE_CONFIGS
    (split sizes of the norm backward's reduction), time them on CUDA and keep a candidate
    only when it beats Inductor's defaults by 2 %. About a second of compile per candidate
    and distinct region. No effect on CPU; off with --debug.deterministic (the pick depends
    on timings). Measured: docs/perf.md."""


@dataclass
class FullInductor:
    """``[compile.full_inductor]`` — options of ``full_inductor``
    (``--compile.inductor_compilation full``)."""

    configs: str = ""
    """``torch._inductor.config`` overrides for the whole-graph compile: JSON on the CLI, a
    table in TOML, dotted keys, e.g.
    ``{"aten_distributed_optimizations.enable_overlap_scheduling": true}``."""

    pin_collectives: bool = True
    """Keep overlap_collectives' placement of every collective and wait (under the same
    matmuls) inside Inductor's schedule (graph_trainer.passes.pin_collectives). Without it
    Inductor's peak-memory reordering waits for each collective right after issuing it,
    so nothing overlaps."""


SacSave = Literal["auto", "recompute", "matmuls", "all"]


@dataclass
class SAC:
    """``[compile.sac]`` — options of ``sac_recompute`` (op-level selective AC)."""

    save: SacSave = "auto"
    """What op-level selective AC keeps from the forward for the backward. recompute:
    torchtitan's policy (every other matmul and the cheap ops are recomputed); matmuls:
    every matmul output is kept, only the cheap ops are recomputed; all: nothing is
    recomputed; auto: the memory policy picks within --compile.memory_budget_gib
    (graph_trainer/passes/memory_policy.py). Numerics unchanged in every case."""


@dataclass
class FSDP:
    """``[compile.fsdp]`` — options of the traced FSDP collectives
    (``reshard_after_forward``, ``bucket_collectives``)."""

    bucket_blocks: int = -1
    """> 0: the bucket_collectives pass merges the FSDP all-gathers / reduce-scatters of up
    to N consecutive transformer blocks into one collective each. 0: one collective per
    parameter. -1: the memory policy picks (2 when it fits). Numerics unchanged."""

    keep_last_blocks: int = -1
    """The last K transformer blocks (in forward order) keep their all-gathered parameters
    from the forward for the backward instead of gathering them again (more memory, fewer
    all-gathers). 0: every block is resharded after the forward. -1: the memory policy
    picks as many as fit. Numerics unchanged."""


AsyncTPFuse = Literal["all", "all_gather_matmul", "matmul_reduce_scatter"]


@dataclass
class AsyncTP:
    """``[compile.async_tp]`` — options of ``async_tp`` (``--compile.passes async_tp``)."""

    fuse: AsyncTPFuse = "all"
    """Which TP pairs the async_tp pass replaces with torch's symmetric-memory ops: all:
    all-gather -> matmul (symm_mem.fused_all_gather_matmul) and matmul -> reduce-scatter
    (symm_mem.fused_matmul_reduce_scatter); all_gather_matmul / matmul_reduce_scatter:
    only that one. CUDA only (the pass skips elsewhere). The fused matmuls run in
    per-rank row chunks: equal to the unfused step up to the matmul kernels' choice, not
    guaranteed bitwise (graph_trainer/passes/async_tp.py)."""


@dataclass
class Compile:
    """``[compile]`` — how the training step is captured and compiled.

    torchtitan's own ``enable`` / ``components`` / ``backend`` are set by ``mode``
    (``jit`` is torchtitan's per-TransformerBlock torch.compile).
    """

    mode: CompileMode = "aot_fx_trace"
    """eager: compile nothing; jit: torchtitan's per-block torch.compile;
    aot_fx_trace: trace forward+loss+backward into one FX graph and run the pass pipeline."""

    inductor_compilation: InductorCompilation = "regional"
    """aot_fx_trace only. regional: compile regions tagged ``compile_with_inductor``;
    full: the whole graph through Inductor; none: run the traced graph uncompiled."""

    numerics_changing_optim: bool = False
    """Enable the passes that change numerics (the RMSNorm annotation pass)."""

    memory_budget_gib: float = 0.0
    """Peak memory per rank (GiB, as torch.cuda.max_memory_reserved) the memory policy
    plans for when it picks the [compile.sac] / [compile.fsdp] levers left on auto.
    0: the device's total memory less 10 % (16 GiB without CUDA; the dry run plans for
    80 GB and 141 GB devices). The choice and its predicted peak are logged."""

    passes: str = ""
    """Comma-separated pass names added to the default order (e.g. annotate_pointwise,
    cudagraph); every pass runs at its place in the one canonical order."""

    disable_passes: str = ""
    """Comma-separated pass names removed from the pipeline."""

    dump_graphs: bool = False
    """Write the graph before the first pass and after each pass to <dump_folder>/graphs/."""

    rmsnorm: RMSNorm = field(default_factory=RMSNorm)
    full_inductor: FullInductor = field(default_factory=FullInductor)
    sac: SAC = field(default_factory=SAC)
    fsdp: FSDP = field(default_factory=FSDP)
    async_tp: AsyncTP = field(default_factory=AsyncTP)


@dataclass
class Debug:
    """Fields added to torchtitan's ``[debug]`` (which has ``seed`` and ``deterministic``)."""

    state_hashes: bool = False
    """At the end of training, compute sha256 of the final parameters, gradients and
    optimizer state (all ranks) and record them in the metrics.jsonl summary."""

    record_numerics: str = ""
    """A folder: step 1 records the output of every op it runs (keyed by phase, module FQN,
    op and occurrence) into ``<folder>/rank<r>.pt`` for ``scripts/numerics_diff.py``
    (graph_trainer/numerics.py). Slower step 1; empty: off."""


@dataclass
class Checkpoint:
    """Defaults this project changes in torchtitan's ``[checkpoint]``."""

    last_save_model_only: bool = False
    """Save only the model (no optimizer, LR schedule, data position) at the last step.
    Off here, so that every checkpoint, the last one included, resumes with the same command;
    on, the last checkpoint is for export and a rerun cannot continue from it."""


@dataclass
class Comm:
    """``[comm]``: torchtitan's ``mode`` with one more value (``COMM_MODE`` of run_train.sh)."""

    mode: Literal["default", "fake_backend", "local_tensor", "fake_collectives"] = "default"
    """``default``: real collectives. ``fake_backend``: a dry run: one process traces one
    step of the NGPU-rank layout on a fake process group and prints the graph summary and
    projection (graph_trainer/dry_run.py); nothing is executed. ``fake_collectives``: one
    process trains as rank 0 of the NGPU-rank layout on one device, every collective a local
    copy (graph_trainer/fake_pg.py): the step's compute, host time and memory of that rank
    without communication; losses and gradients are meaningless (no checkpoints). ``local_tensor``:
    not supported here."""


@dataclass
class JobConfig:
    """The fields this project adds to torchtitan's JobConfig (merged by torchtitan)."""

    compile: Compile = field(default_factory=Compile)
    debug: Debug = field(default_factory=Debug)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)


def split_names(value: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


#: Flags of ``[compile]`` that moved into a group: old key -> new dotted key (accepted
#: with a deprecation line on the CLI and in TOML).
RENAMED_COMPILE_KEYS = {
    "rmsnorm_inductor_configs": "rmsnorm.inductor_configs",
    "rmsnorm_tune": "rmsnorm.tune",
    "full_inductor_configs": "full_inductor.configs",
    "pin_collectives": "full_inductor.pin_collectives",
    "sac_save_matmuls": "sac.save_matmuls",
}
#: Boolean flags that became a choice: dotted key -> (new dotted key, value when set,
#: value when negated). Accepted with a deprecation line on the CLI and in TOML.
BOOL_TO_CHOICE_KEYS = {"sac.save_matmuls": ("sac.save", "matmuls", "recompute")}
#: Flags of ``[compile]`` that were removed: old key -> what to use instead.
REMOVED_COMPILE_KEYS = {
    "pointwise_regions": "--compile.passes annotate_pointwise",
    "cudagraphs": "--compile.passes cudagraph",
    "bucket_collectives": (
        "--compile.fsdp.bucket_blocks N (transformer blocks per bucket; the old value counted "
        "collectives, 9 per Llama3 block, so 18 is now 2)"
    ),
    "reshard_first_params": (
        "--compile.fsdp.keep_last_blocks K (blocks that keep their forward all-gather for the "
        "backward; the old value counted parameters, 1 + 9 * (L - K) for L blocks, so 181 on "
        "the 8B is now 12)"
    ),
}


def _deprecated(old: str, new: str) -> None:
    print(f"warning: {old} is deprecated; use {new}", file=sys.stderr)


def _rewrite_compile_flag(key: str) -> str:
    """``--compile.<old>`` / ``--compile.no-<old>`` -> its new spelling (see
    :data:`RENAMED_COMPILE_KEYS`); other keys unchanged.

    Raises:
        UserError: a removed flag (:data:`REMOVED_COMPILE_KEYS`), naming its replacement.
    """
    if not key.startswith("--compile."):
        return key
    name = key[len("--compile."):]
    neg = name.startswith("no-") or name.startswith("no_")
    base = (name[3:] if neg else name).replace("-", "_")
    if base in REMOVED_COMPILE_KEYS:
        raise UserError(f"--compile.{base} was removed; use {REMOVED_COMPILE_KEYS[base]}.")
    if base not in RENAMED_COMPILE_KEYS:
        return key
    group, _, leaf = RENAMED_COMPILE_KEYS[base].rpartition(".")
    new = f"--compile.{group}.{'no-' if neg else ''}{leaf}"
    _deprecated(key, new)
    return new


def rewrite_aliases(argv: list[str]) -> list[str]:
    """Map other flag spellings to the ones this parser knows.

    Newer torchtitan spellings: ``--dataloader.dataset`` / ``--dataloader.dataset_path`` ->
    ``--training.*``; ``--profiler.X`` -> ``--profiling.X`` (``--profiler.no-enable_profiling``
    too). Older ``[compile]`` flags of this project: :data:`RENAMED_COMPILE_KEYS` (with a
    deprecation line on stderr).

    Raises:
        UserError: a flag listed in :data:`REMOVED_COMPILE_KEYS`.
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
        key = _rewrite_compile_flag(key)
        name = key[len("--compile."):] if key.startswith("--compile.") else ""
        group, _, leaf = name.rpartition(".")
        neg = leaf.startswith(("no-", "no_"))
        dotted = f"{group}.{leaf[3:] if neg else leaf}"
        if dotted in BOOL_TO_CHOICE_KEYS and not eq:
            new, on, off = BOOL_TO_CHOICE_KEYS[dotted]
            _deprecated(key, f"--compile.{new} {off if neg else on}")
            out += [f"--compile.{new}", off if neg else on]
            continue
        out.append(key + eq + val)
    return out


def _upgrade_toml_compile(values: dict, path: str) -> None:
    """Move old ``[compile]`` keys of a TOML file into their groups (in place), and turn
    the Inductor config tables into the JSON strings the dataclass holds.

    Raises:
        UserError: a removed key (:data:`REMOVED_COMPILE_KEYS`).
    """
    comp = values.get("compile")
    if not isinstance(comp, dict):
        return
    for old in list(comp):
        if old in REMOVED_COMPILE_KEYS:
            raise UserError(f"{path}: [compile] {old} was removed; use {REMOVED_COMPILE_KEYS[old]}.")
        if old in RENAMED_COMPILE_KEYS:
            group, _, leaf = RENAMED_COMPILE_KEYS[old].rpartition(".")
            _deprecated(f"{path}: [compile] {old}", f"[compile.{group}] {leaf}")
            comp.setdefault(group, {})[leaf] = comp.pop(old)
    for dotted, (new, on, off) in BOOL_TO_CHOICE_KEYS.items():
        group, _, leaf = dotted.rpartition(".")
        table = comp.get(group)
        if isinstance(table, dict) and leaf in table:
            value = on if table.pop(leaf) else off
            _deprecated(f"{path}: [compile.{group}] {leaf}", f"[compile.{group}] {new.rpartition('.')[2]} = \"{value}\"")
            table[new.rpartition(".")[2]] = value
    for group, leaf in (("rmsnorm", "inductor_configs"), ("full_inductor", "configs")):
        table = comp.get(group)
        if isinstance(table, dict) and isinstance(table.get(leaf), dict):
            table[leaf] = json.dumps(table[leaf])


def resolve_config_file(argv: list[str]) -> list[str]:
    """Ensure ``--job.config_file`` names an existing TOML file.

    ``CONFIG=<name>`` in the environment (see :data:`CONFIG_NAMES`) selects a file
    when no ``--job.config_file`` is given.

    Raises:
        UserError: the file does not exist, or CONFIG names no known config.
    """
    path = _config_path(argv)
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


def _parse_inductor_configs(value: Any, flag: str) -> dict[str, Any]:
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
        """torchtitan's ConfigManager, reading old ``[compile]`` keys and Inductor config tables;
        merged sections also inherit from this project's dataclasses, so that ``--help``
        shows the docstrings of this project's fields."""

        @staticmethod
        def _merge_configs(base, custom):
            return _with_docs(ConfigManager._merge_configs(base, custom), custom)

        def _maybe_load_toml(self, args):
            path = _config_path(args)
            if path is None:
                return None
            values = _load_toml(path)
            _upgrade_toml_compile(values, path)
            return values

        def _validate_config(self):
            # torchtitan warns that hf_assets_path does not exist; "embedded" is not a path
            model = self.config.model
            embedded = model.hf_assets_path in ("", "embedded")
            saved, model.hf_assets_path = model.hf_assets_path, ("." if embedded else model.hf_assets_path)
            try:
                super()._validate_config()
            finally:
                model.hf_assets_path = saved if embedded else model.hf_assets_path

    return _Manager


def _with_docs(merged, custom):
    """``merged`` (torchtitan's merge of a section with ``custom``) re-made with ``custom``
    among its bases, recursively: tyro looks field docstrings up along the MRO."""
    import dataclasses

    if custom in merged.__mro__:  # merged twice (the TOML names this module too)
        return merged
    hints = {f.name: f.type for f in dataclasses.fields(merged)}
    for f in dataclasses.fields(custom):
        sub = hints.get(f.name)
        if dataclasses.is_dataclass(sub) and sub is not f.type and dataclasses.is_dataclass(f.type):
            hints[f.name] = _with_docs(sub, f.type)
    fields = [(f.name, hints[f.name], dataclasses.field(default_factory=hints[f.name])
               if dataclasses.is_dataclass(hints[f.name]) and hints[f.name] is not f.type else f)
              for f in dataclasses.fields(merged)]
    return dataclasses.make_dataclass(merged.__name__, fields, bases=(*merged.__bases__, custom))


def _load_toml(path: str) -> dict:
    """The TOML file at ``path`` as a dict.

    Raises:
        UserError: the file cannot be read or is not valid TOML (names the file, line and column).
    """
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise UserError(f"Config file '{path}' cannot be read: {e.strerror}.") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}. Fix the file (see train_configs/ for examples).") from None


def _config_path(argv: list[str]) -> str | None:
    """The value of ``--job.config_file`` in ``argv`` (last one wins), or None."""
    path = None
    for i, arg in enumerate(argv):
        key, eq, val = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            path = val if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return path


def parse_args(argv: list[str] | None = None):
    """Parse CLI + TOML into a merged JobConfig (torchtitan's + :class:`JobConfig`).

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The merged JobConfig dataclass instance; ``cfg.compile.rmsnorm.inductor_configs``
        and ``cfg.compile.full_inductor.configs`` are converted to ``dict``s.

    Raises:
        UserError: missing config file, bad value, malformed JSON, a removed flag, and
            everything :func:`validate` rejects.
    """
    from torchtitan.config import JobConfig as TitanJobConfig

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        from torchtitan.config import JobConfig as TitanJobConfig

        sys.stdout.write(help_text(_config_manager_cls()._merge_configs(TitanJobConfig, JobConfig)))
        raise SystemExit(0)
    argv = resolve_config_file(rewrite_aliases(argv))
    _check_choices(argv)
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
    cfg.compile.rmsnorm.inductor_configs = _parse_inductor_configs(
        cfg.compile.rmsnorm.inductor_configs, "--compile.rmsnorm.inductor_configs"
    )
    cfg.compile.full_inductor.configs = _parse_inductor_configs(
        cfg.compile.full_inductor.configs, "--compile.full_inductor.configs"
    )
    validate(cfg)
    return cfg


def _literal_flags(cls, prefix: str) -> dict[str, tuple]:
    """``{"--compile.mode": ("eager", ...)}`` for every ``Literal``-typed field of the
    dataclass ``cls`` and its nested dataclasses."""
    import dataclasses
    import typing

    out: dict[str, tuple] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) is Literal:
            out[f"{prefix}.{f.name}"] = get_args(hint)
        elif dataclasses.is_dataclass(hint):
            out.update(_literal_flags(hint, f"{prefix}.{f.name}"))
    return out


def _check_choices(argv: list[str]) -> None:
    """Reject a bad value of a ``Literal``-typed project flag with the valid values (and a
    close match), before tyro reports it in a box.

    Raises:
        UserError: naming the flag, the valid values and the closest one.
    """
    choices = _literal_flags(Compile, "--compile")
    for i, arg in enumerate(argv):
        key, eq, val = arg.partition("=")
        key = key.replace("-", "_").replace("__", "--", 1)
        if key in choices:
            value = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value not in choices[key]:
                raise _choice_error(key, value, choices[key])


def _choice_error(what: str, value: str, valid) -> UserError:
    close = difflib.get_close_matches(str(value), list(valid), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return UserError(f"Unknown {what} '{value}'. Valid values: {', '.join(valid)}.{hint}")


def validate(cfg) -> list[str]:
    """Reject settings that cannot work, before anything is built, and resolve the pass list.

    Returns:
        The pass names ``aot_fx_trace`` will run, in order
        (:func:`graph_trainer.passes.pipeline.resolve_pass_names`); ``[]`` for other modes.

    Raises:
        UserError: unknown compile mode, inductor compilation, AC mode or flavor; a bad
            pass list; ``[compile.fsdp]`` values out of range; full-graph-only flags
            without ``--compile.inductor_compilation full``; a bad profiling schedule;
            ``--comm.mode local_tensor``; checkpoints under ``fake_collectives``.
    """
    if cfg.comm.mode == "local_tensor":
        raise UserError("--comm.mode local_tensor (COMM_MODE=local_tensor) is not supported; use fake_backend "
                        "(a dry run) or fake_collectives (rank 0's step on one device).")
    if cfg.comm.mode == "fake_collectives" and cfg.checkpoint.enable:
        raise UserError("--checkpoint.enable cannot be used with COMM_MODE=fake_collectives: its collectives are "
                        "local copies, so the parameters it would save are meaningless.")
    comp = cfg.compile
    if comp.enable:
        raise UserError(
            "--compile.enable is set by --compile.mode (jit: torchtitan's per-block torch.compile); "
            "use --compile.mode jit instead."
        )
    if comp.mode not in COMPILE_MODES:
        raise _choice_error("--compile.mode", comp.mode, COMPILE_MODES)
    if comp.inductor_compilation not in INDUCTOR_COMPILATION:
        raise _choice_error("--compile.inductor_compilation", comp.inductor_compilation, INDUCTOR_COMPILATION)
    if cfg.activation_checkpoint.mode not in AC_MODES:
        raise _choice_error("--activation_checkpoint.mode", cfg.activation_checkpoint.mode, AC_MODES)
    if cfg.model.name != "llama3":
        raise _choice_error("--model.name", cfg.model.name, ["llama3"])
    from graph_trainer.llama3 import llama3_args

    if cfg.model.flavor not in llama3_args:
        raise _choice_error("--model.flavor", cfg.model.flavor, sorted(llama3_args))
    if cfg.training.steps < 1:
        raise UserError(f"--training.steps must be >= 1, got {cfg.training.steps}.")
    n_layers = llama3_args[cfg.model.flavor].n_layers
    if comp.fsdp.bucket_blocks < -1:
        raise UserError(f"--compile.fsdp.bucket_blocks must be >= 0 (or -1: auto), got {comp.fsdp.bucket_blocks}.")
    if not -1 <= comp.fsdp.keep_last_blocks <= n_layers:
        raise UserError(
            f"--compile.fsdp.keep_last_blocks must be in [0, {n_layers}] or -1 (auto) (flavor "
            f"'{cfg.model.flavor}' has {n_layers} blocks), got {comp.fsdp.keep_last_blocks}."
        )
    if comp.memory_budget_gib < 0:
        raise UserError(f"--compile.memory_budget_gib must be >= 0 (0: the device's memory), got {comp.memory_budget_gib}.")
    full = comp.mode == "aot_fx_trace" and comp.inductor_compilation == "full"
    if comp.full_inductor.configs and not full:
        raise UserError(
            "--compile.full_inductor.configs applies to the whole-graph Inductor compile only: add "
            "--compile.inductor_compilation full (with --compile.mode aot_fx_trace)."
        )
    prof = cfg.profiling
    if prof.enable_profiling and prof.profile_freq < prof.profiler_warmup + prof.profiler_active:
        raise UserError(
            f"--profiling.profile_freq ({prof.profile_freq}) must be >= --profiling.profiler_warmup "
            f"({prof.profiler_warmup}) + --profiling.profiler_active ({prof.profiler_active})."
        )
    if comp.mode != "aot_fx_trace":
        return []
    from graph_trainer.passes.pipeline import resolve_pass_names

    try:
        return resolve_pass_names(comp)
    except ValueError as e:
        raise UserError(f"{e}.") from None


#: ``--help`` lists these sections first: the ones this project adds or changes.
PROJECT_SECTIONS = ("compile", "compile.rmsnorm", "compile.full_inductor", "compile.sac", "compile.fsdp",
                    "compile.async_tp")
#: Flags left out of ``--help``: set from other flags.
HIDDEN_FLAGS = ("compile.enable",)


def _flag_doc(cls, name: str) -> str:
    try:
        from tyro._docstrings import get_field_docstring

        return " ".join((get_field_docstring(cls, name, ()) or "").split())
    except Exception:  # help text is best effort; the flag itself is still listed
        return ""


def _type_name(hint) -> str:
    import typing

    if typing.get_origin(hint) is Literal:
        return "{" + ",".join(map(str, get_args(hint))) + "}"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def help_text(merged_cls) -> str:
    """``--help``: every flag of the merged JobConfig, grouped by section, this project's
    sections (:data:`PROJECT_SECTIONS`) and fields first, each with its type or allowed
    values, default and description, spelled ``--section.key`` as the README spells them."""
    import dataclasses
    import textwrap
    import typing

    sections: dict[str, tuple[list[str], list[str]]] = {}  # section -> (own flags, torchtitan's)
    own = {f"compile.{f.name}" for f in dataclasses.fields(Compile)} | {
        f"debug.{f.name}" for f in dataclasses.fields(Debug)} | {
        f"checkpoint.{f.name}" for f in dataclasses.fields(Checkpoint)}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, key)
                continue
            if key in HIDDEN_FLAGS:
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            flag = f"--{key}" + ("" if hint is bool else f" {_type_name(hint)}")
            if hint is bool:
                flag += f" / --{prefix}.no-{f.name}"
            doc = _flag_doc(cls, f.name)
            body = textwrap.fill(f"{doc} (default: {default!r})".strip(), 96,
                                 initial_indent="      ", subsequent_indent="      ")
            mine, theirs = sections.setdefault(prefix, ([], []))
            (mine if key in own else theirs).extend([f"  {flag}", body])

    walk(merged_cls, "")
    order = [s for s in PROJECT_SECTIONS if s in sections] + [s for s in sections if s not in PROJECT_SECTIONS]
    out = [
        "usage: ./run_train.sh [--section.key VALUE ...]   (NGPU, CONFIG_FILE / CONFIG, LOG_RANK, COMM_MODE: see README)",
        "Precedence: command line > TOML file (--job.config_file) > defaults. Booleans: --section.key / --section.no-key.",
    ]
    for name in order:
        out += ["", f"[{name}]", *sections[name][0], *sections[name][1]]
    return "\n".join(out) + "\n"


def preflight(cfg, world_size: int) -> None:
    """Everything knowable before any process starts, beyond :func:`validate`: the data and
    tokenizer (:func:`graph_trainer.data.preflight`), the parallel degrees against
    ``world_size`` (NNODES x NGPU), and the checkpoint folder a
    resume would load (its recorded flavor / mode / layout; a ``--checkpoint.load_step``
    that does not exist).

    Raises:
        UserError: naming the flag or file and what to do.
    """
    from graph_trainer import checkpoint, data, parallelize
    from graph_trainer.llama3 import llama3_args

    data.preflight(cfg)
    flavor = llama3_args[cfg.model.flavor]
    rep, shard, tp = parallelize.check_parallel_degrees(cfg, world_size, flavor.n_heads, flavor.n_kv_heads)
    if not cfg.checkpoint.enable:
        return
    folder = checkpoint.checkpoint_folder(cfg)
    load_step = cfg.checkpoint.load_step
    step = checkpoint.latest_step(folder) if load_step == -1 else load_step
    if load_step != -1:
        checkpoint.require_complete(folder, load_step)
    if step > 0:
        meta = {"flavor": cfg.model.flavor, "mode": cfg.compile.mode, "layout": parallelize.layout_key(rep, shard, tp)}
        checkpoint.check_resume_compatible(folder, step, meta)


def launch_world_size(env=None) -> int:
    """The world run_train.sh starts: ``NNODES`` hosts (default 1) x ``NGPU`` ranks each
    (default 1), with ``NODE_RANK`` (default 0) one of the hosts.

    Raises:
        UserError: a value that is not a whole number >= 1 (``NODE_RANK``: 0..NNODES-1).
    """
    env = os.environ if env is None else env
    vals = {}
    for name, default, low in (("NGPU", 1, 1), ("NNODES", 1, 1), ("NODE_RANK", 0, 0)):
        raw = (env.get(name) or "").strip() or str(default)
        if not raw.isascii() or not raw.isdigit() or int(raw) < low:
            raise UserError(f"{name}={raw} must be a whole number >= {low}.")
        vals[name] = int(raw)
    if vals["NODE_RANK"] >= vals["NNODES"]:
        raise UserError(
            f"NODE_RANK={vals['NODE_RANK']} must be from 0 to NNODES-1={vals['NNODES'] - 1} (this host's index)."
        )
    return vals["NNODES"] * vals["NGPU"]


def _check_main(argv: list[str]) -> int:
    """``python -m graph_trainer.config ARGS``: validate a command line (:func:`parse_args`)
    and what it points at (:func:`preflight`, with ``NNODES x NGPU`` ranks, each default 1,
    :func:`launch_world_size`); exit 2 on errors.

    run_train.sh calls this before torchrun so bad input gives one paragraph, not a
    wall of per-rank failures.
    """
    try:
        preflight(parse_args(argv), launch_world_size())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_check_main(sys.argv[1:]))
