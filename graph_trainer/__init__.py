"""graph_trainer: trace a whole Llama3 training step into one FX graph.

Modules, in the order the data flows (docs/design.md, "Layout"):

* :mod:`~graph_trainer.config`: torchtitan's JobConfig plus ``[compile]`` (top-level
  choices and one group per pass with options: ``[compile.rmsnorm]``,
  ``[compile.full_inductor]``, ``[compile.sac]``, ``[compile.fsdp]``);
* :mod:`~graph_trainer.model`: flavors, tokenizer, model, loss and block layout (the one
  builder);
* :mod:`~graph_trainer.distributed.parallelize` / :mod:`~graph_trainer.distributed.fsdp`: device, process group,
  TP plan, AC wrappers, traceable FSDP shards;
* :mod:`~graph_trainer.trace`: ``make_fx`` of forward + loss + backward into one graph;
* :mod:`graph_trainer.compiler.passes`: the graph passes; ``passes.pipeline.build_pipeline`` turns
  ``[compile]`` into the ordered passes with their arguments, ``run_pipeline`` runs them;
* :mod:`~graph_trainer.step`: the step object (trace, pipeline, replay);
* :mod:`~graph_trainer.train`: the training loop; :mod:`~graph_trainer.metrics`: writer and
  reader of ``metrics.jsonl``;
* :mod:`~graph_trainer.projection.dry_run`: the same trace and pipeline on a fake process group;
* :mod:`graph_trainer.tools`: comparison tools that launch runs (not imported by training).

Node metadata written by :mod:`graph_trainer.trace` and read by passes:

* ``node.meta["custom"]["phase"]``: ``"forward"`` (model forward and loss) or
  ``"backward"`` (everything produced by ``torch.autograd.grad``, layer-level AC
  recomputation included). Placeholders and the output node carry no phase.
* ``node.meta["custom"]["module_fqn"]``: fully-qualified name of the innermost
  ``nn.Module`` whose forward produced the node (e.g. ``"layers.0.attention_norm"``);
  backward nodes inherit it from the forward node with the same autograd
  ``seq_nr``. Absent for nodes produced outside any submodule (the loss).
* ``node.meta["custom"]["ac_region"]``: the FQN of the activation-checkpointed block
  (``CheckpointWrapper``) the node was produced in (read by ``sac_recompute``).
* ``node.meta["custom"]["compile_with_inductor"]``: set by the annotation passes on the
  nodes of an Inductor region (read by ``regional_inductor``).
* ``node.meta["numerics_key"]``: with ``--debug.record_numerics``, the op's identity for
  matching two runs (:mod:`graph_trainer.numerics`); ``regional_inductor`` copies it onto
  a region's outputs.
"""

PHASE_KEY = "phase"
MODULE_FQN_KEY = "module_fqn"
AC_REGION_KEY = "ac_region"
COMPILE_WITH_INDUCTOR_KEY = "compile_with_inductor"
NUMERICS_KEY = "numerics_key"

__all__ = ["PHASE_KEY", "MODULE_FQN_KEY", "AC_REGION_KEY", "COMPILE_WITH_INDUCTOR_KEY", "NUMERICS_KEY"]
