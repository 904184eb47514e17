"""Tag every RMSNorm (forward and backward) as its own regional Inductor region.

Eager RMSNorm is memory bound; Inductor compiles each norm (:func:`~.matching.find_rmsnorm_instances`) into one or
two fused kernels, with slightly different numerics (reduction order). Changes: ``compile_with_inductor =
{"inductor_configs": {...}, "inductor_region": "rmsnorm_<kind>_<i>"}`` (plus ``"candidate_inductor_configs"`` when
tuning) on every node of a norm."""

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graph_trainer import logger
from graph_trainer.compiler.matching import find_rmsnorm_instances
from graph_trainer.compiler.node_meta import json_object, set_pass_summary, tag_for_inductor
from graph_trainer.compiler.ops import is_getitem
from graph_trainer.compiler.registry import GraphPass, PassContext

#: Inductor configs of every RMSNorm region: Inductor's defaults (the baseline of the timed selection).
DEFAULT_RMSNORM_INDUCTOR_CONFIGS: dict[str, Any] = {}

#: Config sets ``regional_inductor`` also compiles and times on CUDA per distinct RMSNorm region
#: (``--compile.rmsnorm.tune``): split sizes of the norm backward's mix-order reduction, or none; no fixed choice
#: wins on every shape.
DEFAULT_RMSNORM_CANDIDATE_CONFIGS: list[dict[str, Any]] = [
    {"triton.mix_order_reduction": False},
    *({"triton.mix_order_reduction_split_size": size} for size in (32, 64, 128, 256)),
    {"triton.mix_order_reduction_autotune_split_size": True},
]

def validate_inductor_configs(inductor_configs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A dict copy of ``inductor_configs``; ``ValueError`` naming unknown Inductor config keys and close ones."""
    import torch._inductor.config as inductor_config

    valid = set(inductor_config.get_config_copy())
    problems = []
    for key in inductor_configs or {}:
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            problems.append(f"{key!r}{hint}")
    if problems:
        raise ValueError(f"unknown torch._inductor.config key(s) in RMSNorm inductor_configs: {'; '.join(problems)}. "
                         "Valid keys are the names in torch._inductor.config (dotted for nested configs, "
                         "e.g. 'triton.cudagraphs').")
    return dict(inductor_configs or {})


def annotate_rmsnorm_for_regional_inductor_pass(
    gm: torch.fx.GraphModule, example_inputs=None, inductor_configs: dict[str, Any] | None = None,
    candidate_configs: list[dict[str, Any]] | None = None) -> torch.fx.GraphModule:
    """Tag each RMSNorm instance (:func:`find_rmsnorm_instances`) as its own region ``rmsnorm_<kind>_<i>``.
    ``inductor_configs`` (default :data:`DEFAULT_RMSNORM_INDUCTOR_CONFIGS`) and ``candidate_configs`` go into every
    tag; an unknown ``torch._inductor.config`` key raises ``ValueError``. Stats: instances per kind and form,
    ``regions``, ``nodes``, ``getitems`` and the configs."""
    default = inductor_configs is None
    configs = validate_inductor_configs(DEFAULT_RMSNORM_INDUCTOR_CONFIGS if default else inductor_configs)
    candidates = [validate_inductor_configs(c) for c in candidate_configs or []]
    instances = find_rmsnorm_instances(gm.graph)
    counts = {"forward": 0, "backward": 0, "recompute": 0, "fused": 0, "decomposed": 0}
    for inst in instances:
        counts[inst["kind"]] += 1
        counts[inst["form"]] += 1
        for node in inst["nodes"]:
            tag_for_inductor(node, configs, inst["name"], candidates)
    tagged = sum(len(inst["nodes"]) for inst in instances)
    getitems = sum(is_getitem(n) for inst in instances for n in inst["nodes"])
    recompute = f" + {counts['recompute']} recomputed (activation checkpointing)" if counts["recompute"] else ""
    set_pass_summary(gm, f"tagged {counts['forward']} forward + {counts['backward']} backward RMSNorms{recompute} and "
                     f"their getitems ({counts['fused']} fused, {counts['decomposed']} decomposed; {tagged} nodes, "
                     f"{getitems} getitems) -> {len(instances)} regions", **counts, regions=len(instances),
                     nodes=tagged, getitems=getitems, inductor_configs=configs, candidate_inductor_configs=candidates)
    return gm


@dataclass
class RMSNormOptions:
    """``[compile.rmsnorm]``: options of ``annotate_rmsnorm_for_regional_inductor``
    (run by ``--compile.numerics_changing_optim`` with regional Inductor)."""

    inductor_configs: str = ""
    """Inductor configs of the RMSNorm regions: JSON on the CLI, a table in TOML.
    Empty: DEFAULT_RMSNORM_INDUCTOR_CONFIGS (graph_trainer/compiler/passes/annotate_rmsnorm.py)."""

    tune: bool = True
    """Also compile each distinct RMSNorm region with each of DEFAULT_RMSNORM_CANDIDATE_CONFIGS (split sizes of the
    norm backward's reduction, or none), time them on CUDA and keep a candidate only when it beats Inductor's
    defaults by 2 %. About a second of compile per candidate and distinct region. No effect on CPU; off with
    --debug.deterministic (the pick depends on timings). Measured: docs/perf_archive.md."""

    def check(self) -> None:
        """Raises ValueError: inductor_configs is not a JSON object of known Inductor keys."""
        validate_inductor_configs(json_object(self.inductor_configs, "--compile.rmsnorm.inductor_configs"))


def _kwargs(options: RMSNormOptions, ctx: PassContext) -> dict[str, Any]:
    configs = json_object(options.inductor_configs, "--compile.rmsnorm.inductor_configs")
    if options.tune and ctx.deterministic:
        logger.info("--debug.deterministic: RMSNorm regions use Inductor's defaults (no timed config pick)")
    tune = options.tune and not ctx.deterministic
    return {"inductor_configs": configs or None,
            "candidate_configs": DEFAULT_RMSNORM_CANDIDATE_CONFIGS if tune else None}


PASS = GraphPass(
    name="annotate_rmsnorm_for_regional_inductor", fn=annotate_rmsnorm_for_regional_inductor_pass,
    options=RMSNormOptions, section="rmsnorm", kwargs=_kwargs, changes_numerics=True, requires=("regional_inductor",),
    enabled=lambda ctx: ctx.compile_cfg.numerics_changing_optim and ctx.compile_cfg.inductor_compilation == "regional",
    aliases=("rmsnorm",))
