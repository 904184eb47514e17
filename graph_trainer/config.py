"""Configuration: torchtitan's JobConfig plus this project's ``[compile]`` fields.

The extension is a torchtitan ``--job.custom_config_module`` (the TOML files set
``[job] custom_config_module = "graph_trainer.config"``); :func:`parse_args`
always merges it, so it is present whether or not the TOML names it.

Precedence: CLI ``--section.key value`` > TOML file > dataclass defaults.

Flag spellings of newer torchtitan accepted:
``--dataloader.dataset[_path]`` -> ``--training.dataset[_path]`` and
``--profiler.*`` -> ``--profiling.*``.
"""


import difflib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from graph_trainer.compiler.memory_policy import FSDPOptions, SACOptions
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
class CompileBase:
    """``[compile]`` — how the training step is captured and compiled.

    torchtitan's own ``enable`` / ``components`` / ``backend`` are set by ``mode``
    (``jit`` is torchtitan's per-TransformerBlock torch.compile). :data:`Compile` adds one
    ``[compile.<section>]`` per pass with options (:mod:`graph_trainer.compiler.registry`).
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
    """Comma-separated pass names added to the default pipeline (e.g. annotate_pointwise,
    cudagraph); every pass runs at its place in the one order (graph_trainer/compiler/passes/__init__.py)."""

    disable_passes: str = ""
    """Comma-separated pass names removed from the pipeline."""

    dump_graphs: bool = False
    """Write the graph before the first pass and after each pass to <dump_folder>/graphs/."""

    sac: SACOptions = field(default_factory=SACOptions)
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)


def _resolved(cls: type) -> type:
    """``cls`` with its annotations evaluated: an options class from a module with
    ``from __future__ import annotations`` holds them as text, which torchtitan's merged
    copy of the class (made in another module) cannot evaluate."""
    import dataclasses
    import typing

    cls.__annotations__ = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        f.type = cls.__annotations__[f.name]
    return cls


def _compile_cls() -> type:
    """:class:`CompileBase` plus one field per pass with options, named by its section
    (:func:`graph_trainer.compiler.registry.option_sections`)."""
    import dataclasses

    from graph_trainer.compiler.registry import option_sections

    for cls in (SACOptions, FSDPOptions):
        _resolved(cls)
    fields = [(name, _resolved(cls), field(default_factory=cls)) for name, cls in option_sections()]
    return dataclasses.make_dataclass("Compile", fields, bases=(CompileBase,))


#: ``[compile]``: :class:`CompileBase` and the passes' option sections.
Compile = _compile_cls()


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
    projection (graph_trainer/projection/dry_run.py); nothing is executed. ``fake_collectives``: one
    process trains as rank 0 of the NGPU-rank layout on one device, every collective a local
    copy (graph_trainer/distributed/fake_pg.py): the step's compute, host time and memory of that rank
    without communication; losses and gradients are meaningless (no checkpoints). ``local_tensor``:
    not supported here."""


@dataclass
class Projection:
    """``[projection]``: the GPUs the dry run (``--comm.mode fake_backend``) projects its traced
    step onto (graph_trainer/projection/cost_model.py)."""

    device: Literal["h100", "h200"] = "h100"
    """GPU kind: its bf16 peak, matmul / attention / HBM rates and NVLink / NIC constants."""

    gpus_per_node: int = 8
    """GPUs per node: a process group inside one node runs on NVLink, one across nodes on the
    network (one NIC per GPU)."""

    async_tp: bool = False
    """Count every TP collective as hidden under compute, for a graph traced without the
    async-TP pass (its fused ops count as hidden either way)."""

    cost_constants: str = ""
    """JSON file of constants measured by scripts/cost_constants.py, replacing the datasheet
    values field by field; empty: graph_trainer/projection/cost_constants/<device>.json."""


@dataclass
class JobConfig:
    """The fields this project adds to torchtitan's JobConfig (merged by torchtitan)."""

    compile: Compile = field(default_factory=Compile)
    debug: Debug = field(default_factory=Debug)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    projection: Projection = field(default_factory=Projection)


def rewrite_aliases(argv: list[str]) -> list[str]:
    """Map newer torchtitan spellings to the ones this parser knows:
    ``--dataloader.dataset[_path]`` -> ``--training.dataset[_path]``, ``--profiler.X`` ->
    ``--profiling.X``."""
    out = []
    for arg in argv:
        for old, new in (("--dataloader.dataset", "--training.dataset"), ("--profiler.", "--profiling.")):
            if arg.startswith(old):
                arg = new + arg[len(old):]
                break
        out.append(arg)
    return out


def _tables_as_json(values: dict) -> None:
    """In a TOML file's ``[compile.<section>]`` tables, turn a table given for a text field
    (the Inductor config overrides) into the JSON text the dataclass holds (in place)."""
    import dataclasses
    import typing

    comp = values.get("compile")
    if not isinstance(comp, dict):
        return
    hints = typing.get_type_hints(Compile)
    for name, table in comp.items():
        cls = hints.get(name)
        if not (isinstance(table, dict) and dataclasses.is_dataclass(cls)):
            continue
        text_fields = {f.name for f in dataclasses.fields(cls) if typing.get_type_hints(cls)[f.name] is str}
        for key in text_fields & set(table):
            if isinstance(table[key], dict):
                table[key] = json.dumps(table[key])


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


def _config_manager_cls():
    from torchtitan.config import ConfigManager

    class _Manager(ConfigManager):
        """torchtitan's ConfigManager, reading Inductor config tables as JSON text;
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
            _tables_as_json(values)
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
        The merged JobConfig dataclass instance.

    Raises:
        UserError: missing config file, bad value, and everything :func:`validate` rejects.
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
    choices = {**_literal_flags(Compile, "--compile"), **_literal_flags(Projection, "--projection")}
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
        (:func:`graph_trainer.compiler.registry.resolve`); ``[]`` for other modes.

    Raises:
        UserError: unknown compile mode, inductor compilation, AC mode or flavor; a bad
            pass list or pass option; ``[compile.fsdp]`` values out of range; options of a
            pass that does not run; a bad profiling schedule;
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
    prof = cfg.profiling
    if prof.enable_profiling and prof.profile_freq < prof.profiler_warmup + prof.profiler_active:
        raise UserError(
            f"--profiling.profile_freq ({prof.profile_freq}) must be >= --profiling.profiler_warmup "
            f"({prof.profiler_warmup}) + --profiling.profiler_active ({prof.profiler_active})."
        )
    from graph_trainer.compiler import registry

    try:
        registry.check_options(comp)
        names = registry.resolve(registry.PassContext(comp)) if comp.mode == "aot_fx_trace" else []
    except ValueError as e:
        raise UserError(f"{e}.") from None
    for spec in registry.registry().values():
        options = registry.options_of(spec, comp)
        if spec.name not in names and options is not None and asdict(options) != asdict(spec.options()):
            raise UserError(f"[compile.{spec.section}] is set, but {spec.name} does not run in this pipeline "
                            f"(--compile.mode {comp.mode}, passes {names}); enable it or drop those options.")
    return names


def project_sections() -> list[str]:
    """``--help`` lists these sections first: ``[compile]``, its levers and one per pass with options."""
    from graph_trainer.compiler.registry import option_sections

    return ["compile", "compile.sac", "compile.fsdp", *(f"compile.{name}" for name, _ in option_sections())]


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
    sections (:func:`project_sections`) and fields first, each with its type or allowed
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
    first = project_sections()
    order = [s for s in first if s in sections] + [s for s in sections if s not in first]
    out = [
        "usage: ./run_train.sh [--section.key VALUE ...]   (NGPU, CONFIG_FILE / CONFIG, LOG_RANK, COMM_MODE: see README)",
        "Precedence: command line > TOML file (--job.config_file) > defaults. Booleans: --section.key / --section.no-key.",
    ]
    for name in order:
        out += ["", f"[{name}]", *sections[name][0], *sections[name][1]]
        if name == "compile":
            out += ["", "  graph passes of --compile.mode aot_fx_trace, in their order (--compile.passes / disable_passes):",
                    *_pass_lines()]
    return "\n".join(out) + "\n"


def _pass_lines() -> list[str]:
    """One line per registered pass: name, on by default or opt-in, numerics, what it does
    (its module docstring's first sentence)."""
    import sys as _sys

    from graph_trainer.compiler.registry import PassContext, registry

    lines = []
    for name, spec in registry().items():
        doc = (_sys.modules[spec.fn.__module__].__doc__ or "").split(".")[0].split("\n")
        state = "default" if spec.enabled(PassContext(CompileBase())) else "opt-in/by flag"
        tags = ", ".join([state] + (["changes numerics"] if spec.changes_numerics else []))
        lines.append(f"    {name:47s} [{tags}] {' '.join(x.strip() for x in doc)}")
    return lines


def preflight(cfg, world_size: int) -> None:
    """Everything knowable before any process starts, beyond :func:`validate`: the data and
    tokenizer (:func:`graph_trainer.data.preflight`), the parallel degrees against
    ``world_size`` (NNODES x NGPU), and the checkpoint folder a
    resume would load (its recorded flavor / mode / layout; a ``--checkpoint.load_step``
    that does not exist).

    Raises:
        UserError: naming the flag or file and what to do.
    """
    from graph_trainer import checkpoint, data
    from graph_trainer.distributed import parallelize
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
