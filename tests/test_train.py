"""End-to-end trainer tests on CPU: aot_fx_trace vs eager, metrics.jsonl; run_train.sh's stderr filter."""

import subprocess
import sys

import pytest

from _runs import train_debug as _train  # tests/ is on sys.path


@pytest.mark.parametrize(
    "ac", [[], ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]],
    ids=["no_ac", "op_sac"],
)
def test_aot_fx_trace_matches_eager_bitwise(tmp_path, ac):
    """fp32, no passes: traced == eager losses bitwise (with op-level SAC too)."""
    eager, _ = _train(tmp_path, "eager", "--compile.mode", "eager", "--training.steps", "4", *ac)
    traced, summary = _train(tmp_path, "traced", "--compile.mode", "aot_fx_trace",
                             "--compile.inductor_compilation", "none", "--training.steps", "4", *ac)
    assert [r["loss"] for r in traced] == [r["loss"] for r in eager]
    assert [r["grad_norm"] for r in traced] == [r["grad_norm"] for r in eager]
    assert traced[-1]["loss"] < traced[0]["loss"]  # it learns
    assert summary["graph_nodes"] > 500 and summary["trace_time_s"] > 0
    assert [r["step"] for r in traced] == [1, 2, 3, 4] and summary["steady_steps"] == [2, 3, 4]
    for r in traced:  # metrics.jsonl's fields
        assert {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "step_time_s"} <= set(r)
        assert r["mfu"] is None  # CPU: n/a, never a made-up number
        assert r["tps"] > 0 and r["memory_gib"] > 0 and r["lr"] >= 0
    assert any(r["lr"] > 0 for r in traced)


def test_stderr_filter_drops_torchrun_report_after_worker_error():
    text = ("[rank0]:warming up\ntorchrun: something before the error\n[rank0]:error: Loss is nan at step 3; "
            "stopping.\nTraceback (most recent call last):\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n[rank1]:still shown\n")
    r = subprocess.run([sys.executable, "-m", "graph_trainer.stderr_filter"], input=text,
                       capture_output=True, text=True, timeout=60)
    assert r.stderr.splitlines() == [
        "[rank0]:warming up",
        "torchrun: something before the error",  # nothing is dropped before a worker error
        "[rank0]:error: Loss is nan at step 3; stopping.",
        "[rank1]:still shown",
    ]
    assert r.returncode == 3  # run_train.sh turns torchrun's failure into exit 2


def test_a_logged_step_is_read_after_the_next_step_is_issued(tmp_path, monkeypatch):
    """With a log every step, the loop reads step N's loss once step N+1 is issued (the device is never left waiting
    for the host), except the first step and the last, read at once."""
    import graph_trainer.train as train_mod

    events, build = [], train_mod.build_train_step

    class Counted:
        def __init__(self, step_fn):
            self.step_fn = step_fn

        def __getattr__(self, name):
            return getattr(self.step_fn, name)

        def __call__(self, tokens, labels):
            events.append(f"issue{sum(e.startswith('issue') for e in events) + 1}")
            return self.step_fn(tokens, labels)

    monkeypatch.setattr(train_mod, "build_train_step", lambda *a, **k: Counted(build(*a, **k)))
    log_window = train_mod.MetricsLogger.log_window
    monkeypatch.setattr(train_mod.MetricsLogger, "log_window",
                        lambda self, w: (events.append(f"log{w.step}"), log_window(self, w))[1])
    rows, _ = _train(tmp_path, "eager", "--compile.mode", "eager", "--training.steps", "4", "--metrics.log_freq", "1")
    assert events == ["issue1", "log1", "issue2", "issue3", "log2", "issue4", "log3", "log4"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
