"""Configuration: torchtitan's JobConfig plus this project's ``[compile]`` fields.

A torchtitan ``--job.custom_config_module`` that :func:`parse_args` always merges. Precedence: CLI ``--section.key
value`` > TOML file > dataclass defaults. Newer torchtitan spellings are accepted: ``--dataloader.dataset[_path]`` and
``--profiler.*``."""

import dataclasses
import difflib
import json
import os
import sys
import textwrap
import typing
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

from graph_trainer.compiler import registry
from graph_trainer.compiler.memory_policy import FSDPOptions, Levers, SACOptions
from graph_trainer.errors import UserError

CompileMode = Literal["eager", "jit", "aot_fx_trace"]
InductorCompilation = Literal["regional", "full", "none"]

#: CONFIG=<name> (run_train.sh) -> TOML file under train_configs/.
CONFIG_NAMES = {"graph_trainer_llama3_debugmodel": "debug_model.toml",
                "graph_trainer_llama3_debug_model": "debug_model.toml",
                "graph_trainer_llama3_1b": "llama3_1b.toml", "graph_trainer_llama3_8b": "llama3_8b.toml"}
TRAIN_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_configs")


@dataclass
class CompileBase:
    """``[compile]``: how the training step is captured and compiled (torchtitan's ``enable``,
    ``components``, ``backend`` follow ``mode``); :data:`Compile` adds one section per pass with options."""

    mode: CompileMode = "aot_fx_trace"
    """eager: compile nothing; jit: torchtitan's per-block torch.compile;
    aot_fx_trace: trace forward+loss+backward into one FX graph and run the pass pipeline."""

    inductor_compilation: InductorCompilation = "regional"
    """aot_fx_trace only. regional: compile regions tagged ``compile_with_inductor``;
    full: the whole graph through Inductor (the fastest setting); none: run the traced graph uncompiled.
    On CUDA async TP runs in TP layouts with either (off: --compile.disable_passes async_tp)."""

    numerics_changing_optim: bool = False
    """Enable the passes that change numerics (the RMSNorm annotation pass)."""

    graph_cache_dir: str = "auto"
    """Keep the traced step after its passes (full Inductor: its compiled step) in this folder, one entry per
    key (config less outputs and length, rank, world, device, torch, Inductor's config, graph_trainer's code):
    a later run with that key skips trace, memory policy and passes (graph_trainer/compiler/graph_cache.py).
    auto: on with --compile.inductor_compilation full, in graph_trainer/ of Inductor's cache folder, else off;
    off: off. Not with --compile.dump_graphs or --debug.record_numerics."""

    memory_budget_gib: float = 0.0
    """Peak memory per rank (GiB, as torch.cuda.max_memory_reserved) the memory policy plans for when it
    picks the [compile.sac] / [compile.fsdp] levers left on auto. 0: the device's memory less 10 %
    (16 GiB without CUDA). The choice and its predicted peak are logged."""

    passes: str = ""
    """Comma-separated pass names added to the default pipeline (e.g. annotate_pointwise,
    cudagraph); every pass runs at its place in the one order (graph_trainer/compiler/passes/__init__.py)."""

    disable_passes: str = ""
    """Comma-separated pass names removed from the pipeline."""

    dump_graphs: bool = False
    """Write the graph before the first pass and after each pass to <dump_folder>/graphs/."""

    sac: SACOptions = field(default_factory=SACOptions)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)


#: ``[compile]``: :class:`CompileBase` plus one field per pass with options, named by its section.
Compile = dataclasses.make_dataclass("Compile", [(name, cls, field(default_factory=cls))
                                                 for name, cls in registry.option_sections()], bases=(CompileBase,))


@dataclass
class Debug:
    """Fields added to torchtitan's ``[debug]`` (which has ``seed`` and ``deterministic``)."""

    state_hashes: bool = False
    """Record sha256 of the final parameters, gradients and optimizer state (all ranks) in the metrics.jsonl summary."""

    record_numerics: str = ""
    """A folder: step 1 records every op's output into ``<folder>/rank<r>.pt`` for
    ``scripts/numerics_diff.py``. Slower step 1; empty: off."""


@dataclass
class DataLoader:
    """Defaults this project changes in torchtitan's ``[training.dataloader]``."""

    num_workers: int = -1
    """Worker processes that read and tokenize the next batches while the step runs (one yields
    torchtitan's batches in the same order; 0: read between steps). -1: one on a GPU, 0 on the CPU."""


@dataclass
class Training:
    """Defaults this project changes in torchtitan's ``[training]``."""

    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Checkpoint:
    """Defaults this project changes in torchtitan's ``[checkpoint]``."""

    last_save_model_only: bool = False
    """Save only the model (no optimizer, LR schedule, data position) at the last step: a checkpoint
    for export, which a rerun cannot continue from. Off here: every checkpoint resumes."""


@dataclass
class Comm:
    """``[comm]``: torchtitan's ``mode`` with one more value (``COMM_MODE`` of run_train.sh)."""

    mode: Literal["default", "fake_backend", "local_tensor", "fake_collectives"] = "default"
    """``default``: real collectives. ``fake_backend``: a dry run: one process traces one step of the NGPU-rank layout
    on a fake process group and prints the graph summary and projection. ``fake_collectives``: one process trains as
    rank 0 of that layout on one device, every collective a local copy: that rank's compute, host time and memory;
    losses meaningless, no checkpoints. ``local_tensor``: not supported here."""


@dataclass
class Projection:
    """``[projection]``: the GPUs the dry run (``--comm.mode fake_backend``) projects its step onto."""

    device: Literal["h100", "h200"] = "h100"
    """GPU kind: its bf16 peak, matmul / attention / HBM rates and NVLink / NIC constants."""

    gpus_per_node: int = 8
    """GPUs per node: a process group inside one node runs on NVLink, one across nodes on the network."""

    async_tp: bool = False
    """Count every TP collective as hidden under compute (the async-TP pass's fused ops always are)."""

    cost_constants: str = ""
    """JSON file of constants measured by scripts/cost_constants.py, replacing the datasheet values
    field by field; empty: graph_trainer/projection/cost_constants/<device>.json."""


@dataclass
class JobConfig:
    """The fields this project adds to torchtitan's JobConfig (merged by torchtitan)."""

    compile: Compile = field(default_factory=Compile)
    debug: Debug = field(default_factory=Debug)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    projection: Projection = field(default_factory=Projection)


_ALIASES = (("--dataloader.dataset", "--training.dataset"), ("--profiler.", "--profiling."))


def rewrite_aliases(argv: list[str]) -> list[str]:
    """``--dataloader.dataset[_path]`` -> ``--training.dataset[_path]``, ``--profiler.X`` -> ``--profiling.X``."""
    return [next((new + arg[len(old):] for old, new in _ALIASES if arg.startswith(old)), arg) for arg in argv]


def _tables_as_json(values: dict) -> dict:
    """``values``, each TOML table of a ``[compile.<section>]`` text field (Inductor overrides) made JSON, in place."""
    comp = values.get("compile")
    hints = typing.get_type_hints(Compile)
    for name, table in (comp.items() if isinstance(comp, dict) else ()):
        cls = hints.get(name)
        if isinstance(table, dict) and dataclasses.is_dataclass(cls):
            for key, hint in typing.get_type_hints(cls).items():
                if hint is str and isinstance(table.get(key), dict):
                    table[key] = json.dumps(table[key])
    return values


def resolve_config_file(argv: list[str]) -> list[str]:
    """``argv`` with ``--job.config_file`` naming an existing TOML file, by default the one of
    ``CONFIG=<name>`` (:data:`CONFIG_NAMES`). Raises UserError: no such file or config name."""
    path = _config_path(argv)
    if path is None and (name := os.environ.get("CONFIG")):
        fname = CONFIG_NAMES.get(name) or (name if name.endswith(".toml") else None)
        if fname is None:
            raise UserError(f"CONFIG={name} is not a known config name. Known names: "
                            f"{', '.join(sorted(CONFIG_NAMES))}; or set CONFIG_FILE=path/to/file.toml.")
        path = os.path.join(TRAIN_CONFIGS, fname)
        argv = ["--job.config_file", path] + argv
    if path is not None and not os.path.isfile(path):
        raise UserError(f"Config file '{path}' does not exist. Pass an existing TOML file with CONFIG_FILE=... "
                        f"(run_train.sh) or --job.config_file; the shipped ones are in {TRAIN_CONFIGS}: "
                        f"{', '.join(sorted(os.listdir(TRAIN_CONFIGS)))}.")
    return argv


def _config_manager_cls():
    from torchtitan.config import ConfigManager

    class _Manager(ConfigManager):
        """torchtitan's ConfigManager, reading TOML errors as UserError and Inductor config tables as JSON text."""

        def _maybe_load_toml(self, args):
            path = _config_path(args)
            return None if path is None else _tables_as_json(_load_toml(path))

        def _validate_config(self):
            # torchtitan warns that hf_assets_path does not exist; "embedded" is not a path
            model = self.config.model
            saved = model.hf_assets_path
            if saved in ("", "embedded"):
                model.hf_assets_path = "."
            try:
                super()._validate_config()
            finally:
                if saved in ("", "embedded"):
                    model.hf_assets_path = saved

    return _Manager


def _load_toml(path: str) -> dict:
    """The TOML file at ``path`` as a dict; UserError naming the file (line, column) if unreadable or invalid."""
    import tomli as tomllib  # a dependency: Python 3.10 has no tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise UserError(f"Config file '{path}' cannot be read: {e.strerror}.") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}. Fix the file (see train_configs/ for examples).") from None


def _flag_values(argv: list[str], missing: str | None = None) -> list[tuple[str, str | None]]:
    """``(key, value)`` of each ``--key=value`` / ``--key value`` in ``argv`` (``missing``: no value follows)."""
    return [(key, val if eq else (argv[i + 1] if i + 1 < len(argv) else missing))
            for i, (key, eq, val) in enumerate(arg.partition("=") for arg in argv)]


def _config_path(argv: list[str]) -> str | None:
    """The value of the last ``--job.config_file`` in ``argv``, or None."""
    paths = [val for key, val in _flag_values(argv) if key in ("--job.config_file", "--job.config-file")]
    return paths[-1] if paths else None


def _merged_cls() -> type:
    from torchtitan.config import JobConfig as TitanJobConfig

    return _config_manager_cls()._merge_configs(TitanJobConfig, JobConfig)


def parse_args(argv: list[str] | None = None):
    """Parse CLI (``argv`` without the program name; default ``sys.argv[1:]``) + TOML into the merged JobConfig
    (torchtitan's + :class:`JobConfig`), validated (:func:`validate`). Raises UserError: missing config file, bad
    value, and everything :func:`validate` rejects."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        sys.stdout.write(help_text(_merged_cls()))
        raise SystemExit(0)
    argv = resolve_config_file(rewrite_aliases(argv))
    _check_choices(argv)
    try:
        cfg = _config_manager_cls()(config_cls=_merged_cls()).parse_args(argv)
    except SystemExit as e:  # tyro printed its own message (unknown flag, bad value)
        if e.code not in (0, None):
            raise UserError("Could not parse the command line (see the message above). Flags are "
                            "--section.key value, e.g. --training.steps 10; --help lists them.") from None
        raise
    except ValueError as e:  # TOML with unknown fields
        raise UserError(str(e)) from None
    validate(cfg)
    return cfg


def _literal_flags(cls, prefix: str) -> dict[str, tuple]:
    """``{"--compile.mode": ("eager", ...)}`` for every ``Literal`` field of ``cls`` and its nested dataclasses."""
    out: dict[str, tuple] = {}
    for name, hint in typing.get_type_hints(cls).items():
        if typing.get_origin(hint) is Literal:
            out[f"{prefix}.{name}"] = get_args(hint)
        elif dataclasses.is_dataclass(hint):
            out.update(_literal_flags(hint, f"{prefix}.{name}"))
    return out


def _check_choices(argv: list[str]) -> None:
    """UserError for a bad value of a ``Literal`` project flag, before tyro reports it in a box."""
    choices = {**_literal_flags(Compile, "--compile"), **_literal_flags(Projection, "--projection")}
    for key, value in _flag_values(argv, ""):
        key = key.replace("-", "_").replace("__", "--", 1)
        if key in choices and value not in choices[key]:
            raise _choice_error(key, value, choices[key])


def _choice_error(what: str, value: str, valid) -> UserError:
    close = difflib.get_close_matches(str(value), list(valid), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return UserError(f"Unknown {what} '{value}'. Valid values: {', '.join(valid)}.{hint}")


def validate(cfg) -> list[str]:
    """Reject settings that cannot work, before anything is built; returns the pass names ``aot_fx_trace`` will run,
    in order (``[]`` for other modes). Raises UserError: an unknown choice, a bad pass list or option, values out of
    range, options of a pass that does not run, a bad profiling schedule, an unsupported ``--comm.mode`` use."""
    from graph_trainer.llama3 import llama3_args

    if cfg.comm.mode == "local_tensor":
        raise UserError("--comm.mode local_tensor (COMM_MODE=local_tensor) is not supported; use fake_backend "
                        "(a dry run) or fake_collectives (rank 0's step on one device).")
    if cfg.comm.mode == "fake_collectives" and cfg.checkpoint.enable:
        raise UserError("--checkpoint.enable cannot be used with COMM_MODE=fake_collectives: its collectives are "
                        "local copies, so the parameters it would save are meaningless.")
    comp = cfg.compile
    if comp.enable:
        raise UserError("--compile.enable is set by --compile.mode (jit: torchtitan's per-block torch.compile); "
                        "use --compile.mode jit instead.")
    for flag, value, valid in (
            ("--compile.mode", comp.mode, get_args(CompileMode)),
            ("--compile.inductor_compilation", comp.inductor_compilation, get_args(InductorCompilation)),
            ("--activation_checkpoint.mode", cfg.activation_checkpoint.mode, ("none", "selective", "full")),
            ("--model.name", cfg.model.name, ["llama3"]), ("--model.flavor", cfg.model.flavor, sorted(llama3_args))):
        if value not in valid:
            raise _choice_error(flag, value, valid)
    if cfg.training.steps < 1:
        raise UserError(f"--training.steps must be >= 1, got {cfg.training.steps}.")
    n_layers = llama3_args[cfg.model.flavor].n_layers
    if comp.fsdp.reduce_scatter_in_flight < 0:
        raise UserError("--compile.fsdp.reduce_scatter_in_flight must be >= 0, "
                        f"got {comp.fsdp.reduce_scatter_in_flight}.")
    if comp.fsdp.bucket_blocks < -1:
        raise UserError(f"--compile.fsdp.bucket_blocks must be >= 0 (or -1: auto), got {comp.fsdp.bucket_blocks}.")
    if not -1 <= comp.fsdp.keep_last_blocks <= n_layers:
        raise UserError(f"--compile.fsdp.keep_last_blocks must be in [0, {n_layers}] or -1 (auto) (flavor "
                        f"'{cfg.model.flavor}' has {n_layers} blocks), got {comp.fsdp.keep_last_blocks}.")
    if comp.memory_budget_gib < 0:
        raise UserError(f"--compile.memory_budget_gib must be >= 0 (0: the device's memory), "
                        f"got {comp.memory_budget_gib}.")
    prof = cfg.profiling
    if prof.enable_profiling and prof.profile_freq < prof.profiler_warmup + prof.profiler_active:
        raise UserError(f"--profiling.profile_freq ({prof.profile_freq}) must be >= --profiling.profiler_warmup "
                        f"({prof.profiler_warmup}) + --profiling.profiler_active ({prof.profiler_active}).")
    try:
        registry.check_options(comp)
        traced = comp.mode == "aot_fx_trace"
        names = registry.resolve(registry.PassContext(comp)) if traced else []
        on_cuda = registry.resolve(registry.PassContext(comp, device_type="cuda")) if traced else []
    except ValueError as e:
        raise UserError(f"{e}.") from None
    for spec in registry.registry().values():  # options of a pass that runs on no device
        if (spec.name not in names + on_cuda and (options := registry.options_of(spec, comp)) is not None
                and asdict(options) != asdict(spec.options())):
            raise UserError(f"[compile.{spec.section}] is set, but {spec.name} does not run in this pipeline "
                            f"(--compile.mode {comp.mode}, passes {names}); enable it or drop those options.")
    return names


def project_sections() -> list[str]:
    """``--help`` lists these sections first: ``[compile]``, its levers and one per pass with options."""
    return ["compile", "compile.sac", "compile.fsdp", *(f"compile.{name}" for name, _ in registry.option_sections())]


def _flag_doc(cls, name: str) -> str:
    """The field docstring of ``cls.name``, on one line ("" if none)."""
    try:
        from tyro._docstrings import get_field_docstring

        return " ".join((get_field_docstring(cls, name, ()) or "").split())
    except Exception:  # help text is best effort; the flag itself is still listed
        return ""


def help_text(merged_cls) -> str:
    """``--help``: every flag of the merged JobConfig by section (ours first): type or choices, default, description."""
    sections: dict[str, tuple[list[str], list[str]]] = {}  # section -> (own flags, torchtitan's)

    def walk(cls, prefix, own_cls):
        own = typing.get_type_hints(own_cls) if own_cls else {}
        for f in dataclasses.fields(cls):
            key, hint = f"{prefix}.{f.name}".lstrip("."), typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, key, own.get(f.name) if dataclasses.is_dataclass(own.get(f.name)) else None)
            elif key != "compile.enable":  # set from --compile.mode
                default = f.default if f.default is not dataclasses.MISSING else (
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
                kind = ("{" + ",".join(map(str, get_args(hint))) + "}" if typing.get_origin(hint) is Literal
                        else getattr(hint, "__name__", None) or str(hint).replace("typing.", ""))
                flag = f"--{key} / --{prefix}.no-{f.name}" if hint is bool else f"--{key} {kind}"
                doc = _flag_doc(own_cls if f.name in own else cls, f.name)
                body = textwrap.fill(f"{doc} (default: {default!r})".strip(), 96, initial_indent="      ",
                                     subsequent_indent="      ")
                sections.setdefault(prefix, ([], []))[f.name not in own].extend([f"  {flag}", body])

    walk(merged_cls, "", JobConfig)
    first = list(dict.fromkeys(project_sections() + [f.name for f in dataclasses.fields(JobConfig)]))
    out = ["usage: ./run_train.sh [--section.key VALUE ...]   (NGPU, CONFIG_FILE / CONFIG, LOG_RANK, COMM_MODE: "
           "see README)", "Precedence: command line > TOML file (--job.config_file) > defaults. Booleans: "
           "--section.key / --section.no-key."]
    for name in [s for s in first if s in sections] + [s for s in sections if s not in first]:
        out += ["", f"[{name}]", *sections[name][0], *sections[name][1]]
        if name == "compile":
            out += ["", "  graph passes of --compile.mode aot_fx_trace, in their order (--compile.passes / "
                    "disable_passes):", *_pass_lines()]
    return "\n".join(out) + "\n"


def _pass_lines() -> list[str]:
    """One line per registered pass: name, default or opt-in, numerics, its module docstring's first sentence."""
    lines = []
    for name, spec in registry.registry().items():
        doc = (sys.modules[spec.fn.__module__].__doc__ or "").split(".")[0].split("\n")
        on = lambda **kw: spec.enabled(registry.PassContext(CompileBase(), **kw))  # noqa: E731
        state = ("default" if on() else "default on CUDA" if on(device_type="cuda") else
                 "memory policy" if on(levers=Levers(cudagraph=True)) else "opt-in/by flag")
        tags = ", ".join([state] + (["changes numerics"] if spec.changes_numerics else []))
        lines.append(f"    {name:47s} [{tags}] {' '.join(x.strip() for x in doc)}")
    return lines


def preflight(cfg, world_size: int) -> None:
    """Beyond :func:`validate`: data, tokenizer, parallel degrees and the checkpoint a resume would load. Raises
    UserError: naming the flag or file and what to do."""
    from graph_trainer import checkpoint, data
    from graph_trainer.distributed import parallelize
    from graph_trainer.llama3 import llama3_args

    data.preflight(cfg)
    flavor = llama3_args[cfg.model.flavor]
    rep, shard, tp = parallelize.check_parallel_degrees(cfg, world_size, flavor.n_heads, flavor.n_kv_heads)
    if not cfg.checkpoint.enable:
        return
    folder, load_step = checkpoint.checkpoint_folder(cfg), cfg.checkpoint.load_step
    if load_step != -1:
        checkpoint.require_complete(folder, load_step)
    step = checkpoint.latest_step(folder) if load_step == -1 else load_step
    if step > 0:
        meta = {"flavor": cfg.model.flavor, "mode": cfg.compile.mode, "layout": parallelize.layout_key(rep, shard, tp)}
        checkpoint.check_resume_compatible(folder, step, meta)


def launch_world_size(env=None) -> int:
    """``NNODES`` (default 1) x ``NGPU`` (default 1): the world run_train.sh starts. Raises UserError: a value that is
    not a whole number >= 1 (``NODE_RANK``: 0..NNODES-1)."""
    env = os.environ if env is None else env
    vals = {}
    for name, default, low in (("NGPU", 1, 1), ("NNODES", 1, 1), ("NODE_RANK", 0, 0)):
        raw = (env.get(name) or "").strip() or str(default)
        if not raw.isascii() or not raw.isdigit() or int(raw) < low:
            raise UserError(f"{name}={raw} must be a whole number >= {low}.")
        vals[name] = int(raw)
    if vals["NODE_RANK"] >= vals["NNODES"]:
        raise UserError(f"NODE_RANK={vals['NODE_RANK']} must be from 0 to NNODES-1={vals['NNODES'] - 1} "
                        f"(this host's index).")
    return vals["NNODES"] * vals["NGPU"]


def _check_main(argv: list[str]) -> int:
    """``python -m graph_trainer.config ARGS`` (run_train.sh, before torchrun); exit 2 on a UserError."""
    try:
        preflight(parse_args(argv), launch_world_size())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_check_main(sys.argv[1:]))
