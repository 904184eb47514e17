"""Resume, in one chain of runs on a copy of ``finished_run`` without step-4; DCP load failures."""

import functools
import os
import shutil
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from graph_trainer.checkpoint import Checkpointer, TrainState, is_model_only, latest_step
from graph_trainer.errors import UserError
from graph_trainer.metrics import read_metrics

import _early  # tests/ is on sys.path
from _runs import FINISHED, run_debug

ONLY = "--checkpoint.last_save_model_only"


def _model_only(path) -> bool:
    return is_model_only(dcp.FileSystemReader(str(path)).read_metadata())


@_early.job("resume_chain", needs=("finished_run",))
def _chain(tmp, env):
    """The chain of runs (``FINISHED`` plus flags) on the copy: ``(copy, results, readings)``, read after each run."""
    d = tmp / "run"
    shutil.copytree(_early.result("finished_run"), d)
    ck, metrics, run = d / "checkpoint", d / "metrics.jsonl", functools.partial(run_debug, d, FINISHED, env=env)
    first = metrics.read_bytes()
    shutil.rmtree(ck / "step-4")
    files = sorted(os.listdir(d))
    r = run("--checkpoint.load_step", "99", forked=True)
    after_missing = metrics.read_bytes(), sorted(os.listdir(d))
    r2 = run(ONLY, forked=True)
    after_resume = (metrics.read_bytes(), read_metrics(str(metrics)), (ck / "step-2" / ".metadata").is_file(),
                    _model_only(ck / "step-4"))
    r3 = run(ONLY, forked=True)
    after_again = metrics.read_bytes()
    r4 = run("--checkpoint.load_step", "2", forked=True)
    after_load2 = (_model_only(ck / "step-4.1"), _model_only(ck / "step-4"), latest_step(str(ck)),
                   metrics.read_bytes(), sorted(os.listdir(ck)))
    r5 = run()  # through run_train.sh
    after_rerun = metrics.read_bytes(), sorted(os.listdir(ck))
    r6 = run("--checkpoint.folder", "checkpoint_b", steps=1, forked=True)
    return d, (r, r2, r3, r4, r5, r6), ((first, files), after_missing, after_resume, after_again, after_load2,
                                        after_rerun)


@_early.uses("finished_run")
@_early.uses("resume_chain")
def test_resume_chain():
    """Failed resumes change nothing; model-only step named, kept; resume appends; rerun writes nothing; fresh moves."""
    d, (r, r2, r3, r4, r5, r6), readings = _early.result("resume_chain")
    (first, files), after_missing, after_resume, after_again, after_load2, after_rerun = readings
    step4 = d / "checkpoint" / "step-4"
    for ok in (r2, r4, r5, r6):
        assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]  # a missing --checkpoint.load_step
    assert f"--checkpoint.load_step 99: checkpoint {d / 'checkpoint' / 'step-99'} does not exist" in r.stderr
    assert "Traceback" not in r.stderr and after_missing == (first, files)
    assert "Resumed from" in r2.stdout and "(step 2)" in r2.stdout
    both, (rows, summary), step2_metadata, model_only = after_resume
    assert both.startswith(first) and len(both.splitlines()) == len(first.splitlines()) + 3  # steps 3, 4, summary
    assert [x["step"] for x in rows] == [1, 2, 3, 4] and summary["resumed_from_step"] == 2
    assert step2_metadata and model_only
    assert r3.returncode == 2, r3.stdout[-3000:] + r3.stderr[-3000:]  # the same command again
    assert f"Checkpoint {step4} holds only the model (--checkpoint.last_save_model_only): it cannot resume " \
        "training; resume from step-2 with --checkpoint.load_step 2" in r3.stderr
    assert "corrupt" not in r3.stderr and "Traceback" not in r3.stderr and "FrameSummary" not in r3.stderr
    assert after_again == both
    # following the advice: the resumed run saves step 4 again; the model-only one is kept aside
    assert f"{step4} is kept as {d / 'checkpoint' / 'step-4.1'}" in r4.stdout
    kept_model_only, step4_model_only, step, before, listing = after_load2
    assert kept_model_only and not step4_model_only and step == 4 and listing == ["step-2", "step-4", "step-4.1"]
    assert f"already complete at step 4 (--training.steps 4); its checkpoint is {step4}" in r5.stdout
    assert "step:  " not in r5.stdout  # no step ran
    assert after_rerun == (before, listing)  # no new rows, no summary, no checkpoint
    assert f"is kept as {d / 'metrics.1.jsonl'}" in r6.stdout  # a fresh run
    assert (d / "metrics.1.jsonl").read_bytes() == after_rerun[0]
    assert [x["step"] for x in read_metrics(str(d / "metrics.jsonl"))[0]] == [1]


def test_load_failure_names_the_first_real_error(tmp_path):
    """A DCP load failure names the first real error and the older checkpoint to resume from."""
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
