"""full_inductor_pass end to end on CPU through the pipeline (with collectives: test_pin_collectives.py)."""

import torch
from torch._inductor.compile_fx import compile_fx
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.config import Compile
from graph_trainer.compiler.passes.full_inductor import inductor_phases, move_cpu_scalars
from graph_trainer.compiler.pipeline import build_pipeline, run_pipeline

from .conftest import assert_close, trace_step


def test_end_to_end_full_inductor_cpu(tiny_llama):
    gm, example_inputs, inputs = trace_step(tiny_llama(1))
    ref = gm(*inputs)
    steps = build_pipeline(Compile(inductor_compilation="full"))
    assert steps[-1].name == "full_inductor"
    cgm = run_pipeline(gm, example_inputs, steps)
    assert isinstance(cgm, torch.fx.GraphModule) and callable(cgm.compiled_fn)
    assert isinstance(out := cgm(*inputs), tuple)  # same pytree calling convention as the traced graph
    assert_close(out, ref)  # and as many outputs


def test_cpu_scalars_move_to_the_inputs_device():
    """CPU ``0`` scalars of ``index_put_`` move to the inputs' device; a CPU graph stays."""
    def f(x, mask):
        y = x.index_put((mask,), torch.tensor(0))
        return y.index_put((~mask,), torch.scalar_tensor(7, dtype=torch.int64, device="cpu"))

    x, mask = torch.arange(6), torch.tensor([True, False] * 3)
    gm = make_fx(f)(x, mask)
    assert move_cpu_scalars(gm, torch.device("cpu")) == 0 and move_cpu_scalars(gm, None) == 0
    meta_gm = make_fx(f, tracing_mode="fake")(x.to("meta"), mask.to("meta"))
    cpu_scalars = [n for n in meta_gm.graph.nodes if getattr(n.meta.get("val"), "device", None) == torch.device("cpu")]
    assert len(cpu_scalars) == 3, meta_gm.graph  # the constant, its lift_fresh_copy, scalar_tensor
    assert move_cpu_scalars(meta_gm, torch.device("meta")) == 3
    assert all(n.meta["val"].device.type == "meta" for n in cpu_scalars)
    out = meta_gm(x.to("meta"), mask.to("meta"))
    assert out.device.type == "meta" and out.shape == x.shape and gm(x, mask).tolist() == [0, 7, 0, 7, 0, 7]


def test_inductor_phases_count_the_compiles_inside_only():
    gm = torch.fx.symbolic_trace(lambda x: (torch.relu(x) * 2).sum(0))
    with torch._inductor.config.patch(fx_graph_cache=False):
        with inductor_phases() as phases:
            compile_fx(gm, [torch.randn(8, 8)])
        with inductor_phases() as nothing:
            pass
    assert {"AOT metadata", "lowering", "fusion", "codegen"} <= set(phases) and all(v >= 0 for v in phases.values())
    assert nothing == {}
