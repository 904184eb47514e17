"""cudagraph_pass: CUDA only."""

import pytest
import torch

from graph_trainer.compiler.passes.cudagraph import cudagraph_pass

from .conftest import fused_norm_graph


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA available")
def test_cudagraph_pass_requires_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cudagraph_pass(*fused_norm_graph(n_norms=1))
