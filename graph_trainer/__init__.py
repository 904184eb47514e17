"""graph_trainer: trace a whole Llama3 training step into one FX graph.

The modules in the order the data flows, and the node metadata :mod:`graph_trainer.trace` writes for the passes under
the keys below: docs/design.md ("Layout", "Metadata passes can rely on")."""

import logging

#: The logger of every module (train.setup_logging gives it torchtitan's format).
logger = logging.getLogger("graph_trainer")

PHASE_KEY = "phase"
MODULE_FQN_KEY = "module_fqn"
AC_REGION_KEY = "ac_region"
COMPILE_WITH_INDUCTOR_KEY = "compile_with_inductor"
NUMERICS_KEY = "numerics_key"
