"""Resume after any run, with the command the README gives (``--checkpoint.enable
--checkpoint.interval K``, then the same command again): a finished run is reported
complete and nothing is written; a model-only last checkpoint is named as such (never
"corrupt") and is never written over.

Runs are the debug model (seq 64, batch 2, no Inductor). The README's commands (the same
command again; ``--checkpoint.load_step``) run through ``run_train.sh``; the other runs are
the trainer's entry point forked from tests/_launch.py's server (``forked``), and the
finished 4-step run is the ``finished_run`` fixture (tests/conftest.py), run with these flags.
(A larger ``--training.steps`` continues a finished run bitwise the uninterrupted run, on 1
and 2 ranks: tests/test_determinism.py::test_run_to_run_and_resume_bitwise_with_pass.)
"""

import os
import shutil

import pytest
from torch.distributed.checkpoint import FileSystemReader

from graph_trainer.checkpoint import is_model_only, latest_step

from _runs import FINISHED, run_debug  # tests/ is on sys.path

SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--compile.inductor_compilation", "none"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]  # the project's default for the last save: full
assert FINISHED == SMALL + CKPT  # the finished_run fixture is the first run of these tests


def _train(dump, *flags, steps=4, forked=False):
    return run_debug(dump, SMALL, *flags, steps=steps, forked=forked)


def _ok(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_rerun_after_a_finished_run_is_reported_complete(tmp_path, finished_run):
    a = tmp_path / "a"
    shutil.copytree(finished_run, a)  # _train(a, *CKPT, steps=4)
    assert latest_step(str(a / "checkpoint")) == 4
    assert not is_model_only(FileSystemReader(str(a / "checkpoint" / "step-4")).read_metadata())
    before = (a / "metrics.jsonl").read_bytes()

    r = _ok(_train(a, *CKPT, steps=4))  # the same command again
    assert f"already complete at step 4 (--training.steps 4); its checkpoint is {a / 'checkpoint' / 'step-4'}" \
        in r.stdout
    assert "step:  " not in r.stdout  # no step ran
    assert (a / "metrics.jsonl").read_bytes() == before  # no new rows, no summary
    assert sorted(os.listdir(a / "checkpoint")) == ["step-2", "step-4"]


@pytest.mark.slow
def test_model_only_last_checkpoint_is_named_not_corrupt(tmp_path):
    d = tmp_path / "run"
    only = [*CKPT, "--checkpoint.last_save_model_only"]
    _ok(_train(d, *only, steps=4, forked=True))
    step4 = d / "checkpoint" / "step-4"
    assert is_model_only(FileSystemReader(str(step4)).read_metadata())
    before = (d / "metrics.jsonl").read_bytes()

    r = _train(d, *only, steps=4, forked=True)  # the same command again (the loader's message)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    err = r.stderr
    assert f"Checkpoint {step4} holds only the model (--checkpoint.last_save_model_only): it cannot resume " \
        "training; resume from step-2 with --checkpoint.load_step 2" in err
    assert "corrupt" not in err and "Traceback" not in err and "FrameSummary" not in err
    assert (d / "metrics.jsonl").read_bytes() == before

    # Following the advice: the resumed run saves step 4 again; the model-only one is kept aside.
    r = _ok(_train(d, *CKPT, "--checkpoint.load_step", "2", steps=4))
    assert f"{step4} is kept as {d / 'checkpoint' / 'step-4.1'}" in r.stdout
    assert is_model_only(FileSystemReader(str(d / "checkpoint" / "step-4.1")).read_metadata())
    assert not is_model_only(FileSystemReader(str(step4)).read_metadata())
    assert "already complete at step 4" in _ok(_train(d, *CKPT, steps=4, forked=True)).stdout


def test_load_failure_names_the_first_real_error(tmp_path):
    """DCP wraps a rank's failure as (exception, traceback summary) in a
    CheckpointException: the message names the exception's type and first line, with no
    Python reprs of tuples or frames, and the older full checkpoint to resume from."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from graph_trainer.checkpoint import Checkpointer, TrainState
    from graph_trainer.errors import UserError

    folder = tmp_path / "checkpoint"
    for step in (2, 4):
        state = {"train_state": {"step": torch.tensor(step)}, "w": torch.ones(3)}
        dcp.save(state, checkpoint_id=str(folder / f"step-{step}"))
    try:
        raise RuntimeError("Missing key in checkpoint state_dict: dataloader.dp_rank_0.\nsecond line")
    except RuntimeError as e:
        failure = CheckpointException("load failed", {0: _wrap_exception(e)})

    class Manager:
        def load(self, step):
            raise failure

    ck = object.__new__(Checkpointer)
    ck.enabled, ck.folder, ck.rank, ck.meta = True, str(folder), 0, {}
    ck.train_state, ck.manager = TrainState(), Manager()
    with pytest.raises(UserError) as info:
        ck.load_latest()
    msg = str(info.value)
    assert msg.startswith(f"Checkpoint {folder / 'step-4'} could not be loaded (RuntimeError: Missing key in "
                          "checkpoint state_dict: dataloader.dp_rank_0.); ")
    assert "resume from step-2 with --checkpoint.load_step 2" in msg
    assert "second line" not in msg and "FrameSummary" not in msg and "(RuntimeError(" not in msg
