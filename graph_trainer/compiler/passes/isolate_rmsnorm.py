"""Keep each RMSNorm (forward, backward) in kernels of its own inside the whole-graph compile.

The ``full_inductor`` counterpart of ``annotate_rmsnorm``: the nodes of every
:func:`~graph_trainer.compiler.matching.find_rmsnorm_instances` instance form the fusion group ``rmsnorm_<kind>_<i>``,
which ``full_inductor`` fuses only among itself. Changes numerics (the norm's output is rounded at the kernel
boundary). Opt-in."""

from collections import Counter

import torch

from graph_trainer.compiler.matching import find_rmsnorm_instances
from graph_trainer.compiler.node_meta import set_pass_summary, tag_fusion_group
from graph_trainer.compiler.registry import GraphPass


def isolate_rmsnorm_pass(gm: torch.fx.GraphModule, example_inputs=None) -> torch.fx.GraphModule:
    """Tag each RMSNorm instance's nodes with its own fusion group. Stats: ``groups``, ``nodes``."""
    instances = find_rmsnorm_instances(gm.graph)
    for inst in instances:
        for node in inst["nodes"]:
            tag_fusion_group(node, inst["name"])
    nodes = sum(len(inst["nodes"]) for inst in instances)
    kinds = ", ".join(f"{v} {k}" for k, v in Counter(inst["kind"] for inst in instances).items()) or "none"
    set_pass_summary(gm, f"{len(instances)} RMSNorm fusion groups ({kinds}; {nodes} nodes)",
                     groups=len(instances), nodes=nodes)
    return gm


PASS = GraphPass(name="isolate_rmsnorm", fn=isolate_rmsnorm_pass, changes_numerics=True, requires=("full_inductor",))
