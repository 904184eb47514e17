"""cudagraph_pass: CUDA only."""

import pytest
import torch

from graph_trainer.compiler.passes.cudagraph import cudagraph_pass

from .conftest import fused_norm_graph


def test_cudagraph_pass_requires_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA available")
    gm, fakes = fused_norm_graph(n_norms=1)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cudagraph_pass(gm, fakes)
