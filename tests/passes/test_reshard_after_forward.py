"""reshard_after_forward_pass (FSDP2's reshard_after_forward as a graph pass) on a traced
FSDP step whose collectives really run (1-rank gloo group, fixture in tests/conftest.py)."""

import pytest
import torch

from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass

from graph_trainer.compiler.passes.reshard_after_forward import reshard_after_forward_pass
from graph_trainer.compiler.memory_estimate import estimate_peak_memory

AG = torch.ops._c10d_functional.all_gather_into_tensor.default


def _phase(n):
    return (n.meta.get("custom") or {}).get("phase")


def _forward_gathered(gm):
    """Forward all-gathers and every node on their buffers (wait, slice, view, t ...)."""
    out = {}
    for ag in gm.graph.nodes:
        if ag.target is AG and _phase(ag) == "forward":
            seen, stack = {ag}, [ag]
            while stack:
                for u in stack.pop().users:
                    if u not in seen and _phase(u) == "forward" and u.target not in (torch.ops.aten.mm.default,):
                        if str(u.target).split(".")[-2] in ("wait_tensor", "slice", "view", "t", "_unsafe_view", "transpose"):
                            seen.add(u)
                            stack.append(u)
            out[ag] = seen
    return out


def _backward_reads_of_forward_gathers(gm):
    reads = 0
    for ag, closure in _forward_gathered(gm).items():
        for n in closure:
            reads += sum(1 for u in n.users if _phase(u) == "backward")
    return reads


def test_regather_for_backward_bitwise(fsdp_step):
    traced, inputs, n_params = fsdp_step
    gm = traced.gm
    with torch.no_grad():
        ref = gm(*inputs)
    n_ag = sum(1 for n in gm.graph.nodes if n.target is AG)
    assert n_ag == n_params
    # as traced, the backward reads the forward's gathered parameters (kept alive all step)
    assert _backward_reads_of_forward_gathers(gm) >= n_params - 1
    peak_traced, _ = estimate_peak_memory(gm)

    gm = reshard_after_forward_pass(gm, None, prefetch=2, cpu_async=True)
    stats = gm.meta["graph_trainer_pass_stats"]
    # every parameter but the embedding (its backward needs no weight) is re-gathered
    assert stats["fsdp_all_gathers"] == n_params and stats["resharded"] == n_params - 1
    assert sum(1 for n in gm.graph.nodes if n.target is AG) == 2 * n_params - 1
    assert _backward_reads_of_forward_gathers(gm) == 0
    regathers = [n for n in gm.graph.nodes if n.target is AG and _phase(n) == "backward"]
    assert all(n.meta["custom"]["reshard"] == "regather" for n in regathers)
    gm.graph.lint()
    gm = overlap_collectives_pass(gm, cpu_async=True)
    peak, _ = estimate_peak_memory(gm)
    assert peak <= peak_traced * 1.01
    with torch.no_grad():
        for _ in range(2):
            out = gm(*inputs)
            assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_prefetch_distance(fsdp_step):
    traced, _, _ = fsdp_step
    gm = reshard_after_forward_pass(traced.gm, None, prefetch=0)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for ag in (n for n in gm.graph.nodes if n.target is AG and _phase(n) == "backward"):
        wait = next(iter(ag.users))
        # prefetch 0: the re-gather is issued with its wait, right before the first use
        assert pos[wait] - pos[ag] <= 3
    with pytest.raises(ValueError, match="prefetch"):
        reshard_after_forward_pass(gm, None, prefetch=-1)


def test_first_params_reshards_only_the_earliest(fsdp_step):
    """first_params=10: the embedding (no backward use) and layer 0's 9 parameters; the
    rest keep the forward's gathered copy. Values unchanged."""
    traced, inputs, n_params = fsdp_step
    with torch.no_grad():
        ref = traced.gm(*inputs)
    gm = reshard_after_forward_pass(traced.gm, None, prefetch=2, first_params=10)
    stats = gm.meta["graph_trainer_pass_stats"]
    assert stats["fsdp_all_gathers"] == n_params and stats["resharded"] == 9
    assert sum(1 for n in gm.graph.nodes if n.target is AG and _phase(n) == "backward") == 9
    # per forward all-gather (graph = parameter order): does the backward still read it?
    read = [any(_phase(u) == "backward" for n in closure for u in n.users)
            for closure in _forward_gathered(gm).values()]
    assert len(read) == n_params and not any(read[:10]) and all(read[10:])
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(gm(*inputs), ref))
    with pytest.raises(ValueError, match="first_params"):
        reshard_after_forward_pass(gm, None, first_params=-1)


def test_no_fsdp_is_noop():
    def f(x):
        return (x.cos() + 1).sum()

    gm = torch.fx.symbolic_trace(f)
    before = [n.name for n in gm.graph.nodes]
    gm = reshard_after_forward_pass(gm)
    assert [n.name for n in gm.graph.nodes] == before
    assert gm.meta["graph_trainer_pass_stats"]["resharded"] == 0
