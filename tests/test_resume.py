"""Resume with the README's command again: a finished run is reported complete and nothing is
written; a model-only last checkpoint is named as such (never "corrupt") and never written over."""

import os
import shutil
from unittest import mock

import pytest
from torch.distributed.checkpoint import FileSystemReader

from graph_trainer.checkpoint import is_model_only, latest_step

import _early  # tests/ is on sys.path
from _runs import FINISHED, run_debug


def _model_only(path) -> bool:
    return is_model_only(FileSystemReader(str(path)).read_metadata())


def _ok(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _rerun(tmp, env):
    """A copy of ``finished_run`` (tests/conftest.py), then the same command again through run_train.sh:
    ``(the copy; its latest step, whether step-4 is model-only and metrics.jsonl's bytes before the run;
    the run's result)``."""
    a = tmp / "a"
    shutil.copytree(_early.result("finished_run"), a)
    before = latest_step(str(a / "checkpoint")), _model_only(a / "checkpoint" / "step-4"), \
        (a / "metrics.jsonl").read_bytes()
    return a, before, run_debug(a, FINISHED, env=env)


_early.job("rerun_finished_run", _rerun, needs=("finished_run",))


@pytest.mark.slow
@_early.uses("finished_run")
@_early.uses("rerun_finished_run")
def test_rerun_after_a_finished_run_is_reported_complete():
    """(The copy and the run started early: tests/_early.py.)"""
    a, (step, model_only, before), r = _early.result("rerun_finished_run")
    assert step == 4 and not model_only

    r = _ok(r)  # the same command again
    assert f"already complete at step 4 (--training.steps 4); its checkpoint is {a / 'checkpoint' / 'step-4'}" \
        in r.stdout
    assert "step:  " not in r.stdout  # no step ran
    assert (a / "metrics.jsonl").read_bytes() == before  # no new rows, no summary
    assert sorted(os.listdir(a / "checkpoint")) == ["step-2", "step-4"]


def _model_only_runs(tmp, env):
    """Four forked runs into one dump folder: a run whose last checkpoint is model-only, the same
    command again, a resume from step 2, the same again. ``(folder, [(result, reading)])``, each
    reading taken right after its run (an error while reading: the error): step-4 model-only and
    metrics.jsonl's bytes; metrics.jsonl's bytes; whether step-4.1 and step-4 are model-only."""
    d = tmp / "run"
    only = [*FINISHED, "--checkpoint.last_save_model_only"]
    step4, metrics = d / "checkpoint" / "step-4", d / "metrics.jsonl"
    runs = [((only,), lambda: (_model_only(step4), metrics.read_bytes())),
            ((only,), metrics.read_bytes),
            ((FINISHED, "--checkpoint.load_step", "2"), lambda: (_model_only(d / "checkpoint" / "step-4.1"),
                                                                 _model_only(step4))),
            ((FINISHED,), lambda: None)]
    return d, _early.readings(runs, lambda args: run_debug(d, *args, forked=True, env=env))


_early.job("model_only_runs", _model_only_runs)


@pytest.mark.slow
@_early.uses("model_only_runs")
def test_model_only_last_checkpoint_is_named_not_corrupt():
    """(The runs started early: tests/_early.py; each check reads the folder as it was right after its run.)"""
    d, ((r1, first), (r2, second), (r3, third), (r4, _)) = _early.result("model_only_runs")
    _ok(r1)
    step4 = d / "checkpoint" / "step-4"
    model_only, before = _early.reading(first)
    assert model_only

    r = r2  # the same command again (the loader's message)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"Checkpoint {step4} holds only the model (--checkpoint.last_save_model_only): it cannot resume " \
        "training; resume from step-2 with --checkpoint.load_step 2" in r.stderr
    assert "corrupt" not in r.stderr and "Traceback" not in r.stderr and "FrameSummary" not in r.stderr
    assert _early.reading(second) == before

    # Following the advice: the resumed run saves step 4 again; the model-only one is kept aside.
    r = _ok(r3)
    assert f"{step4} is kept as {d / 'checkpoint' / 'step-4.1'}" in r.stdout
    kept_model_only, step4_model_only = _early.reading(third)
    assert kept_model_only and not step4_model_only
    assert "already complete at step 4" in _ok(r4).stdout


def test_load_failure_names_the_first_real_error(tmp_path):
    """DCP wraps a rank's failure as (exception, traceback summary) in a CheckpointException: the
    message names the exception's type and first line, no reprs of tuples or frames, and the older
    full checkpoint to resume from."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from graph_trainer.checkpoint import Checkpointer, TrainState
    from graph_trainer.errors import UserError

    folder = tmp_path / "checkpoint"
    for step in (2, 4):
        dcp.save({"train_state": {"step": torch.tensor(step)}, "w": torch.ones(3)},
                 checkpoint_id=str(folder / f"step-{step}"))
    try:
        raise RuntimeError("Missing key in checkpoint state_dict: dataloader.dp_rank_0.\nsecond line")
    except RuntimeError as e:
        failure = CheckpointException("load failed", {0: _wrap_exception(e)})

    ck = object.__new__(Checkpointer)
    ck.enabled, ck.folder, ck.rank, ck.meta = True, str(folder), 0, {}
    ck.train_state, ck.manager = TrainState(), mock.Mock(**{"load.side_effect": failure})
    with pytest.raises(UserError) as info:
        ck.load_latest()
    msg = str(info.value)
    assert msg.startswith(f"Checkpoint {folder / 'step-4'} could not be loaded (RuntimeError: Missing key in "
                          "checkpoint state_dict: dataloader.dp_rank_0.); ")
    assert "resume from step-2 with --checkpoint.load_step 2" in msg
    assert "second line" not in msg and "FrameSummary" not in msg and "(RuntimeError(" not in msg
