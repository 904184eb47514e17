"""No record is lost: resumes append to metrics.jsonl, fresh runs move it aside."""

import os

import torch

from graph_trainer.metrics import MetricsLogger, keep_previous, read_metrics


def _logger(dump, resume_step=0, **kw):
    return MetricsLogger(torch.device("cpu"), 1000, dump_folder=str(dump), resume_step=resume_step, **kw)


def _run(dump, steps, loss, resume_step=0, summary=None, **kw):
    """A run: ``steps`` logged at loss ``loss + step``, then a summary with the fields ``summary`` if given."""
    m = _logger(dump, resume_step, **kw)
    for s in steps:
        m.record_step(128, 0.0)
        m.log_window(m.close_window(s, loss + s, 1.0, 1e-3))
    if summary is not None:
        m.summary(exclude_steps=1, extra=summary)
    m.close()


def test_keep_previous_files_and_folders(tmp_path):
    assert keep_previous(str(f := tmp_path / "metrics.jsonl")) is None  # nothing there: nothing done
    f.write_text("first")
    assert keep_previous(str(f)) == str(tmp_path / "metrics.1.jsonl")
    assert not f.exists() and (tmp_path / "metrics.1.jsonl").read_text() == "first"
    f.write_text("second")
    (tmp_path / "metrics.7.jsonl").write_text("seven")  # never overwritten; a larger N is later
    assert keep_previous(str(f)) == str(tmp_path / "metrics.8.jsonl")
    assert [(tmp_path / f"metrics.{n}.jsonl").read_text() for n in (1, 7, 8)] == ["first", "seven", "second"]
    g = tmp_path / "graphs"
    (g / "sub").mkdir(parents=True)
    (g / "00_input.py").write_text("x")
    assert keep_previous(str(g) + "/") == str(tmp_path / "graphs.1")
    assert (tmp_path / "graphs.1" / "00_input.py").read_text() == "x" and (tmp_path / "graphs.1" / "sub").is_dir()
    g.mkdir()
    assert keep_previous(str(g)) == str(tmp_path / "graphs.2") and not g.exists()


def test_resume_appends_and_reader_takes_the_last_row_per_step(tmp_path):
    _run(tmp_path, [1, 2, 3], loss=10.0, summary={})
    before = (tmp_path / "metrics.jsonl").read_text()
    _logger(tmp_path).close()  # a fresh run and a resumed one that stop before logging anything
    _logger(tmp_path, resume_step=3).close()
    assert os.listdir(tmp_path) == ["metrics.jsonl"] and (tmp_path / "metrics.jsonl").read_text() == before
    _run(tmp_path, [3, 4], loss=20.0, resume_step=2, summary={"resumed_from_step": 2})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.startswith(before) and len(text.splitlines()) == 4 + 3  # appended, nothing rewritten
    rows, summary = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["loss"] for r in rows] == [11.0, 12.0, 23.0, 24.0]
    assert summary["resumed_from_step"] == 2 and not (tmp_path / "metrics.1.jsonl").exists()


def test_fresh_runs_keep_earlier_records(tmp_path, log_lines):
    for i in range(3):
        _run(tmp_path, [1, 2], loss=float(i), enable_tensorboard=True, tb_folder="tb")
    for name, first in (("metrics.1.jsonl", 1.0), ("metrics.2.jsonl", 2.0), ("metrics.jsonl", 3.0)):
        assert [r["loss"] for r in read_metrics(str(tmp_path / name))[0]] == [first, first + 1]
    assert not (tmp_path / "metrics.3.jsonl").exists()
    for tb in ("tb", "tb.1", "tb.2"):
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / tb)), tb
    kept = [line for line in log_lines if "is kept as" in line]
    assert len(kept) == 4 and f"{tmp_path / 'metrics.jsonl'} is kept as {tmp_path / 'metrics.2.jsonl'}" in kept[-2]


def test_a_closed_window_keeps_its_values_and_steps(tmp_path):
    """close_window copies loss and grad norm (a CUDA graph's output buffer) and counts only the steps before it."""
    m = _logger(tmp_path)
    loss, grad_norm = torch.tensor(2.5), torch.tensor(0.75)
    for _ in range(2):
        m.record_step(128, 0.5)
    window = m.close_window(2, loss, grad_norm, 1e-3)
    loss.fill_(9.0)  # the next step's value in the same buffer
    m.record_step(64, 0.0)  # the next step, issued before the window is logged
    row = m.log_window(window)
    assert (row.step, row.loss, row.grad_norm, row.lr, row.data_time_s) == (2, 2.5, 0.75, 1e-3, 0.5)
    assert row.tps == 256 / (2 * row.step_time_s)
    nxt = m.log_window(m.close_window(3, loss, grad_norm))
    assert (nxt.loss, nxt.tps) == (9.0, 64 / nxt.step_time_s)
    m.close()
