"""Bitwise determinism on CPU: run-to-run with the RMSNorm pass, checkpoint resume,
the pass on vs off, on one rank and on 2 gloo ranks (traced FSDP); plus bad checkpoints
and a diverging run.

Every run is the debug model (seq 64, batch 2) with ``--debug.state_hashes``.
The run-to-run and resume runs start the trainer's entry point in new interpreters (each
its own string-hash seed), without run_train.sh's pre-check and torchrun: one rank as
``python -m graph_trainer.train``, two ranks as torchrun would (tests/_launch.py, fresh).
The pass on vs off runs are loss_compare's, the NaN run is run_train.sh's, the corrupt
checkpoint is loaded by a rank forked from tests/_launch.py's server from a copy of the
``finished_run`` fixture (tests/conftest.py). Runs are compared with
:mod:`graph_trainer.tools.loss_compare`.
(trace vs eager bitwise: tests/test_train.py::test_aot_fx_trace_matches_eager_bitwise; a
finished run's command again, a model-only last checkpoint: tests/test_resume.py;
multi-rank layouts vs eager torchtitan: tests/test_parallel_layouts.py.)
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from graph_trainer.checkpoint import META_FILE, check_resume_compatible, latest_step
from graph_trainer.metrics import read_metrics
from graph_trainer.errors import UserError
from graph_trainer.tools.loss_compare import first_difference

from _launch import train_ranks  # tests/ is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last_save_model_only"]
PASS = ["--compile.numerics_changing_optim"]


def _train(dump, *flags, ngpu=1, steps=4, check=True, config=None, launch="run_train.sh"):
    """The debug model at SMALL shapes, or ``config`` (a TOML file) as is, started by
    ``launch``: ``run_train.sh``; ``direct``, ``python -m graph_trainer.train`` (one rank);
    ``fresh`` / ``forked``, tests/_launch.py's ranks (new interpreters / forked)."""
    args = [*([] if config else SMALL), "--training.steps", str(steps), "--debug.state_hashes",
            "--job.dump_folder", str(dump), *flags]
    if launch in ("fresh", "forked"):
        assert config is None
        r = train_ranks(ngpu, args, f"{dump}.logs", fresh=launch == "fresh")
    else:
        env = {**os.environ, "NGPU": str(ngpu)}
        env.pop("CONFIG_FILE", None)
        cmd = ["bash", "run_train.sh"]
        if launch == "direct":
            assert ngpu == 1
            cmd = [sys.executable, "-m", "graph_trainer.train", "--job.config_file",
                   config or os.path.join(REPO, "train_configs", "debug_model.toml")]
        elif config:
            env["CONFIG_FILE"] = config
        r = subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _metrics(dump):
    rows, summary = read_metrics(os.path.join(dump, "metrics.jsonl"))
    return rows, summary


def _loss_compare(out, *args):
    r = subprocess.run(
        [sys.executable, "scripts/loss_compare.py", "--steps", "4", "--out", str(out), *args, "--", *SMALL],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    with open(os.path.join(out, "loss_compare.json")) as f:
        return r, json.load(f)


def _run_to_run_and_resume(tmp_path, ngpu, steps=4, config=None, extra=(), flavor="debugmodel"):
    """1. two runs with the RMSNorm pass + regional Inductor, each in new interpreters:
    bitwise-equal loss and grad norm at every step and equal sha256 of final weights, grads
    and optimizer state; 3. the second run stops at steps/2 (its last checkpoint) and the
    same command with the whole ``--training.steps`` (the README's way to train further)
    resumes it in a new process: only the later steps run, appended to metrics.jsonl, and
    the losses and final state are those of the uninterrupted first run. Both runs share the
    LR schedule of the whole run (``--lr_scheduler.total_steps``: torchtitan's otherwise
    depends on ``--training.steps``)."""
    half = steps // 2
    same = [*PASS, "--lr_scheduler.total_steps", str(steps), *extra]
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(half), "--checkpoint.no-last_save_model_only"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch = "direct" if ngpu == 1 else "fresh"  # new interpreters: each run its own hash seed
    _train(a, *same, ngpu=ngpu, steps=steps, config=config, launch=launch)  # uninterrupted, never saves
    _train(b, *same, *ckpt, ngpu=ngpu, steps=half, config=config, launch=launch)
    assert latest_step(str(b / "checkpoint")) == half
    first = (b / "metrics.jsonl").read_text()
    r = _train(b, *same, *ckpt, ngpu=ngpu, steps=steps, config=config, launch=launch)
    assert "Resumed from" in r.stdout and f"(step {half})" in r.stdout

    rows_a, sum_a = _metrics(a)
    rows_b, sum_b = _metrics(b)
    assert len(rows_a) == steps and sum_a["state_hashes"]
    text = (b / "metrics.jsonl").read_text()
    assert text.startswith(first)  # the first half's records kept
    appended = [json.loads(line) for line in text[len(first):].splitlines()]
    assert [x["step"] for x in appended if "summary" not in x] == list(range(half + 1, steps + 1))  # only those ran
    assert sum_b["resumed_from_step"] == half
    # steps 1..half from the first process, the rest and the final state from the resumed one
    assert first_difference(rows_a, rows_b, sum_a["state_hashes"], sum_b["state_hashes"]) is None
    meta = json.loads((b / "checkpoint" / f"step-{half}" / META_FILE).read_text())
    assert meta["flavor"] == flavor and meta["layout"].startswith(f"dp_shard{ngpu}")


@pytest.mark.slow
@pytest.mark.parametrize("ngpu", [1, 2], ids=["1rank", "gloo2_fsdp"])
def test_run_to_run_and_resume_bitwise_with_pass(tmp_path, ngpu):
    _run_to_run_and_resume(tmp_path, ngpu)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check: Llama3 1B, 10 steps)")
def test_gpu_1b_run_to_run_and_resume_bitwise_with_pass(tmp_path):
    """Tests 1 and 3 on one GPU with the 1B config for 10 steps, --debug.deterministic."""
    _run_to_run_and_resume(
        tmp_path, 1, steps=10, config="train_configs/llama3_1b.toml", extra=["--debug.deterministic"], flavor="1B"
    )


@pytest.mark.slow
def test_loss_compare_pass_on_vs_off(tmp_path):
    """4. the RMSNorm pass changes the compiled code (final state differs bitwise) but the
    loss stays within 1e-4 relative of the pass-off run; --assert-equal fails and names
    what differs; --rtol accepts it."""
    r, res = _loss_compare(tmp_path / "cmp", "--a-flags", "", "--b-flags", PASS[0], "--assert-equal")
    assert r.returncode == 1, r.stdout + r.stderr
    assert res["bitwise_equal"] is False
    assert "differ" in res["first_difference"]
    assert "DIFFERENT:" in r.stdout and "| step | loss A" in r.stdout
    assert res["max_rel_loss_diff"] < 1e-4
    a, b = res["state_hashes"]["A"], res["state_hashes"]["B"]
    assert a["weights"] != b["weights"]


def test_first_difference_names_the_step():
    rows = [{"step": 1, "loss": 2.0, "grad_norm": 1.0}, {"step": 2, "loss": 1.5, "grad_norm": 1.0}]
    other = [dict(rows[0]), {"step": 2, "loss": 1.5000001, "grad_norm": 1.0}]
    h = {"weights": "x", "grads": "y", "optimizer": "z"}
    assert first_difference(rows, rows, h, dict(h)) is None
    assert first_difference(rows, other, h, h).startswith("loss differs at step 2")
    assert "final grads differ" in first_difference(rows, rows, h, {**h, "grads": "q"})
    assert "different steps" in first_difference(rows, rows[:1], h, h)


def test_checkpoint_checks(tmp_path):
    """Partial saves are never picked; another flavor / layout is refused before loading."""
    folder = tmp_path / "checkpoint"
    (folder / "step-2").mkdir(parents=True)
    (folder / "step-2" / ".metadata").write_text("x")
    (folder / "step-4").mkdir()  # interrupted save: no .metadata
    assert latest_step(str(folder)) == 2
    meta = {"flavor": "debugmodel", "mode": "aot_fx_trace", "layout": "dp_shard2_dp_replicate1_tp1"}
    (folder / "step-2" / META_FILE).write_text(json.dumps(meta))
    check_resume_compatible(str(folder), 2, dict(meta))
    with pytest.raises(UserError, match="model flavor 'debugmodel' but this run uses '8B'"):
        check_resume_compatible(str(folder), 2, {**meta, "flavor": "8B"})
    with pytest.raises(UserError, match="parallel layout.*Resharding"):
        check_resume_compatible(str(folder), 2, {**meta, "layout": "dp_shard1_dp_replicate1_tp1"})


@pytest.mark.slow
def test_corrupt_checkpoint_clear_error(tmp_path, finished_run):
    """A truncated checkpoint file stops the resuming run with a message naming it; nothing
    is deleted. The run saved is a copy of the ``finished_run`` fixture (4 steps,
    checkpoints at steps 2 and 4) without its step-4, so step-2 is the one loaded."""
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    shutil.rmtree(d / "checkpoint" / "step-4")
    data = [f for f in os.listdir(d / "checkpoint" / "step-2") if f.endswith(".distcp")]
    path = d / "checkpoint" / "step-2" / data[0]
    path.write_bytes(path.read_bytes()[:100])  # truncate
    r = _train(d, *CKPT, steps=4, check=False, launch="forked")
    assert r.returncode != 0
    assert f"step-2 is truncated: data file {path} has 100 bytes" in r.stderr
    assert os.path.exists(path)  # nothing deleted


@pytest.mark.slow
def test_nan_stops_run_and_keeps_last_good_checkpoint(tmp_path):
    d = tmp_path / "run"
    r = _train(d, "--optimizer.lr", "1e25", "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable",
               "--checkpoint.interval", "1", steps=6, check=False)
    assert r.returncode != 0
    assert "grad norm is nan at step 2; stopping" in r.stderr.lower()
    assert "ChildFailedError" not in r.stderr and "Traceback" not in r.stderr  # one paragraph
    assert latest_step(str(d / "checkpoint")) == 1  # step 1's checkpoint intact, none of step 2


_DTENSOR_HASH = r"""
import torch, torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from graph_trainer.determinism import tensor_sha256
dist.init_process_group("fake", rank=0, world_size=2)
full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
dt = distribute_tensor(full, init_device_mesh("cpu", (2,)), [Shard(0)])
local = dt.to_local()
assert local.shape == (4, 4)
assert tensor_sha256([dt]) == tensor_sha256([local.clone()]) != tensor_sha256([full])
print("ok")
"""


def test_state_hash_of_a_dtensor_is_its_local_shard():
    """Eager FSDP2 parameters are DTensors: each rank hashes its own shard, without a
    collective (8B eager FSDP2 on 2x H200 once failed here at the end of the run)."""
    out = subprocess.run([sys.executable, "-c", _DTENSOR_HASH], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_loss_compare_failed_run_still_compares_logged_steps(tmp_path, monkeypatch, capsys):
    """A run that crashes after logging its steps (e.g. in the final state hash) still gets its per-step losses compared; the exit code says it failed."""
    import argparse

    import graph_trainer.tools.loss_compare as lc

    losses = {"A": [8.0, 7.5, 7.25], "B": [8.0, 7.5, 7.0]}

    def fake_execute(run, side, steps, warmup, prefix, verbose, timeout, progress):
        run.rows = [{"step": i + 1, "loss": v, "grad_norm": 1.0} for i, v in enumerate(losses[run.side])]
        run.status, run.wall_s = ("ok", 1.0) if run.side == "A" else ("failed", 1.0)
        run.error = None if run.side == "A" else "exit code 1"
        run.summary = {"state_hashes": {"weights": "x"}} if run.side == "A" else None

    class FakeSide:
        flags: list = []

        def __init__(self, label):
            self.label = label

        def describe(self):
            return {"label": self.label}

    monkeypatch.setattr(lc, "execute", fake_execute)
    monkeypatch.setattr(lc, "tail", lambda path: "")
    args = argparse.Namespace(steps=3, run_timeout=None, verbose=False, assert_equal=False, rtol=None)
    rc = lc._run(args, [], {"A": FakeSide("a"), "B": FakeSide("b")}, str(tmp_path))
    out = capsys.readouterr().out
    assert rc == 1
    assert "partial comparison (side B failed): the 3 step(s)" in out and "| 3 | 7.25 | 7.0 |" in out
    res = json.load(open(tmp_path / "loss_compare.json"))
    assert res["compared_steps"] == [1, 2, 3] and res["bitwise_equal"] is None
    assert res["max_rel_loss_diff"] == pytest.approx(0.25 / 7.25)
