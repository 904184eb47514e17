"""End-to-end trainer tests on CPU, in this process: aot_fx_trace vs eager, metrics.jsonl;
and run_train.sh's stderr filter. (Bad input, refused before start: tests/test_preflight.py;
several ranks: tests/test_parallel_layouts.py.)"""

import json
import os
import subprocess
import sys

import pytest

from graph_trainer.config import parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")
# Small and fast: 2 layers, short sequences.
TINY = ["--training.seq_len", "64", "--training.local_batch_size", "2"]


def _train(tmp_path, name, *flags):
    from graph_trainer.train import train

    out = tmp_path / name
    cfg = parse_args(["--job.config_file", DEBUG, "--job.dump_folder", str(out), *TINY, *flags])
    train(cfg)
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    return [r for r in rows if "summary" not in r], rows[-1]["summary"]


@pytest.mark.parametrize(
    "ac", [[], ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]],
    ids=["no_ac", "op_sac"],
)
def test_aot_fx_trace_matches_eager_bitwise(tmp_path, ac):
    """fp32, no compile passes: the traced graph computes exactly eager's losses (with
    op-level SAC too: eager recomputes, the traced graph after sac_recompute as well)."""
    steps = ["--training.steps", "4", *ac]
    eager, _ = _train(tmp_path, "eager", "--compile.mode", "eager", *steps)
    traced, summary = _train(
        tmp_path, "traced", "--compile.mode", "aot_fx_trace",
        "--compile.inductor_compilation", "none", *steps,
    )
    assert [r["loss"] for r in traced] == [r["loss"] for r in eager]
    assert [r["grad_norm"] for r in traced] == [r["grad_norm"] for r in eager]
    assert traced[-1]["loss"] < traced[0]["loss"]  # it learns
    assert summary["graph_nodes"] > 500 and summary["trace_time_s"] > 0


def test_metrics_jsonl_fields(tmp_path):
    rows, summary = _train(
        tmp_path, "m", "--compile.inductor_compilation", "none", "--training.steps", "3"
    )
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "step_time_s"):
            assert key in r
        assert r["mfu"] is None  # CPU: n/a, never a made-up number
        assert r["tps"] > 0 and r["memory_gib"] > 0 and r["lr"] >= 0
    assert summary["steady_steps"] == [2, 3]
    assert any(r["lr"] > 0 for r in rows)


def test_stderr_filter_drops_torchrun_report_after_worker_error():
    text = (
        "[rank0]:warming up\n"
        "torchrun: something before the error\n"
        "[rank0]:error: Loss is nan at step 3; stopping.\n"
        "Traceback (most recent call last):\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "[rank1]:still shown\n"
    )
    r = subprocess.run([sys.executable, "-m", "graph_trainer.stderr_filter"], input=text,
                       capture_output=True, text=True, timeout=60)
    assert r.stderr.splitlines() == [
        "[rank0]:warming up",
        "torchrun: something before the error",  # nothing is dropped before a worker error
        "[rank0]:error: Loss is nan at step 3; stopping.",
        "[rank1]:still shown",
    ]
    assert r.returncode == 3  # run_train.sh turns torchrun's failure into exit 2
