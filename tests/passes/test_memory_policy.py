"""The memory policy (graph_trainer/compiler/memory_policy.py): the choice for hand-built
estimates and budgets, its calibration against the measured peaks of docs/perf.md, and the
dry run's plan for the debug model on a fake 2-rank group."""

import os

import pytest
import torch.distributed as dist

from graph_trainer.compiler.memory_policy import (
    BUCKET_BLOCKS,
    CALIBRATION,
    GiB,
    Levers,
    choose_levers,
    predict_peak,
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


def _peak(save, keep, bucket, inductor="regional"):
    graph = int(EST[save] * GiB) + (keep + bucket) * int(BLOCK * GiB)
    return predict_peak(int(STATE * GiB), graph, inductor, save)


def test_a_large_budget_keeps_everything():
    calls = []
    p = _choose(1000, calls=calls)
    assert p.levers == Levers("all", N, BUCKET_BLOCKS) and p.fits
    assert calls == ["all"]  # searched from the top: one estimate
    assert p.predicted_peak_bytes == _peak("all", N, BUCKET_BLOCKS)
    assert "everything fits" in p.describe()


def test_a_small_budget_recomputes_and_reshards():
    lean = _peak("recompute", 0, BUCKET_BLOCKS)
    p = _choose(lean / GiB + 0.01)
    assert p.levers == Levers("recompute", 0, BUCKET_BLOCKS) and p.fits
    # below the leanest: the buckets go too, and the policy says it does not fit
    p = _choose(lean / GiB - 0.5)
    assert p.levers == Levers("recompute", 0, 0)
    assert p.fits == (p.predicted_peak_bytes <= p.budget_bytes)
    p = _choose(10)
    assert p.levers == Levers("recompute", 0, 0) and not p.fits and "exceeds the budget" in p.describe()


@pytest.mark.parametrize("keep", [0, 5, 31])
def test_a_middle_budget_keeps_matmuls_then_as_many_blocks_as_fit(keep):
    budget = _peak("matmuls", keep, BUCKET_BLOCKS) / GiB + 0.001
    p = _choose(budget)
    assert p.levers == Levers("matmuls", keep, BUCKET_BLOCKS)
    assert p.predicted_peak_bytes <= p.budget_bytes < _peak("matmuls", keep + 1, BUCKET_BLOCKS)
    assert f"with {keep + 1} kept blocks would not fit" in p.describe()
    # with every block kept but short of "all": matmuls, all blocks
    p = _choose(_peak("all", N, BUCKET_BLOCKS) / GiB - 0.01)
    assert p.levers == Levers("matmuls", N, BUCKET_BLOCKS)


def test_levers_set_by_the_user_stay():
    p = _choose(1000, fixed=Levers("recompute", 3, 0), fixed_fields={"save", "bucket_blocks"})
    assert p.levers == Levers("recompute", N, 0)
    p = _choose(_peak("matmuls", 4, BUCKET_BLOCKS) / GiB, fixed=Levers(keep_last_blocks=4),
                fixed_fields={"keep_last_blocks"})
    assert p.levers == Levers("matmuls", 4, BUCKET_BLOCKS)
    # no FSDP: nothing to keep or bucket; no SAC tags: nothing to recompute
    calls = []
    p = _choose(1000, has_fsdp=False, has_sac=False, calls=calls)
    assert p.levers == Levers("all", 0, 0) and calls == ["all"]


def test_the_choice_depends_on_the_calibration_of_the_inductor_mode():
    """Full-graph Inductor needs less than the graph estimate when nothing is recomputed
    (it recomputes cheap values inside its kernels): the same budget keeps more."""
    budget = _peak("matmuls", N, BUCKET_BLOCKS) / GiB
    assert _choose(budget).levers.save == "matmuls"
    assert _choose(budget, inductor="full").levers == Levers("all", N, BUCKET_BLOCKS)


#: Measured peaks (GiB, torch.cuda.max_memory_reserved) against the run's own estimate of the
#: GPU-traced graph (docs/perf.md, "Fast by default"): (inductor, save, state, graph estimate,
#: measured). Llama3 1B on one H100, op SAC; seq 4096 x 2 and 8192 x 2.
MEASURED = [
    ("regional", "recompute", 16.75, 18.22, 36.99),
    ("regional", "matmuls", 16.75, 20.84, 39.73),
    ("regional", "all", 16.75, 25.37, 44.14),
    ("regional", "recompute", 16.75, 34.13, 54.85),
    ("full", "recompute", 16.75, 18.22, 29.07),
    ("full", "matmuls", 16.75, 20.84, 32.51),
    ("full", "all", 16.75, 25.37, 33.22),
]


@pytest.mark.parametrize("inductor, save, state, est, measured", MEASURED)
def test_calibration_predicts_the_measured_peaks_within_5_percent(inductor, save, state, est, measured):
    predicted = predict_peak(int(state * GiB), int(est * GiB), inductor, save) / GiB
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_every_mode_and_save_level_is_calibrated():
    from graph_trainer.compiler.memory_policy import SAVE_LEVELS, calibration

    assert {(m, s) for m in ("regional", "full") for s in SAVE_LEVELS} == set(CALIBRATION)
    assert calibration("none", "all") == CALIBRATION[("regional", "all")]


def _dry_run(*flags):
    from graph_trainer.config import parse_args
    from graph_trainer.projection.dry_run import dry_run

    cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
                      "--training.seq_len", "64", "--activation_checkpoint.mode", "selective",
                      "--activation_checkpoint.selective_ac_option", "op", *flags])
    old = os.environ.get("NGPU")
    os.environ["NGPU"] = "2"
    try:
        return dry_run(cfg)
    finally:
        os.environ.pop("NGPU") if old is None else os.environ.__setitem__("NGPU", old)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_dry_run_plans_from_the_traced_graph():
    """Debug model, op SAC, FSDP2 on fake ranks: a large budget keeps everything, a tiny one
    recomputes and reshards, and the pipeline that runs is the chosen one."""
    big = _dry_run("--compile.memory_budget_gib", "64")
    (plan,) = big["memory_policies"]
    assert plan["levers"] == Levers("all", 6, BUCKET_BLOCKS).flags()
    assert "bucket_collectives" in big["graph_passes"]
    tiny = _dry_run("--compile.memory_budget_gib", "0.0001")
    (plan,) = tiny["memory_policies"]
    assert plan["levers"] == Levers("recompute", 0, 0).flags()
    assert "bucket_collectives" not in tiny["graph_passes"]
    # recompute and resharding: less memory than keeping everything
    assert tiny["peak_graph_bytes"] < big["peak_graph_bytes"]
    assert tiny["memory_policies"][0]["predicted_peak_gib"] < big["memory_policies"][0]["predicted_peak_gib"]
