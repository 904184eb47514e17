"""full_inductor_pass end to end on CPU (Inductor's C++ backend), through the pipeline.
(With collectives: test_pin_collectives.py.)"""

import torch

from graph_trainer.config import Compile
from graph_trainer.passes import build_pipeline, run_pipeline

from .conftest import assert_close, trace_step


def test_end_to_end_full_inductor_cpu(tiny_llama):
    model = tiny_llama(1)
    gm, example_inputs, inputs = trace_step(model)
    ref = gm(*inputs)
    steps = build_pipeline(Compile(inductor_compilation="full"))
    assert [s.name for s in steps] == [
        "remove_dead_code", "remove_noop_views", "sac_recompute", "reshard_after_forward", "overlap_collectives",
        "full_inductor",
    ]
    cgm = run_pipeline(gm, example_inputs, steps)
    assert isinstance(cgm, torch.fx.GraphModule) and callable(cgm.compiled_fn)
    out = cgm(*inputs)  # same pytree calling convention as the traced graph
    assert isinstance(out, tuple) and len(out) == len(ref)
    assert_close(out, ref)
