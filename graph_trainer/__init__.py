"""graph_trainer: trace a whole Llama3 training step into one FX graph.

Pipeline (one module each): config -> llama3 (model flavors) / parallelize ->
trace (make_fx of forward + loss + backward) -> passes -> train (run) -> metrics.

Node metadata written by :mod:`graph_trainer.trace` and read by passes:

* ``node.meta["custom"]["phase"]``: ``"forward"`` (model forward and loss) or
  ``"backward"`` (everything produced by ``torch.autograd.grad``).
  Placeholders and the output node carry no phase.
* ``node.meta["custom"]["module_fqn"]``: fully-qualified name of the innermost
  ``nn.Module`` whose forward produced the node (e.g. ``"layers.0.attention_norm"``);
  backward nodes inherit it from the forward node with the same autograd
  ``seq_nr``. Absent for nodes produced outside any submodule (the loss).
"""

PHASE_KEY = "phase"
MODULE_FQN_KEY = "module_fqn"
AC_REGION_KEY = "ac_region"
COMPILE_WITH_INDUCTOR_KEY = "compile_with_inductor"

__all__ = ["PHASE_KEY", "MODULE_FQN_KEY", "AC_REGION_KEY", "COMPILE_WITH_INDUCTOR_KEY"]
