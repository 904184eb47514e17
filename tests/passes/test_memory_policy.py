"""The memory policy (graph_trainer/compiler/memory_policy.py): the choice for hand-built
estimates and budgets, its calibration against measured peaks, and the dry run's plan for the
debug model on a fake 2-rank group."""

import os

import pytest
import torch.distributed as dist

from graph_trainer.compiler.memory_policy import (
    BUCKET_BLOCKS, CALIBRATION, SAVE_LEVELS, GiB, Levers, calibration, choose_levers, predict_peak,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: A hand-built 8B-like graph: estimates per save level with no kept block (GiB), one block's
#: gathered weights, 32 blocks, fp32 shards + AdamW state.
EST = {"recompute": 26.6, "matmuls": 36.1, "all": 69.1}
BLOCK, N, STATE = 0.41, 32, 44.9


def _choose(budget_gib, inductor="regional", calls=None, **kw):
    def estimate(save):
        if calls is not None:
            calls.append(save)
        return int(EST[save] * GiB)

    return choose_levers(estimate, n_blocks=N, block_bytes=int(BLOCK * GiB), state=int(STATE * GiB),
                         budget=int(budget_gib * GiB), inductor=inductor, **kw)


def _peak(save, keep, bucket=BUCKET_BLOCKS, inductor="regional"):
    return predict_peak(int(STATE * GiB), int(EST[save] * GiB) + (keep + bucket) * int(BLOCK * GiB), inductor, save)


def test_large_and_small_budgets():
    calls = []
    p = _choose(1000, calls=calls)
    assert p.levers == Levers("all", N, BUCKET_BLOCKS) and p.fits and calls == ["all"]  # from the top: one estimate
    assert p.predicted_peak_bytes == _peak("all", N) and "everything fits" in p.describe()
    lean = _peak("recompute", 0)
    p = _choose(lean / GiB + 0.01)
    assert p.levers == Levers("recompute", 0, BUCKET_BLOCKS) and p.fits
    p = _choose(lean / GiB - 0.5)  # below the leanest: the buckets go too
    assert p.levers == Levers("recompute", 0, 0) and p.fits == (p.predicted_peak_bytes <= p.budget_bytes)
    p = _choose(10)
    assert p.levers == Levers("recompute", 0, 0) and not p.fits and "exceeds the budget" in p.describe()


@pytest.mark.parametrize("keep", [0, 5, 31])
def test_a_middle_budget_keeps_matmuls_then_as_many_blocks_as_fit(keep):
    p = _choose(_peak("matmuls", keep) / GiB + 0.001)
    assert p.levers == Levers("matmuls", keep, BUCKET_BLOCKS)
    assert p.predicted_peak_bytes <= p.budget_bytes < _peak("matmuls", keep + 1)
    assert f"with {keep + 1} kept blocks would not fit" in p.describe()
    assert _choose(_peak("all", N) / GiB - 0.01).levers == Levers("matmuls", N, BUCKET_BLOCKS)  # short of "all"


def test_user_levers_stay_and_the_inductor_mode_counts():
    p = _choose(1000, fixed=Levers("recompute", 3, 0), fixed_fields={"save", "bucket_blocks"})
    assert p.levers == Levers("recompute", N, 0)
    p = _choose(_peak("matmuls", 4) / GiB, fixed=Levers(keep_last_blocks=4), fixed_fields={"keep_last_blocks"})
    assert p.levers == Levers("matmuls", 4, BUCKET_BLOCKS)
    calls = []  # no FSDP: nothing to keep or bucket; no SAC tags: nothing to recompute
    p = _choose(1000, has_fsdp=False, has_sac=False, calls=calls)
    assert p.levers == Levers("all", 0, 0) and calls == ["all"]
    # full-graph Inductor needs less than the graph estimate: the same budget keeps more
    assert {(m, s) for m in ("regional", "full") for s in SAVE_LEVELS} == set(CALIBRATION)
    assert calibration("none", "all") == CALIBRATION[("regional", "all")]
    budget = _peak("matmuls", N) / GiB
    assert _choose(budget).levers.save == "matmuls"
    assert _choose(budget, inductor="full").levers == Levers("all", N, BUCKET_BLOCKS)


@pytest.mark.parametrize("inductor, save, state, est, measured", [
    # measured peaks (GiB, max_memory_reserved) against the run's estimate of the GPU-traced
    # graph: Llama3 1B on one H100, op SAC; seq 4096 x 2 and 8192 x 2 (docs/perf.md)
    ("regional", "recompute", 16.75, 18.22, 36.99),
    ("regional", "matmuls", 16.75, 20.84, 39.73),
    ("regional", "all", 16.75, 25.37, 44.14),
    ("regional", "recompute", 16.75, 34.13, 54.85),
    ("full", "recompute", 16.75, 18.22, 29.07),
    ("full", "matmuls", 16.75, 20.84, 32.51),
    ("full", "all", 16.75, 25.37, 33.22),
])
def test_calibration_predicts_the_measured_peaks_within_5_percent(inductor, save, state, est, measured):
    predicted = predict_peak(int(state * GiB), int(est * GiB), inductor, save) / GiB
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_dry_run_plans_from_the_traced_graph(monkeypatch):
    """Debug model, op SAC, FSDP2 on fake ranks: a large budget keeps everything, a tiny one
    recomputes and reshards, and the pipeline that runs is the chosen one."""
    from graph_trainer.config import parse_args
    from graph_trainer.projection.dry_run import dry_run

    monkeypatch.setenv("NGPU", "2")

    def run(budget):
        cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
                          "--training.seq_len", "64", "--activation_checkpoint.mode", "selective",
                          "--activation_checkpoint.selective_ac_option", "op", "--compile.memory_budget_gib", budget])
        try:
            return dry_run(cfg)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    big, tiny = run("64"), run("0.0001")
    assert [p["levers"] for p in big["memory_policies"]] == [Levers("all", 6, BUCKET_BLOCKS).flags()]
    assert [p["levers"] for p in tiny["memory_policies"]] == [Levers("recompute", 0, 0).flags()]
    assert "bucket_collectives" in big["graph_passes"] and "bucket_collectives" not in tiny["graph_passes"]
    assert tiny["peak_graph_bytes"] < big["peak_graph_bytes"]  # recompute and resharding: less memory
    assert tiny["memory_policies"][0]["predicted_peak_gib"] < big["memory_policies"][0]["predicted_peak_gib"]
