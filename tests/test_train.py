"""End-to-end trainer tests on CPU: aot_fx_trace vs eager, metrics.jsonl; run_train.sh's stderr filter."""

import subprocess
import sys

import pytest

from _runs import train_debug as _train  # tests/ is on sys.path


@pytest.mark.parametrize("ac", [[], ["--activation_checkpoint.mode", "selective",
                                       "--activation_checkpoint.selective_ac_option", "op"]], ids=["no_ac", "op_sac"])
def test_aot_fx_trace_matches_eager_bitwise(tmp_path, monkeypatch, ac):
    """fp32, the default passes without Inductor: traced == eager losses bitwise (with op-level SAC too). Logging
    every step, both loops read step N's loss once step N+1 is issued (the device never waits for the host), except
    the first and last, read at once."""
    import graph_trainer.train as train_mod

    events, build, log_window = [], train_mod.build_train_step, train_mod.MetricsLogger.log_window

    def counted(*a, **k):  # the step's class records its calls (the loop reads the step's other attributes)
        step = build(*a, **k)
        call = type(step).__call__
        monkeypatch.setattr(type(step), "__call__", lambda self, *args: (events.append("issue"), call(self, *args))[1])
        return step

    monkeypatch.setattr(train_mod, "build_train_step", counted)
    monkeypatch.setattr(train_mod.MetricsLogger, "log_window",
                        lambda self, w: (events.append(f"log{w.step}"), log_window(self, w))[1])
    eager, _ = _train(tmp_path, "eager", "--compile.mode", "eager", "--training.steps", "4", *ac)
    traced, summary = _train(tmp_path, "traced", "--compile.mode", "aot_fx_trace",
                             "--compile.inductor_compilation", "none", "--training.steps", "4", *ac)
    assert events == ["issue", "log1", "issue", "issue", "log2", "issue", "log3", "log4"] * 2  # eager, traced
    assert [(r["loss"], r["grad_norm"]) for r in traced] == [(r["loss"], r["grad_norm"]) for r in eager]
    assert traced[-1]["loss"] < traced[0]["loss"]  # it learns
    assert summary["graph_nodes"] > 500 and summary["trace_time_s"] > 0 and summary["steady_steps"] == [2, 3, 4]
    assert [r["step"] for r in traced] == [r["step"] for r in eager] == [1, 2, 3, 4]
    for r in traced:  # metrics.jsonl's fields
        assert {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "step_time_s"} <= set(r)
        assert r["mfu"] is None and r["tps"] > 0 and r["memory_gib"] > 0 and r["lr"] >= 0  # CPU: no made-up MFU
    assert any(r["lr"] > 0 for r in traced)


def test_stderr_filter_drops_torchrun_report_after_worker_error():
    """Nothing is dropped before a worker error; after it, torchrun's report goes and other ranks' lines stay."""
    text = ("[rank0]:warming up\ntorchrun: something before the error\n[rank0]:error: Loss is nan at step 3; "
            "stopping.\nTraceback (most recent call last):\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n[rank1]:still shown\n")
    r = subprocess.run([sys.executable, "-m", "graph_trainer.stderr_filter"], input=text,
                       capture_output=True, text=True, timeout=60)
    assert r.stderr.splitlines() == ["[rank0]:warming up", "torchrun: something before the error",
                                     "[rank0]:error: Loss is nan at step 3; stopping.", "[rank1]:still shown"]
    assert r.returncode == 3  # run_train.sh turns torchrun's failure into exit 2
