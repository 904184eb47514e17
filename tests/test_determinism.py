"""Bitwise determinism on CPU: run-to-run and resume with the RMSNorm pass; bad checkpoints, divergence."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from graph_trainer.checkpoint import META_FILE, check_resume_compatible, latest_step
from graph_trainer.determinism import tensor_sha256
from graph_trainer.errors import UserError
from graph_trainer.metrics import read_metrics
from graph_trainer.tools import loss_compare as lc

import _early  # tests/ is on sys.path
from _launch import run_script
from _runs import PASS, SMALL, bitwise_runs, train_hashed

EARLY = {1: "bitwise_1rank", 2: "bitwise_gloo2"}  #: the debug model's runs by ranks, started early: conftest.py


@pytest.mark.slow
@pytest.mark.parametrize("ngpu, steps, config, extra, flavor", [
    pytest.param(1, 4, None, [], "debugmodel", id="1rank", marks=_early.uses(EARLY[1])),
    pytest.param(2, 4, None, [], "debugmodel", id="gloo2_fsdp", marks=_early.uses(EARLY[2])),
    pytest.param(1, 10, "train_configs/llama3_1b.toml", ["--debug.deterministic"], "1B", id="gpu_1b",
                 marks=pytest.mark.gpu),
])
def test_run_to_run_and_resume_bitwise_with_pass(tmp_path, ngpu, steps, config, extra, flavor):
    """Run b stopped at steps/2 and resumed in a new process equals run a bitwise (losses, norms, state)."""
    half = steps // 2
    a, b, r = _early.result(EARLY[ngpu]) if config is None else bitwise_runs(tmp_path, ngpu, steps, config, extra)
    assert "Resumed from" in r.stdout and f"(step {half})" in r.stdout
    (rows_a, sum_a), (rows_b, sum_b) = (read_metrics(str(d / "metrics.jsonl")) for d in (a, b))
    assert len(rows_a) == steps and sum_a["state_hashes"] and sum_b["resumed_from_step"] == half
    # steps 1..half from the first process, the rest and the final state from the resumed one
    assert lc.first_difference(rows_a, rows_b, sum_a["state_hashes"], sum_b["state_hashes"]) is None
    meta = json.loads((b / "checkpoint" / f"step-{half}" / META_FILE).read_text())
    assert meta["flavor"] == flavor and meta["layout"].startswith(f"dp_shard{ngpu}")


@_early.job("loss_compare_pass")
def _loss_compare(tmp, env):
    """scripts/loss_compare.py, pass off vs on, --assert-equal: ``(its --out folder, its result)``."""
    out = tmp / "cmp"
    return out, run_script(["scripts/loss_compare.py", "--steps", "4", "--out", str(out), "--a-flags", "", "--b-flags",
                            PASS, "--assert-equal", "--", *SMALL], env=env, timeout=900)  # forked: tests/_launch.py


@_early.uses("loss_compare_pass")
def test_loss_compare_pass_on_vs_off():
    """The RMSNorm pass changes the final state bitwise, the loss < 1e-4 relative; --assert-equal fails."""
    out, r = _early.result("loss_compare_pass")
    res = json.loads((out / "loss_compare.json").read_text())
    assert r.returncode == 1, r.stdout + r.stderr
    assert res["bitwise_equal"] is False and "differ" in res["first_difference"] and res["max_rel_loss_diff"] < 1e-4
    assert "DIFFERENT:" in r.stdout and "| step | loss A" in r.stdout
    assert res["state_hashes"]["A"]["weights"] != res["state_hashes"]["B"]["weights"]


def test_checkpoint_checks(tmp_path):
    """Partial saves are never picked; another flavor / layout is refused before loading."""
    ((folder := tmp_path / "checkpoint") / "step-2").mkdir(parents=True)
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
@_early.uses("finished_run")
def test_corrupt_checkpoint_clear_error(tmp_path):
    """A truncated step-2 file (``finished_run`` without step-4) stops the resume naming it; nothing deleted."""
    shutil.copytree(_early.result("finished_run"), d := tmp_path / "run")
    shutil.rmtree(d / "checkpoint" / "step-4")
    (path := next((d / "checkpoint" / "step-2").glob("*.distcp"))).write_bytes(path.read_bytes()[:100])
    r = train_hashed(d, "--checkpoint.enable", "--checkpoint.interval", "2", check=False, forked=True)
    assert r.returncode != 0 and f"step-2 is truncated: data file {path} has 100 bytes" in r.stderr
    assert path.exists()  # nothing deleted


@_early.job("nan_run")
def _nan_run(tmp, env):
    """run_train.sh's two torchrun ranks at a diverging learning rate, a checkpoint every step: ``(folder, result)``."""
    d = tmp / "run"
    return d, train_hashed(d, "--optimizer.lr", "1e25", "--lr_scheduler.warmup_steps", "0", "--checkpoint.enable",
                           "--checkpoint.interval", "1", steps=6, check=False, ngpu=2, env=env)


@_early.uses("nan_run")
def test_nan_stops_run_and_keeps_last_good_checkpoint():
    d, r = _early.result("nan_run")
    assert r.returncode != 0 and "grad norm is nan at step 2; stopping" in r.stderr.lower()
    assert "ChildFailedError" not in r.stderr and "Traceback" not in r.stderr  # one paragraph, torchrun's report gone
    assert latest_step(str(d / "checkpoint")) == 1  # step 1's checkpoint intact, none of step 2


def test_state_hash_of_a_dtensor_is_its_local_shard(fake_group):
    """Eager FSDP2 parameters are DTensors: each rank hashes its own shard, without a collective."""
    fake_group(2)
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    dt = distribute_tensor(full, init_device_mesh("cpu", (2,)), [Shard(0)])
    assert tensor_sha256([dt]) == tensor_sha256([dt.to_local().clone()]) != tensor_sha256([full])


def test_first_difference_and_a_failed_run_still_compares_logged_steps(tmp_path, monkeypatch, capsys):
    """first_difference names the step; a run that crashes after logging its steps still gets them compared."""
    rows = [{"step": 1, "loss": 2.0, "grad_norm": 1.0}, {"step": 2, "loss": 1.5, "grad_norm": 1.0}]
    other = [dict(rows[0]), {"step": 2, "loss": 1.5000001, "grad_norm": 1.0}]
    h = {"weights": "x", "grads": "y", "optimizer": "z"}
    assert lc.first_difference(rows, rows, h, dict(h)) is None
    assert lc.first_difference(rows, other, h, h).startswith("loss differs at step 2")
    assert "final grads differ" in lc.first_difference(rows, rows, h, {**h, "grads": "q"})
    assert "different steps" in lc.first_difference(rows, rows[:1], h, h)
    losses = {"A": [8.0, 7.5, 7.25], "B": [8.0, 7.5, 7.0]}

    def fake_execute(run, side, steps, warmup, prefix, verbose, timeout, progress):
        run.rows = [{"step": i + 1, "loss": v, "grad_norm": 1.0} for i, v in enumerate(losses[run.side])]
        ok = run.side == "A"
        run.status, run.wall_s, run.error = ("ok", 1.0, None) if ok else ("failed", 1.0, "exit code 1")
        run.summary = {"state_hashes": {"weights": "x"}} if ok else None

    monkeypatch.setattr(lc, "execute", fake_execute)
    monkeypatch.setattr(lc, "tail", lambda path: "")
    args = SimpleNamespace(steps=3, run_timeout=None, verbose=False, assert_equal=False, rtol=None)
    sides = {k: SimpleNamespace(label=k.lower(), flags=[], describe=lambda k=k: {"label": k.lower()}) for k in "AB"}
    assert lc._run(args, [], sides, str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "partial comparison (side B failed): the 3 step(s)" in out and "| 3 | 7.25 | 7.0 |" in out
    res = json.loads((tmp_path / "loss_compare.json").read_text())
    assert res["compared_steps"] == [1, 2, 3] and res["bitwise_equal"] is None
    assert res["max_rel_loss_diff"] == pytest.approx(0.25 / 7.25)
