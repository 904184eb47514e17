"""The memory policy: choices for hand-built estimates, calibration, the dry run's plan."""

import dataclasses

import pytest
import torch

from _runs import dry_run_in_process  # tests/ is on sys.path
from graph_trainer.compiler.memory_policy import (
    BUCKET_BLOCKS, CALIBRATION, CALIBRATION_PEERS, CUDAGRAPH_GIB, SAVE_LEVELS, GiB, Levers, calibration, choose_levers,
    predict_peak)
from graph_trainer.compiler.pipeline import build_pipeline, configured_levers
from graph_trainer.config import Compile
from graph_trainer.llama3 import llama3_args
from graph_trainer.step import may_replay_as_cuda_graph

#: An 8B-like graph (GiB): estimates per save level without kept blocks, a block's weights, blocks, shards + AdamW.
EST = {"recompute": 26.6, "matmuls": 36.1, "all_but_cheap": 50.0, "all": 69.1}
ABC, BLOCK, N, STATE = "all_but_cheap", 0.41, 32, 44.9


def _choose(budget_gib, inductor="regional", calls=None, **kw):
    def estimate(save):
        if calls is not None:
            calls.append(save)
        return int(EST[save] * GiB)

    return choose_levers(estimate, n_blocks=N, block_bytes=int(BLOCK * GiB), state=int(STATE * GiB),
                         budget=int(budget_gib * GiB), inductor=inductor, **kw)


def _peak(save, keep, bucket=BUCKET_BLOCKS, inductor="regional"):
    return predict_peak(int(STATE * GiB), int(EST[save] * GiB) + (keep + bucket) * int(BLOCK * GiB), inductor, save)


def test_large_and_small_budgets_user_levers_and_the_inductor_mode():
    calls = []
    p = _choose(1000, calls=calls)
    assert p.levers == Levers(ABC, N, BUCKET_BLOCKS) and p.fits and calls == [ABC]  # from the top: one estimate
    assert p.predicted_peak_bytes == _peak(ABC, N) and "everything fits" in p.describe()
    assert _choose(1000, inductor="full").levers == Levers("all", N, BUCKET_BLOCKS)  # "all" only under full
    lean = _peak("recompute", 0)
    p = _choose(lean / GiB + 0.01)
    assert p.levers == Levers("recompute", 0, BUCKET_BLOCKS) and p.fits
    p = _choose(lean / GiB - 0.5)  # below the leanest: the buckets go too
    assert p.levers == Levers("recompute", 0, 0) and p.fits == (p.predicted_peak_bytes <= p.budget_bytes)
    p = _choose(10)
    assert p.levers == Levers("recompute", 0, 0) and not p.fits and "exceeds the budget" in p.describe()
    p = _choose(1000, fixed=Levers("recompute", 3, 0), fixed_fields={"save", "bucket_blocks"})
    assert p.levers == Levers("recompute", N, 0)
    p = _choose(_peak("matmuls", 4) / GiB, fixed=Levers(keep_last_blocks=4), fixed_fields={"keep_last_blocks"})
    assert p.levers == Levers("matmuls", 4, BUCKET_BLOCKS)
    calls = []  # no FSDP: nothing to keep or bucket; no SAC tags: nothing to recompute
    p = _choose(1000, has_fsdp=False, has_sac=False, calls=calls)
    assert p.levers == Levers("all", 0, 0) and calls == ["all"]
    # each Inductor mode has its calibration (full's estimate is the fused one: plan_pipeline)
    assert {(m, s) for m in ("regional", "full") for s in SAVE_LEVELS} == set(CALIBRATION)
    assert calibration("none", "all") == CALIBRATION[("regional", "all")] == calibration("none", "all", peers=True)
    assert all(calibration(*k, peers=True) == v < CALIBRATION[k] for k, v in CALIBRATION_PEERS.items())  # NCCL
    assert _choose(1000, inductor="full").predicted_peak_bytes == _peak("all", N, inductor="full")


@pytest.mark.parametrize("keep", [0, 5, 31])
def test_a_middle_budget_keeps_matmuls_then_as_many_blocks_as_fit(keep):
    p = _choose(_peak("matmuls", keep) / GiB + 0.001)
    assert p.levers == Levers("matmuls", keep, BUCKET_BLOCKS)
    assert p.predicted_peak_bytes <= p.budget_bytes < _peak("matmuls", keep + 1)
    assert f"with {keep + 1} kept blocks would not fit" in p.describe()
    assert _choose(_peak(ABC, 0) / GiB - 0.01).levers == Levers("matmuls", N, BUCKET_BLOCKS)  # short of ABC
    p = _choose(_peak(ABC, keep) / GiB + 0.001)  # then all but the cheap values, as many blocks as fit
    assert p.levers == Levers(ABC, keep, BUCKET_BLOCKS) and p.budget_bytes < _peak(ABC, keep + 1)


@pytest.mark.parametrize("inductor, save, cudagraph, state, est, measured, peers", [(*r, False) for r in [
    # measured peaks (GiB, max_memory_reserved) vs the GPU-traced graph's estimate (full Inductor: the fused one),
    # one H100 (docs/perf_archive.md, "Memory prediction"). Llama3 1B, op SAC; seq 4096 x 2 and 8192 x 2:
    ("regional", "recompute", False, 16.75, 18.22, 36.99), ("regional", "matmuls", False, 16.75, 20.84, 39.73),
    ("regional", "all", False, 16.75, 25.37, 44.14), ("regional", "recompute", False, 16.75, 34.13, 54.85),
    ("full", "recompute", False, 16.75, 8.45, 29.07), ("full", "matmuls", False, 16.75, 11.08, 32.51),
    ("full", "all", False, 16.75, 14.08, 33.22), ("regional", "all", True, 16.75, 25.37, 44.19),
    # rank 0 of the seed layout (8B FSDP4xTP2, fake_collectives), the policy's plan:
    ("regional", "all", False, 11.22, 35.39, 48.93), ("regional", "all", True, 11.22, 35.39, 51.06),
    ("regional", "all_but_cheap", True, 11.22, 24.39, 40.26), ("full", "all", False, 11.22, 29.93, 44.91),
]] + [(*r, True) for r in [  # the 8B with NCCL on H200s, the policy's plan: FSDP2, TP2, FSDP2xTP2 (records 1355,
    # 1701, 1342, 1734): plain, then full Inductor
    ("regional", ABC, False, 44.88, 48.71, 97.52), ("regional", ABC, False, 44.88, 24.47, 69.55),
    ("regional", ABC, False, 22.44, 24.38, 47.93), ("full", "all", False, 44.88, 52.30, 103.53),
    ("full", "all", False, 44.88, 30.01, 74.28), ("full", "all", False, 22.44, 29.93, 54.59),
]])
def test_calibration_predicts_the_measured_peaks_within_5_percent(inductor, save, cudagraph, state, est, measured,
                                                                   peers):
    predicted = predict_peak(int(state * GiB), int(est * GiB), inductor, save, cudagraph, peers) / GiB
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_cuda_graphs_come_first_go_when_nothing_fits_and_are_named_by_the_config():
    p = _choose(1000, cudagraph=True)
    assert p.levers == Levers(ABC, N, BUCKET_BLOCKS, True) and "CUDA graphs fit" in p.describe()
    assert p.predicted_peak_bytes == _peak(ABC, N) + CUDAGRAPH_GIB * GiB
    assert "--compile.passes cudagraph" in p.levers.flags()
    # the budget of the top rung without the graph: the graph stays, the ladder steps down
    p = _choose(_peak(ABC, N) / GiB, cudagraph=True)
    assert p.levers.cudagraph and p.levers.save == ABC and p.levers.keep_last_blocks < N and p.fits
    # room for the leanest rung but not for the graph on top: the graph goes
    p = _choose(_peak("recompute", 0) / GiB + CUDAGRAPH_GIB / 2, cudagraph=True)
    assert p.levers == Levers("recompute", 0, BUCKET_BLOCKS, False) and p.fits and "no CUDA graphs" in p.describe()
    # named by the user: kept either way, counted in the prediction, no reason given
    p = _choose(1000, cudagraph=True, fixed=Levers(cudagraph=False), fixed_fields={"cudagraph"})
    assert not p.levers.cudagraph and "CUDA graph" not in p.describe()
    p = _choose(1000, fixed=Levers(cudagraph=True), fixed_fields={"cudagraph"})
    assert p.levers.cudagraph and p.predicted_peak_bytes == _peak(ABC, N) + CUDAGRAPH_GIB * GiB
    assert "cudagraph" not in configured_levers(Compile())[1]  # named by the config
    for config, on in ((Compile(passes="cudagraph"), True), (Compile(disable_passes="cudagraph"), False)):
        levers, named = configured_levers(config)
        assert levers.cudagraph is on and "cudagraph" in named
    assert "cudagraph" not in [s.name for s in build_pipeline(Compile())]
    assert [s.name for s in build_pipeline(Compile(), levers=Levers("all", cudagraph=True))][-1] == "cudagraph"


@pytest.mark.parametrize("device, world, comm_mode, record_dir, allowed", [
    ("cuda:0", 1, "default", None, True), ("cuda:0", 8, "fake_collectives", None, True),  # rank 0 of 8, alone
    ("cuda:0", 2, "default", None, False), ("cpu", 1, "default", None, False),  # world 2: real NCCL peers
    ("cuda:0", 1, "default", "/tmp/numerics", False),  # step 1 records op outputs
])
def test_cuda_graphs_only_for_one_process_on_a_gpu(device, world, comm_mode, record_dir, allowed):
    assert may_replay_as_cuda_graph(torch.device(device), world, comm_mode, record_dir) == allowed


def test_dry_run_plans_from_the_traced_graph(monkeypatch):
    """Debug model (2 blocks), op SAC, FSDP2 on fake ranks: a large budget keeps, a tiny one recomputes."""
    blocks = 2
    monkeypatch.setitem(llama3_args, "debugmodel", dataclasses.replace(llama3_args["debugmodel"], n_layers=blocks))
    big, tiny = (dry_run_in_process(2, "--training.seq_len", "64", "--activation_checkpoint.mode", "selective",
                                    "--activation_checkpoint.selective_ac_option", "op", "--compile.memory_budget_gib",
                                    budget) for budget in ("64", "0.0001"))
    assert [p["levers"] for p in big["memory_policies"]] == [Levers("all_but_cheap", blocks, BUCKET_BLOCKS).flags()]
    assert [p["levers"] for p in tiny["memory_policies"]] == [Levers("recompute", 0, 0).flags()]
    assert "bucket_collectives" in big["graph_passes"] and "bucket_collectives" not in tiny["graph_passes"]
    assert tiny["peak_graph_bytes"] < big["peak_graph_bytes"]  # recompute and resharding: less memory
    assert tiny["memory_policies"][0]["predicted_peak_gib"] < big["memory_policies"][0]["predicted_peak_gib"]
