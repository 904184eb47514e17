"""cudagraph_pass: CUDA only."""

import pytest
import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from graph_trainer.compiler.passes.cudagraph import cudagraph_pass, generated_forward

from .conftest import fused_norm_graph


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA available")
def test_cudagraph_pass_requires_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cudagraph_pass(*fused_norm_graph(n_norms=1))


def test_the_wrapper_gets_the_generated_forward_of_a_lazy_graph_module():
    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    gm = _LazyGraphModule.from_graphmodule(torch.fx.symbolic_trace(AddOne()))
    gm.recompile()  # what every pass does: the code is stale until the first call
    calls = []
    fn = generated_forward(gm)

    def wrapper(*args):
        calls.append(1)
        assert len(calls) == 1, "the wrapper was re-entered"
        return fn(*args)

    gm.forward = wrapper
    assert gm(torch.ones(2)).tolist() == [2.0, 2.0] and calls == [1]
