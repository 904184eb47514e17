"""Compile-time passes over the traced training-step graph.

* **The passes**, one per module, each ``(gm: torch.fx.GraphModule, example_inputs,
  **options) -> gm`` (in the style of ``torch/_inductor/fx_passes``), in their default
  order: :mod:`.remove_dead_code`, :mod:`.remove_noop_views`, :mod:`.sac_recompute`,
  :mod:`.reshard_after_forward`, :mod:`.async_tp`, :mod:`.overlap_collectives`, :mod:`.bucket_collectives`,
  :mod:`.annotate_flex_attention`, :mod:`.annotate_rmsnorm`, :mod:`.annotate_pointwise`,
  :mod:`.regional_inductor`, :mod:`.full_inductor`, :mod:`.cudagraph`.
* :mod:`.pipeline`: the registry (``PASSES``), the one default order (``DEFAULT_ORDER``),
  ``build_pipeline`` (the ``[compile]`` config -> the passes with their options) and
  ``run_pipeline`` (runs them, logs and dumps each).
* :mod:`.common`: the helpers the passes share (not a pass); a pass imports from here,
  never from another pass.
* Modules that are not passes: :mod:`.memory_estimate` (an analysis helper: the
  static peak-memory estimate used by the dry run), :mod:`.memory_policy` (the levers
  chosen from it), :mod:`.pass_report` (what each pass did: the per-pass table, readable
  dumps and diffs, tlparse artifacts) and :mod:`.pin_collectives` (an Inductor post-grad
  hook used by ``full_inductor``).
"""

from graph_trainer.passes.annotate_flex_attention import annotate_flex_attention_for_regional_inductor_pass
from graph_trainer.passes.annotate_pointwise import annotate_pointwise_for_regional_inductor_pass, find_pointwise_regions
from graph_trainer.passes.annotate_rmsnorm import (
    DEFAULT_RMSNORM_CANDIDATE_CONFIGS,
    DEFAULT_RMSNORM_INDUCTOR_CONFIGS,
    annotate_rmsnorm_for_regional_inductor_pass,
    find_rmsnorm_instances,
    validate_inductor_configs,
)
from graph_trainer.passes.async_tp import async_tp_pass, find_async_tp_matches
from graph_trainer.passes.bucket_collectives import bucket_collectives_pass
from graph_trainer.passes.cudagraph import cudagraph_pass
from graph_trainer.passes.full_inductor import full_inductor_pass
from graph_trainer.passes.pipeline import (
    DEFAULT_ORDER,
    INDUCTOR_COMPILATION_MODES,
    PASSES,
    PipelineStep,
    build_pipeline,
    canonical_pass_name,
    resolve_pass_names,
    run_pipeline,
)
from graph_trainer.passes.overlap_collectives import overlap_collectives_pass
from graph_trainer.passes.regional_inductor import propose_region_partitions, regional_inductor_pass
from graph_trainer.passes.reshard_after_forward import reshard_after_forward_pass
from graph_trainer.passes.remove_dead_code import remove_dead_code_pass
from graph_trainer.passes.remove_noop_views import remove_noop_views_pass
from graph_trainer.passes.sac_recompute import sac_recompute_pass

__all__ = [
    "DEFAULT_ORDER",
    "DEFAULT_RMSNORM_CANDIDATE_CONFIGS",
    "DEFAULT_RMSNORM_INDUCTOR_CONFIGS",
    "INDUCTOR_COMPILATION_MODES",
    "PASSES",
    "PipelineStep",
    "build_pipeline",
    "annotate_flex_attention_for_regional_inductor_pass",
    "async_tp_pass",
    "bucket_collectives_pass",
    "annotate_pointwise_for_regional_inductor_pass",
    "annotate_rmsnorm_for_regional_inductor_pass",
    "canonical_pass_name",
    "cudagraph_pass",
    "find_async_tp_matches",
    "find_pointwise_regions",
    "find_rmsnorm_instances",
    "full_inductor_pass",
    "overlap_collectives_pass",
    "propose_region_partitions",
    "regional_inductor_pass",
    "remove_dead_code_pass",
    "reshard_after_forward_pass",
    "remove_noop_views_pass",
    "resolve_pass_names",
    "sac_recompute_pass",
    "run_pipeline",
    "validate_inductor_configs",
]
