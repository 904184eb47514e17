"""graph_trainer: trace a whole Llama3 training step into one FX graph.

Modules, in the order the data flows (docs/design.md, "Layout"): :mod:`~graph_trainer.config`
(torchtitan's JobConfig plus ``[compile]``), :mod:`~graph_trainer.model` (flavors, tokenizer,
model, loss, block layout), :mod:`graph_trainer.distributed` (device, process group, TP, AC,
traceable FSDP), :mod:`~graph_trainer.trace` (``make_fx`` of forward + loss + backward),
:mod:`graph_trainer.compiler` (the pass registry, pipeline and passes), :mod:`~graph_trainer.step`
(trace, pipeline, replay), :mod:`~graph_trainer.train` (the loop) and :mod:`~graph_trainer.metrics`;
:mod:`graph_trainer.projection` (the dry run) and :mod:`graph_trainer.tools` (comparison tools).

Node metadata written by :mod:`graph_trainer.trace` and read by passes:

* ``node.meta["custom"]["phase"]``: ``"forward"`` (model forward and loss) or ``"backward"``
  (everything ``torch.autograd.grad`` produced, layer-level AC recomputation included).
* ``node.meta["custom"]["module_fqn"]``: the innermost ``nn.Module`` whose forward produced the
  node (e.g. ``"layers.0.attention_norm"``); backward nodes inherit it through the autograd
  ``seq_nr``. Absent outside any submodule (the loss).
* ``node.meta["custom"]["ac_region"]``: the activation-checkpointed block (``CheckpointWrapper``)
  the node was produced in (read by ``sac_recompute``).
* ``node.meta["custom"]["compile_with_inductor"]``: set by the annotation passes on the nodes of
  an Inductor region (read by ``regional_inductor``).
* ``node.meta["numerics_key"]``: with ``--debug.record_numerics``, the op's identity for matching
  two runs (:mod:`graph_trainer.numerics`).
"""

PHASE_KEY = "phase"
MODULE_FQN_KEY = "module_fqn"
AC_REGION_KEY = "ac_region"
COMPILE_WITH_INDUCTOR_KEY = "compile_with_inductor"
NUMERICS_KEY = "numerics_key"
