"""reshard_after_forward_pass on a traced FSDP step over a 1-rank gloo group."""

import copy

import pytest
import torch

from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.node_meta import phase_of
from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass
from graph_trainer.compiler.passes.reshard_after_forward import reshard_after_forward_pass

from .conftest import assert_bitwise, c10d, call_targets, run_no_grad, stats

AG = c10d.all_gather_into_tensor.default
_CLOSURE = ("wait_tensor", "slice", "view", "t", "_unsafe_view", "transpose")


def _backward_reads(gm):
    """Per forward all-gather: how many backward nodes read its gathered buffer."""
    reads = []
    for ag in gm.graph.nodes:
        if ag.target is AG and phase_of(ag) == "forward":
            seen, stack = {ag}, [ag]
            while stack:
                for u in stack.pop().users:
                    if u not in seen and phase_of(u) == "forward" and str(u.target).split(".")[-2] in _CLOSURE:
                        seen.add(u)
                        stack.append(u)
            reads.append(sum(phase_of(u) == "backward" for n in seen for u in n.users))
    return reads


def _regathers(gm):
    return [n for n in gm.graph.nodes if n.target is AG and phase_of(n) == "backward"]


def test_regather_for_backward_bitwise_first_params_prefetch_and_no_fsdp(fsdp_step):
    traced, inputs, n_params = fsdp_step
    ref = run_no_grad(traced.gm, inputs)
    # first_params=10 reshards the embedding and layer 0 only; values unchanged
    gm = reshard_after_forward_pass(copy.deepcopy(traced.gm), None, prefetch=2, first_params=10)
    assert stats(gm)["fsdp_all_gathers"] == n_params and stats(gm)["resharded"] == len(_regathers(gm)) == 9
    read = [r > 0 for r in _backward_reads(gm)]
    assert len(read) == n_params and not any(read[:10]) and all(read[10:])
    assert_bitwise(run_no_grad(gm, inputs), ref)
    with pytest.raises(ValueError, match="first_params"):
        reshard_after_forward_pass(gm, None, first_params=-1)
    gm = reshard_after_forward_pass(copy.deepcopy(traced.gm), None, prefetch=0)
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for ag in _regathers(gm):  # prefetch 0: the re-gather is issued with its wait, right before the first use
        assert pos[next(iter(ag.users))] - pos[ag] <= 3
    with pytest.raises(ValueError, match="prefetch"):
        reshard_after_forward_pass(gm, None, prefetch=-1)
    gm = torch.fx.symbolic_trace(lambda x: (x.cos() + 1).sum())  # no FSDP: nothing to do
    before = [n.name for n in gm.graph.nodes]
    gm = reshard_after_forward_pass(gm)
    assert [n.name for n in gm.graph.nodes] == before and stats(gm)["resharded"] == 0
    gm = traced.gm  # as traced, the backward reads the forward's gathered parameters (kept alive all step)
    assert call_targets(gm).count(AG) == n_params and sum(_backward_reads(gm)) >= n_params - 1
    peak_traced, _ = estimate_peak_memory(gm)
    gm = reshard_after_forward_pass(gm, None, prefetch=2, cpu_async=True)
    # every parameter but the embedding (its backward needs no weight) is re-gathered
    assert stats(gm)["fsdp_all_gathers"] == n_params and stats(gm)["resharded"] == n_params - 1
    assert call_targets(gm).count(AG) == 2 * n_params - 1 and sum(_backward_reads(gm)) == 0
    assert all(n.meta["custom"]["reshard"] == "regather" for n in _regathers(gm))
    gm.graph.lint()
    gm = overlap_collectives_pass(gm, cpu_async=True)
    assert estimate_peak_memory(gm)[0] <= peak_traced * 1.01
    for _ in range(2):
        assert_bitwise(run_no_grad(gm, inputs), ref)
