"""annotate_residual_rmsnorm: norm regions take in their residual adds; the compiled step stays close."""

from collections import Counter

from graph_trainer.compiler.pipeline import build_pipeline, run_pipeline
from graph_trainer.config import Compile

from .conftest import aten, assert_close, by_region, inductor_tag, trace_step

NAME = "annotate_residual_rmsnorm_for_regional_inductor"
CONFIG = Compile(numerics_changing_optim=True, passes="residual_rmsnorm")


def test_residual_adds_join_the_norm_regions(tiny_llama):
    n_layers = 2
    gm, example_inputs, _ = trace_step(tiny_llama(n_layers))
    steps = [s for s in build_pipeline(CONFIG) if s.name != "regional_inductor"]
    names = [s.name for s in steps]
    assert names.index(NAME) == names.index("annotate_rmsnorm_for_regional_inductor") + 1
    for step in steps:
        if step.name == NAME:
            regions_before = set(by_region(gm))
        gm = step(gm, example_inputs)
    assert set(by_region(gm)) == regions_before  # no new region, only bigger ones
    adds = [n for n in gm.graph.nodes if n.target is aten.add.Tensor and inductor_tag(n)]
    joined = Counter(inductor_tag(n)["inductor_region"].split("_")[1] for n in adds)
    for n in adds:  # the add feeds (forward) or is fed by (backward) a node of its own region
        region = inductor_tag(n)["inductor_region"]
        assert any((inductor_tag(m) or {}).get("inductor_region") == region for m in (*n.users, *n.all_input_nodes)), n
    # 2 norms per block + the final norm; all but the first block's attention norm read a residual add
    assert joined.get("forward") == 2 * n_layers and joined.get("backward", 0) >= 2 * n_layers - 1


def test_compiled_step_matches(tiny_llama, log_lines):
    """(That the pass needs --compile.numerics_changing_optim: tests/test_pipeline.py.)"""
    gm, example_inputs, inputs = trace_step(tiny_llama(1))
    ref = gm(*inputs)
    cgm = run_pipeline(gm, example_inputs, build_pipeline(CONFIG))
    assert any("joined 2 forward" in m for m in log_lines)
    assert_close(cgm(*inputs), ref)
