"""cudagraph_pass: CUDA only."""

from unittest import mock

import pytest
import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from graph_trainer.compiler.passes.cudagraph import (
    CUDAGraphWrapper, cudagraph_pass, generated_forward, release_cuda_graphs)

from .conftest import fused_norm_graph


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA available")
def test_cudagraph_pass_requires_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cudagraph_pass(*fused_norm_graph(n_norms=1))


def test_the_wrapper_gets_the_generated_forward_of_a_lazy_graph_module():
    gm = _LazyGraphModule.from_graphmodule(torch.fx.symbolic_trace(lambda x: x + 1))
    gm.recompile()  # what every pass does: the code is stale until the first call
    calls = []
    fn = generated_forward(gm)

    def wrapper(*args):
        calls.append(1)
        assert len(calls) == 1, "the wrapper was re-entered"
        return fn(*args)

    gm.forward = wrapper
    assert gm(torch.ones(2)).tolist() == [2.0, 2.0] and calls == [1]


def test_release_resets_every_captured_graph_once(monkeypatch):
    """Before destroy_process_group: a graph that captured NCCL collectives must be gone (module docstring)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    captured, fresh = CUDAGraphWrapper(lambda: None), CUDAGraphWrapper(lambda: None)
    captured.graph = graph = mock.Mock()
    assert release_cuda_graphs() == 1 and graph.reset.call_count == 1 and captured.graph is None and fresh.graph is None
    assert release_cuda_graphs() == 0 and graph.reset.call_count == 1
