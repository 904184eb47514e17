"""The ordered graph-pass pipeline: registry, the one default order, and the runner.

Order (:data:`DEFAULT_ORDER`, the only place it is defined)::

    remove_dead_code -> remove_noop_views
      -> sac_recompute                                   (memory policy; op-level selective AC only)
      -> reshard_after_forward                           (memory policy; FSDP only)
      -> overlap_collectives                             (no-op without collectives)
      -> annotate_flex_attention_for_regional_inductor   (if flex attention is used)
      -> annotate_rmsnorm_for_regional_inductor          (if numerics_changing_optim)
      -> annotate_pointwise_for_regional_inductor        (if also pointwise_regions)
      -> regional_inductor | full_inductor               (inductor_compilation)
      -> cudagraph                                       (if asked)

Every pass has the signature ``(gm, example_inputs) -> gm`` and reports a
short summary via ``gm.meta`` (see :mod:`graph_trainer.passes._common`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from graph_trainer.passes._common import num_nodes, op_counts, pop_pass_summary
from graph_trainer.passes.annotate_flex_attention import annotate_flex_attention_for_regional_inductor_pass
from graph_trainer.passes.annotate_pointwise import annotate_pointwise_for_regional_inductor_pass
from graph_trainer.passes.annotate_rmsnorm import annotate_rmsnorm_for_regional_inductor_pass
from graph_trainer.passes.bucket_collectives import bucket_collectives_pass
from graph_trainer.passes.cudagraph import cudagraph_pass
from graph_trainer.passes.full_inductor import full_inductor_pass
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
}

INDUCTOR_COMPILATION_MODES = ("regional", "full", "none")


def canonical_pass_name(name: str) -> str:
    """Canonical registry name for ``name`` (or an alias); ValueError if unknown."""
    key = name.strip()
    if key in PASSES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    raise ValueError(f"unknown graph pass {name!r}; valid passes: {', '.join(DEFAULT_ORDER)}")


def resolve_pass_names(
    *,
    passes: list[str] | None,
    disable_passes: Iterable[str] = (),
    numerics_changing_optim: bool,
    inductor_compilation: str,
    uses_flex_attention: bool = False,
    cudagraphs: bool = False,
    pointwise_regions: bool = False,
    bucket_collectives: int = 0,
) -> list[str]:
    """The list of pass names to run, in :data:`DEFAULT_ORDER`.

    ``passes=None`` derives the list from the flags: the cleanup passes,
    ``sac_recompute`` (a no-op without op-level selective AC),
    ``reshard_after_forward`` and ``overlap_collectives`` (no-ops for graphs without
    FSDP / collectives), the
    ``bucket_collectives`` (if ``bucket_collectives > 1``, the bucket size), the
    FlexAttention annotation (if ``uses_flex_attention``), the RMSNorm
    annotation (if ``numerics_changing_optim`` and ``inductor_compilation ==
    "regional"``; with ``"full"`` Inductor compiles every norm anyway), the
    pointwise-chain annotation (if ``pointwise_regions`` too; it changes numerics,
    so ``pointwise_regions`` without ``numerics_changing_optim`` is a ValueError), the
    compile pass of ``inductor_compilation`` and ``cudagraph`` (if
    ``cudagraphs``). A given ``passes`` list replaces that list. Then
    ``disable_passes`` are removed.

    Raises ``ValueError`` for unknown names, an invalid ``inductor_compilation``,
    the RMSNorm annotation without a later ``regional_inductor`` pass (the
    annotation only has an effect when regional_inductor compiles the tagged
    regions; in particular with ``inductor_compilation == "none"``), and for
    ``regional_inductor`` together with ``full_inductor``.
    """
    if inductor_compilation not in INDUCTOR_COMPILATION_MODES:
        raise ValueError(
            f"inductor_compilation must be one of {', '.join(INDUCTOR_COMPILATION_MODES)}; "
            f"got {inductor_compilation!r}"
        )
    if passes is None:
        names = [REMOVE_DEAD_CODE, REMOVE_NOOP_VIEWS, SAC_RECOMPUTE, RESHARD_AFTER_FORWARD, OVERLAP_COLLECTIVES]
        if bucket_collectives > 1:
            names.append(BUCKET_COLLECTIVES)
        if uses_flex_attention:
            names.append(ANNOTATE_FLEX_ATTENTION)
        if pointwise_regions and not numerics_changing_optim:
            raise ValueError(
                "pointwise_regions changes numerics (Inductor fuses bf16 chains in fp32): "
                "add numerics_changing_optim (--compile.numerics_changing_optim) to enable it"
            )
        if numerics_changing_optim and inductor_compilation != "full":
            names.append(ANNOTATE_RMSNORM)
            if pointwise_regions:
                names.append(ANNOTATE_POINTWISE)
        if inductor_compilation == "regional":
            names.append(REGIONAL_INDUCTOR)
        elif inductor_compilation == "full":
            names.append(FULL_INDUCTOR)
        if cudagraphs:
            names.append(CUDAGRAPH)
    else:
        names = [canonical_pass_name(n) for n in passes]
    disabled = {canonical_pass_name(n) for n in disable_passes}
    names = sorted({n for n in names if n not in disabled}, key=DEFAULT_ORDER.index)

    for annotation in (ANNOTATE_RMSNORM, ANNOTATE_POINTWISE):
        if annotation in names and (inductor_compilation == "none" or REGIONAL_INDUCTOR not in names):
            raise ValueError(
                f"the annotation pass {annotation} only has an effect when regional_inductor compiles "
                f"the tagged regions, but inductor_compilation={inductor_compilation!r} and the resolved "
                f"passes are {names}; use inductor_compilation='regional' or disable the annotation pass"
            )
    if REGIONAL_INDUCTOR in names and FULL_INDUCTOR in names:
        raise ValueError("regional_inductor and full_inductor are mutually exclusive")
    return names


def _readable(gm: Any) -> str:
    if isinstance(gm, torch.fx.GraphModule):
        try:
            return gm.print_readable(print_output=False)
        except Exception as e:  # compiled callables that do not print
            try:
                return f"# print_readable failed: {e!r}\n{gm.code}"
            except Exception as e2:
                return f"# print_readable failed: {e!r}; gm.code failed: {e2!r}\n# {gm!r}\n"
    return f"# not an FX GraphModule: {type(gm).__qualname__}\n# {gm!r}\n"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        return repr(obj)


def run_passes(
    gm: torch.fx.GraphModule,
    example_inputs: Any,
    names: Iterable[str],
    *,
    rmsnorm_inductor_configs: dict[str, Any] | None = None,
    rmsnorm_candidate_configs: list[dict[str, Any]] | None = None,
    sac_save_matmuls: bool = False,
    full_inductor_configs: dict[str, Any] | None = None,
    pin_collectives: bool = True,
    reshard_first_params: int | None = None,
    bucket_size: int | None = None,
    dump_folder: str | None = None,
) -> torch.fx.GraphModule:
    """Run the passes ``names`` in the given order and return the final module.

    Logs one line per pass on the ``graph_trainer`` logger: name, wall time,
    node count before -> after and the pass's own summary. With
    ``dump_folder``, writes ``<dump_folder>/graphs/00_input.py``, one
    ``NN_<pass>.py`` per pass (readable code of the graph after it) and
    ``summary.json`` (per pass: time, node counts, summary, stats, op counts
    per target; rewritten after each pass). ``sac_save_matmuls``: ``sac_recompute``
    keeps every ``aten.mm`` output even where selective AC tagged it for recompute.
    ``full_inductor_configs`` / ``pin_collectives``: passed to ``full_inductor``;
    ``reshard_first_params`` to ``reshard_after_forward`` (``first_params``; None: all);
    ``bucket_size`` to ``bucket_collectives`` (None: its default).
    """
    names = [canonical_pass_name(n) for n in names]
    graphs_dir = None
    records: list[dict[str, Any]] = []
    if dump_folder is not None:
        graphs_dir = os.path.join(dump_folder, "graphs")
        os.makedirs(graphs_dir, exist_ok=True)
        _write(os.path.join(graphs_dir, "00_input.py"), _readable(gm))
        records.append({"index": 0, "pass": "input", "nodes": num_nodes(gm), "ops": op_counts(gm)})

    pop_pass_summary(gm)
    for i, name in enumerate(names, start=1):
        fn = PASSES[name]
        before = num_nodes(gm)
        kwargs = {}
        if name == ANNOTATE_RMSNORM:
            kwargs = {"inductor_configs": rmsnorm_inductor_configs, "candidate_configs": rmsnorm_candidate_configs}
        elif name == SAC_RECOMPUTE and sac_save_matmuls:
            kwargs = {"save_ops": [torch.ops.aten.mm.default]}
        elif name == RESHARD_AFTER_FORWARD and reshard_first_params is not None:
            kwargs = {"first_params": reshard_first_params}
        elif name == BUCKET_COLLECTIVES and bucket_size is not None:
            kwargs = {"bucket_size": bucket_size}
        elif name == FULL_INDUCTOR:
            kwargs = {"inductor_configs": full_inductor_configs, "pin_collectives": pin_collectives}
        t0 = time.perf_counter()
        gm = fn(gm, example_inputs, **kwargs)
        elapsed = time.perf_counter() - t0
        after = num_nodes(gm)
        summary, stats = pop_pass_summary(gm)
        logger.info(
            "graph pass %-46s %8.3fs  nodes %s -> %s  %s",
            name,
            elapsed,
            "n/a" if before is None else before,
            "n/a" if after is None else after,
            summary,
        )
        if graphs_dir is not None:
            _write(os.path.join(graphs_dir, f"{i:02d}_{name}.py"), _readable(gm))
            records.append(
                {
                    "index": i,
                    "pass": name,
                    "time_s": round(elapsed, 4),
                    "nodes_before": before,
                    "nodes_after": after,
                    "summary": summary,
                    "stats": _jsonable(stats),
                    "ops": op_counts(gm),
                }
            )
            _write(os.path.join(graphs_dir, "summary.json"), json.dumps(records, indent=1))
    return gm
