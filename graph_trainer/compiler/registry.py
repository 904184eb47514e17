"""The pass registry: what every graph pass declares (a module of :mod:`graph_trainer.compiler.passes` with its
function ``(gm, example_inputs, **kwargs) -> gm`` and a module-level ``PASS``), and the one place that reads it."""

import functools
import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

#: ``[compile] inductor_compilation`` values.
INDUCTOR_COMPILATION_MODES = ("regional", "full", "none")


@dataclass
class PassContext:
    """What a pass's ``enabled`` / ``kwargs`` functions may read besides its options: the ``[compile]`` section,
    the model's ``BlockLayout``, the memory policy's ``Levers`` (None: the leanest), ``--debug.deterministic``,
    FlexAttention use, the TP group's ``group_name`` and the step's device type (None: not known)."""

    compile_cfg: Any
    layout: Any = None
    levers: Any = None
    deterministic: bool = False
    uses_flex_attention: bool = False
    tp_group_name: str | None = None
    device_type: str | None = None


@dataclass(frozen=True)
class GraphPass:
    """One pass's declaration (the module-level ``PASS`` of its file). ``options``: a dataclass of the pass's
    ``[compile.<section>]`` options (its ``check()``, if any, raises ``ValueError``); ``kwargs(options, ctx)``: the
    function's keyword arguments (default: the options' fields)."""

    name: str  # canonical: --compile.passes / disable_passes, logs, dumps
    fn: Callable[..., Any]  # fn(gm, example_inputs, **kwargs) -> gm
    options: type | None = None
    section: str | None = None  # default: the module name
    enabled: Callable[[PassContext], bool] = lambda ctx: False  # the default pipeline runs it
    kwargs: Callable[[Any, PassContext], dict[str, Any]] | None = None
    changes_numerics: bool = False  # needs --compile.numerics_changing_optim
    compiles: bool = False  # the dry run and the memory trials skip it
    in_memory_trial: bool = False  # the memory policy runs it to estimate a candidate's peak
    requires: tuple[str, ...] = ()  # passes that must run after it for it to have an effect
    excludes: tuple[str, ...] = ()  # passes that cannot run together with it
    aliases: tuple[str, ...] = ()  # other accepted spellings (and always the module name)


@functools.cache
def registry() -> dict[str, GraphPass]:
    """Canonical name -> :class:`GraphPass` in ``passes.ORDER``; ``TypeError`` for a missing or doubled ``PASS``."""
    from graph_trainer.compiler.passes import ORDER

    out: dict[str, GraphPass] = {}
    for module in ORDER:
        spec = getattr(importlib.import_module(f"graph_trainer.compiler.passes.{module}"), "PASS", None)
        if not isinstance(spec, GraphPass):
            raise TypeError(f"graph_trainer/compiler/passes/{module}.py defines no PASS = GraphPass(...)")
        if spec.name in out:
            raise TypeError(f"two passes are named {spec.name!r}")
        out[spec.name] = replace(spec, section=spec.section or module,
                                 aliases=tuple(dict.fromkeys((module, *spec.aliases))))
    return out


def option_sections() -> list[tuple[str, type]]:
    """``[(section, options dataclass)]`` of the passes with options, in pass order."""
    return [(p.section, p.options) for p in registry().values() if p.options is not None]


def options_of(spec: GraphPass, compile_cfg: Any) -> Any:
    """``spec``'s section of ``compile_cfg`` (its defaults if the config lacks it); None for a pass without options."""
    return None if spec.options is None else getattr(compile_cfg, spec.section, None) or spec.options()


def canonical_name(name: str) -> str:
    """Canonical name for ``name`` (or ``<name>_pass``, the module name, an alias); else ``ValueError``."""
    key = name.strip()
    for spec in registry().values():
        if key in (spec.name, f"{spec.name}_pass", *spec.aliases):
            return spec.name
    raise ValueError(f"unknown graph pass {name!r}; valid passes: {', '.join(registry())}")


def named_passes(compile_cfg: Any) -> tuple[set[str], set[str]]:
    """``(added, disabled)``: the canonical names ``--compile.passes`` / ``--compile.disable_passes`` list (each a
    comma-separated string or a list of names); ``ValueError`` for an unknown name."""
    return tuple({canonical_name(n) for n in (v.split(",") if isinstance(v, str) else v or ()) if n.strip()}
                 for v in (compile_cfg.passes, compile_cfg.disable_passes))  # type: ignore[return-value]


def resolve(ctx: PassContext) -> list[str]:
    """The pass names ``ctx.compile_cfg`` runs, in the default order: those ``enabled(ctx)``, plus
    ``--compile.passes``, less ``--compile.disable_passes``. Raises ``ValueError`` for unknown names or
    ``inductor_compilation``, a numerics-changing pass without ``numerics_changing_optim``, and a pass without one it
    requires or with one it excludes."""
    cfg = ctx.compile_cfg
    if cfg.inductor_compilation not in INDUCTOR_COMPILATION_MODES:
        raise ValueError(f"--compile.inductor_compilation must be one of {', '.join(INDUCTOR_COMPILATION_MODES)}; "
                         f"got {cfg.inductor_compilation!r}")
    reg = registry()
    added, disabled = named_passes(cfg)
    names = [n for n, spec in reg.items() if (spec.enabled(ctx) or n in added) and n not in disabled]
    if (changing := [n for n in names if reg[n].changes_numerics]) and not cfg.numerics_changing_optim:
        raise ValueError(f"{', '.join(changing)} changes numerics: add --compile.numerics_changing_optim to enable it")
    for n in names:
        if missing := [r for r in reg[n].requires if r not in names[names.index(n):]]:
            raise ValueError(f"{n} only has an effect when {', '.join(missing)} runs after it, but the passes are "
                             f"{names} (--compile.inductor_compilation {cfg.inductor_compilation}); "
                             f"change the compilation or disable {n}")
        if clash := [x for x in reg[n].excludes if x in names]:
            raise ValueError(f"{n} and {', '.join(clash)} cannot run together")
    return names


def check_options(compile_cfg: Any) -> None:
    """Call ``check()`` on every options section of ``compile_cfg`` that has one (its ``ValueError`` propagates)."""
    for spec in registry().values():
        if hasattr(options := options_of(spec, compile_cfg), "check"):
            options.check()


@dataclass
class PipelineStep:
    """One pass with its arguments: ``step(gm, example_inputs)`` runs ``fn(gm, example_inputs, **options)``."""

    name: str
    fn: Callable[..., Any]
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        return self.fn(gm, example_inputs, **self.options)


def pass_step(name: str, ctx: PassContext | None = None) -> PipelineStep:
    """The :class:`PipelineStep` of pass ``name`` (any spelling) with the arguments its options and ``ctx`` give
    (no ``ctx``: the function's defaults); ``ValueError`` for an unknown name."""
    spec = registry()[canonical_name(name)]
    if ctx is None:
        return PipelineStep(spec.name, spec.fn)
    options = options_of(spec, ctx.compile_cfg)
    if spec.kwargs is not None:
        return PipelineStep(spec.name, spec.fn, dict(spec.kwargs(options, ctx)))
    return PipelineStep(spec.name, spec.fn, asdict(options) if options is not None else {})
