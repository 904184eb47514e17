"""isolate_rmsnorm + full_inductor: one fusion group per norm, cross-group fusions refused, cache keys differ."""

import pytest

from graph_trainer.compiler.matching import find_rmsnorm_instances
from graph_trainer.compiler.node_meta import STATS_KEY, fusion_group_of
from graph_trainer.compiler.pipeline import build_pipeline, run_pipeline
from graph_trainer.config import Compile

from .conftest import assert_close, trace_step


def test_each_norm_is_its_own_group(tiny_llama):
    gm, example_inputs, _ = trace_step(tiny_llama(2))
    steps = build_pipeline(Compile(inductor_compilation="full", numerics_changing_optim=True, passes="isolate_rmsnorm"))
    for step in steps[:-1]:
        gm = step(gm, example_inputs)
    instances = find_rmsnorm_instances(gm.graph)  # 2 norms per block + final, fwd + bwd
    groups = [{fusion_group_of(n) for n in inst["nodes"]} for inst in instances]
    assert len(instances) == 10 and all(len(g) == 1 for g in groups) and len(set.union(*groups)) == len(instances)
    assert {n for n in gm.graph.nodes if fusion_group_of(n)} == {n for inst in instances for n in inst["nodes"]}


@pytest.mark.slow
def test_fusions_across_groups_are_refused(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = tiny_llama(1)
    stats = {}
    for isolate in (False, True):  # plain first: its cache entry must not serve the isolated compile
        gm, example_inputs, inputs = trace_step(model)
        ref = gm(*inputs)
        *steps, full = build_pipeline(Compile(inductor_compilation="full", numerics_changing_optim=isolate,
                                              passes="isolate_rmsnorm" if isolate else ""))
        cgm = full(run_pipeline(gm, example_inputs, steps), example_inputs)
        assert_close(cgm(*inputs), ref)
        stats[isolate] = cgm.meta[STATS_KEY]
    assert stats[False]["fusion_groups"] == stats[False]["fusions_refused"] == 0
    assert stats[True]["fusion_groups"] == 6 and stats[True]["fusions_refused"] > 0
    assert stats[True]["boundary_values_realized"] > 0
