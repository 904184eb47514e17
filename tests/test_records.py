"""No record is lost: a resumed run appends to metrics.jsonl, a fresh run into a used
dump folder first moves the earlier records aside (:func:`graph_trainer.metrics.keep_previous`),
and a run that stops before its first step changes nothing on disk.

The runs are the trainer's entry point forked from tests/_launch.py's server; the first
run of the crash test is a copy of the ``finished_run`` fixture (tests/conftest.py)."""

import logging
import os
import shutil

import pytest
import torch

from graph_trainer.metrics import MetricsLogger, keep_previous, read_metrics

from _runs import FINISHED, run_debug  # tests/ is on sys.path

SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--compile.inductor_compilation", "none"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]


def _train(dump, *flags, steps=4):
    return run_debug(dump, SMALL, *flags, steps=steps, forked=True)


def _logger(dump, resume_step=0, **kw):
    return MetricsLogger(torch.device("cpu"), 1000, dump_folder=str(dump), resume_step=resume_step, **kw)


def _log(m, steps, loss):
    for s in steps:
        m.record_step(128, 0.0)
        m.log(s, loss + s, 1.0, 1e-3)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    h, log = _Lines(), logging.getLogger("graph_trainer")
    level = log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    yield h.lines
    log.removeHandler(h)
    log.setLevel(level)


def test_keep_previous_files_and_folders(tmp_path):
    f = tmp_path / "metrics.jsonl"
    assert keep_previous(str(f)) is None  # nothing there: nothing done
    f.write_text("first")
    assert keep_previous(str(f)) == str(tmp_path / "metrics.1.jsonl")
    assert not f.exists() and (tmp_path / "metrics.1.jsonl").read_text() == "first"
    f.write_text("second")
    (tmp_path / "metrics.7.jsonl").write_text("seven")  # never overwritten; a larger N is later
    assert keep_previous(str(f)) == str(tmp_path / "metrics.8.jsonl")
    assert (tmp_path / "metrics.8.jsonl").read_text() == "second"
    assert (tmp_path / "metrics.7.jsonl").read_text() == "seven"
    assert (tmp_path / "metrics.1.jsonl").read_text() == "first"

    g = tmp_path / "graphs"
    (g / "sub").mkdir(parents=True)
    (g / "00_input.py").write_text("x")
    assert keep_previous(str(g) + "/") == str(tmp_path / "graphs.1")
    assert (tmp_path / "graphs.1" / "00_input.py").read_text() == "x" and (tmp_path / "graphs.1" / "sub").is_dir()
    g.mkdir()
    assert keep_previous(str(g)) == str(tmp_path / "graphs.2") and not g.exists()


def test_resume_appends_and_reader_takes_the_last_row_per_step(tmp_path):
    """The earlier run logged steps 1-3 (its last checkpoint: step 2); the resumed run
    logs 3-4 again: every row stays in the file, read_metrics sees each step once, newest."""
    m = _logger(tmp_path)
    _log(m, [1, 2, 3], loss=10.0)
    m.summary(exclude_steps=1)
    m.close()
    before = (tmp_path / "metrics.jsonl").read_text()
    m = _logger(tmp_path, resume_step=2)
    _log(m, [3, 4], loss=20.0)
    m.summary(exclude_steps=1, extra={"resumed_from_step": 2})
    m.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.startswith(before)  # appended, nothing rewritten
    assert len(text.splitlines()) == 4 + 3
    rows, summary = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows] == [11.0, 12.0, 23.0, 24.0]
    assert summary["resumed_from_step"] == 2
    assert not (tmp_path / "metrics.1.jsonl").exists()


def test_fresh_runs_keep_earlier_records(tmp_path, log_lines):
    """A fresh run into a used folder moves metrics.jsonl and the TensorBoard folder
    aside (and says so); a third run keeps both older ones."""
    for i in range(3):
        m = _logger(tmp_path, enable_tensorboard=True, tb_folder="tb")
        _log(m, [1, 2], loss=float(i))
        m.close()
    assert [r["loss"] for r in read_metrics(str(tmp_path / "metrics.1.jsonl"))[0]] == [1.0, 2.0]
    assert [r["loss"] for r in read_metrics(str(tmp_path / "metrics.2.jsonl"))[0]] == [2.0, 3.0]
    assert [r["loss"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))[0]] == [3.0, 4.0]
    assert not (tmp_path / "metrics.3.jsonl").exists()
    for tb in ("tb", "tb.1", "tb.2"):
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / tb)), tb
    kept = [line for line in log_lines if "is kept as" in line]
    assert len(kept) == 4 and f"{tmp_path / 'metrics.jsonl'} is kept as {tmp_path / 'metrics.2.jsonl'}" in kept[-2]


def test_nothing_changes_before_the_first_logged_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    _logger(tmp_path).close()  # a fresh run that stops before logging anything
    _logger(tmp_path, resume_step=3).close()
    assert os.listdir(tmp_path) == ["metrics.jsonl"]
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


@pytest.mark.slow
def test_failed_resume_leaves_metrics_byte_identical(tmp_path):
    """--checkpoint.load_step of a checkpoint that does not exist: exit 2, one clear
    paragraph naming the flag and the folder, metrics.jsonl untouched."""
    d = tmp_path / "run"
    (d / "checkpoint").mkdir(parents=True)
    old = b'{"step": 1, "loss": 7.5, "grad_norm": 1.0}\n{"summary": {"final_loss": 7.5}}\n'
    (d / "metrics.jsonl").write_bytes(old)
    r = _train(d, *CKPT, "--checkpoint.load_step", "99")  # the trainer's own check (no launcher pre-check)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert (d / "metrics.jsonl").read_bytes() == old
    assert sorted(os.listdir(d)) == ["checkpoint", "metrics.jsonl"]
    assert f"--checkpoint.load_step 99: checkpoint {d / 'checkpoint' / 'step-99'} does not exist" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_resume_after_a_crash_appends_and_a_fresh_run_rotates(tmp_path, finished_run):
    """A run logged steps 1-4 but its last checkpoint is step 2 (step-4 removed, as if it
    crashed before saving it): the resumed run appends steps 3-4, the earlier rows stay and
    read_metrics returns the new ones. Then a fresh run (another --checkpoint.folder) into
    the same dump folder moves metrics.jsonl aside to metrics.1.jsonl, unchanged. The first
    run is a copy of the ``finished_run`` fixture (flags ``_runs.FINISHED``)."""
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    first = (d / "metrics.jsonl").read_bytes()
    assert [x["step"] for x in read_metrics(str(d / "metrics.jsonl"))[0]] == [1, 2, 3, 4]
    shutil.rmtree(d / "checkpoint" / "step-4")
    r = run_debug(d, FINISHED, steps=4, forked=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Resumed from" in r.stdout and "(step 2)" in r.stdout
    both = (d / "metrics.jsonl").read_bytes()
    assert both.startswith(first) and len(both.splitlines()) == len(first.splitlines()) + 3  # steps 3, 4, summary
    appended = [line for line in both.decode().splitlines()[len(first.splitlines()):] if '"summary"' not in line]
    rows, summary = read_metrics(str(d / "metrics.jsonl"))
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert summary["resumed_from_step"] == 2
    import json

    assert rows[2:] == [json.loads(line) for line in appended]  # the newest rows of steps 3 and 4
    assert (d / "checkpoint" / "step-2" / ".metadata").is_file()

    r = run_debug(d, FINISHED, "--checkpoint.folder", "checkpoint_b", steps=1, forked=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"is kept as {d / 'metrics.1.jsonl'}" in r.stdout
    assert (d / "metrics.1.jsonl").read_bytes() == both
    assert [x["step"] for x in read_metrics(str(d / "metrics.jsonl"))[0]] == [1]
