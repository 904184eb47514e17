"""graph_trainer.compiler.collectives: recognising collectives, ``hold``, FSDP parameter all-gathers."""

import torch

from graph_trainer.compiler import memory_estimate
from graph_trainer.compiler.collectives import (collective_kind, group_name_of, hold, is_collective, is_wait,
                                                 shard_chain, sole_wait, strip_holds)
from graph_trainer.compiler.passes import bucket_collectives, overlap_collectives

from .conftest import AG, aten, c10d, fx_graph, module


def test_collective_kind_is_wait_is_collective_shard_chain_and_strip_holds():
    g, (x, w) = fx_graph("x", "w")
    cast = g.call_function(aten._to_copy.default, (w,), {"dtype": torch.bfloat16})
    ag = g.call_function(c10d.all_gather_into_tensor.default, (cast, 2, "0"))
    ag_wait = g.call_function(c10d.wait_tensor.default, (ag,))
    held = g.call_function(hold, (ag_wait, cast))
    mm = g.call_function(aten.mm.default, (x, held))
    act_ag = g.call_function(c10d.all_gather_into_tensor.default, (mm, 2, "0"))  # an activation (TP)
    ar = g.call_function(c10d.all_reduce.default, (mm, "sum", "0"))
    ar_wait = g.call_function(c10d.wait_tensor.default, (ar,))
    autograd_ag = g.call_function(torch.ops._c10d_functional_autograd.all_gather_into_tensor.default, (x, 2, "0"))
    g.output((ar_wait, act_ag, autograd_ag))
    n = dict(cast=cast, ag=ag, ag_wait=ag_wait, held=held, mm=mm, act_ag=act_ag, ar=ar, ar_wait=ar_wait,
             autograd_ag=autograd_ag)
    kinds = {"ag": AG, "act_ag": AG, "ar": "all_reduce"}  # None: autograd_ag is no functional collective with a wait
    assert {k: collective_kind(v) for k, v in n.items()} == {k: kinds.get(k) for k in n}
    assert {k for k, v in n.items() if is_wait(v)} == {"ag_wait", "ar_wait"}
    assert {k for k, v in n.items() if is_collective(v)} == {"ag", "ag_wait", "act_ag", "ar", "ar_wait", "autograd_ag"}
    assert sole_wait(ag) is ag_wait and sole_wait(act_ag) is None and sole_wait(mm) is None
    assert group_name_of(ag) == "0" and group_name_of(ar) is None
    # shard_chain tells parameter all-gathers (FSDP) from activation ones (TP)
    assert shard_chain(ag) == [cast] and shard_chain(act_ag) is None
    # one ``hold`` object for every pass that inserts or recognises it (reshard_after_forward: through read_through)
    assert all(mod.hold is hold for mod in (overlap_collectives, bucket_collectives, memory_estimate))
    assert hold(3, 4, 5) == 3
    gm = module(g)
    assert strip_holds(gm) == 1
    assert mm.args == (mm.args[0], ag_wait) and not any(node.target is hold for node in gm.graph.nodes)
    assert strip_holds(gm) == 0
