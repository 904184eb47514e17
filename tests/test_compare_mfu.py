"""scripts/compare_mfu.py: A/B runs of run_train.sh, statistics, table, JSON, plot, bad input.

Most tests run the tool against a *fake* trainer tree (a git repo whose run_train.sh
prints step lines and writes metrics.jsonl in milliseconds), so ordering, worktrees,
failures and the noise verdict are checked quickly and deterministically. One test
runs the real debug model on CPU (eager, 2 steps; ~20 s per run): the committed HEAD from
a temporary worktree against the working tree with a flag.
"""

import io
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from graph_trainer.tools import compare_mfu, runs, stats
from graph_trainer.tools.sides import Side

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "compare_mfu.py")
TINY = ["--compile.mode", "eager", "--training.seq_len", "64", "--training.local_batch_size", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env():
    env = dict(os.environ)
    for k in ("CONFIG_FILE", "CONFIG", "NGPU"):
        env.pop(k, None)
    return env


def _compare(*args, cwd=REPO, timeout=400):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True, text=True)


# ----------------------------------------------------------------------------------
# a fake trainer tree: run_train.sh + graph_trainer/config.py, tps read from tps.txt
# ----------------------------------------------------------------------------------

FAKE_TRAIN = r'''
import json, os, sys
args = sys.argv[1:]
def opt(name, default=None):
    return args[args.index(name) + 1] if name in args else default
steps = int(opt("--training.steps", "10"))
dump = opt("--job.dump_folder")
base = float(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tps.txt")).read())
base *= float(opt("--fake.scale", "1"))
os.makedirs(dump, exist_ok=True)
if "--fake.hang" in args:  # like torchrun: a worker in its own session, then wait
    import subprocess, time
    worker = subprocess.Popen(["sleep", "300"], start_new_session=True)
    open(os.path.join(dump, "worker.pid"), "w").write(str(worker.pid))
    print("[rank0]: step:  1  loss:  8.00000  grad_norm: 1.0  memory: 1.50GiB  tps: 100  tflops: 0.01  mfu: n/a",
          flush=True)
    time.sleep(300)
if "--fake.usererror" in args:
    print("[rank0]:error: pass list conflicts with --fake.x", flush=True)
    sys.exit(2)
rows = []
with open(os.path.join(dump, "metrics.jsonl"), "w") as f:
    for step in range(1, steps + 1):
        if "--fake.fail" in args and step == 2:
            print("Traceback (most recent call last):")
            print("RuntimeError: fake failure at step 2", flush=True)
            sys.exit(1)
        tps = base / 10 if step == 1 else base
        row = dict(step=step, loss=8.0 - 0.1 * step, grad_norm=1.0, tps=tps, tflops=tps * 1e-4,
                   mfu=None, memory_gib=1.5, memory_pct=None, step_time_s=1.0, data_time_s=0.0, lr=None)
        rows.append(row)
        f.write(json.dumps(row) + "\n")
        print(f"[rank0]:[graph_trainer] - INFO - step: {step:2}  loss: {row['loss']:8.5f}  grad_norm:  1.0000  "
              f"memory: 1.50GiB  tps: {round(tps):,}  tflops: 0.10  mfu: n/a  step_time: 1.000s  data: 0.0ms",
              flush=True)
    f.write(json.dumps({"summary": {"tps": base}}) + "\n")
'''

FAKE_CONFIG = r'''
import os, sys
args = sys.argv[1:]
cfg = args[args.index("--job.config_file") + 1]
if not os.path.isfile(cfg):
    print(f"error: config file {cfg} does not exist", file=sys.stderr); sys.exit(2)
bad = [a for a in args if a.startswith("--fake.bad")]
if bad:
    print(f"error: unrecognized option {bad[0]}", file=sys.stderr); sys.exit(2)
'''

FAKE_RUN = """#!/usr/bin/env bash
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
exec python3 fake_train.py "$@"
"""


@pytest.fixture
def fake_repo(tmp_path):
    """A git repo with two commits: HEAD~1 runs at 1000 tps, HEAD at 1100 tps."""
    root = tmp_path / "fake"
    (root / "graph_trainer").mkdir(parents=True)
    (root / "train_configs").mkdir()
    (root / "graph_trainer" / "__init__.py").write_text("")
    (root / "graph_trainer" / "config.py").write_text(FAKE_CONFIG)
    (root / "train_configs" / "debug_model.toml").write_text("[job]\n")
    (root / "run_train.sh").write_text(FAKE_RUN)
    (root / "fake_train.py").write_text(FAKE_TRAIN)
    (root / "tps.txt").write_text("1000")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    (root / "tps.txt").write_text("1100")
    _git(root, "commit", "-q", "-am", "faster")
    return root


def _load(out):
    with open(os.path.join(out, "comparison.json")) as f:
        return json.load(f)


def test_fake_refs_alternate_and_real_delta(fake_repo, tmp_path):
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a", "HEAD~1", "--b", "HEAD", "--repeats", "2",
                 "--steps", "5", "--warmup", "2", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    data = _load(out)
    assert [(x["side"], x["repeat"]) for x in data["runs"]] == [("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    assert all(x["status"] == "ok" for x in data["runs"])
    assert data["runs"][0]["stats"]["steady_steps"] == [3, 4, 5]  # steps 1..warmup excluded
    for x in data["runs"]:
        assert "--training.steps" in x["cmd"] and "--metrics.log_freq" in x["cmd"]
        assert x["dump_folder"].startswith(str(out))
    table = data["table"]
    assert table["sides"]["A"]["tps"]["median"] == pytest.approx(1000)
    assert table["sides"]["B"]["tps"]["median"] == pytest.approx(1100)
    d = table["delta_b_vs_a"]
    assert d["tps"]["pct"] == pytest.approx(10.0) and d["tps"]["verdict"] == "real"
    assert d["mfu"]["verdict"] == "n/a" and d["memory_gib"]["verdict"] == "no change"
    # the ref sides really ran their own commit, from a worktree that is gone now
    assert data["sides"]["A"]["commit"] != data["sides"]["B"]["commit"]
    assert all(data["sides"][s]["worktree"] for s in "AB")
    assert not os.path.exists(data["sides"]["A"]["tree"])
    wt = subprocess.run(["git", "-C", str(fake_repo), "worktree", "list"], capture_output=True, text=True)
    assert len(wt.stdout.strip().splitlines()) == 1
    assert "| Δ B vs A | +10.00% (real, spread 0.00%)" in r.stdout
    assert "step 5/5" in r.stdout  # progress lines
    assert "MFU n/a" in r.stdout or "n/a" in r.stdout
    assert open(out / "tps_per_step.png", "rb").read(8) == PNG_MAGIC


def test_fake_failed_run_is_recorded_and_others_kept(fake_repo, tmp_path):
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a-flags", "", "--b-flags", "--fake.fail",
                 "--repeats", "2", "--steps", "3", "--warmup", "1", "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    data = _load(out)
    status = {(x["side"], x["repeat"]): x["status"] for x in data["runs"]}
    assert status == {("A", 1): "ok", ("B", 1): "failed", ("A", 2): "ok", ("B", 2): "failed"}
    assert data["ok"] is False
    failed = [x for x in data["runs"] if x["status"] == "failed"][0]
    assert "RuntimeError: fake failure at step 2" in failed["error"]
    assert "last 40 lines" in r.stdout and "| RuntimeError: fake failure" in r.stdout  # the tail
    assert data["table"]["sides"]["A"]["tps"]["median"] == pytest.approx(1100)
    assert "| B: working tree + --fake.fail (0/2 runs) | failed |" in r.stdout
    assert "2 run(s) failed or skipped" in r.stderr


def test_fake_input_error_skips_the_remaining_repeats_of_that_side(fake_repo, tmp_path):
    """A trainer input error ("error: ..."; not caught by the config pre-check) would
    fail every repeat: the side's later runs are skipped, the other side's go on."""
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a-flags", "--fake.usererror", "--b-flags", "",
                 "--repeats", "3", "--steps", "2", "--warmup", "0", "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    data = _load(out)
    assert [(x["side"], x["status"]) for x in data["runs"]] == [
        ("A", "failed"), ("B", "ok"), ("A", "skipped"), ("B", "ok"), ("A", "skipped"), ("B", "ok")]
    assert data["runs"][0]["error"] == "exit code 2: pass list conflicts with --fake.x"
    assert "A1 failed on an input error" in data["runs"][2]["error"]
    assert data["table"]["runs_ok"] == {"A": 0, "B": 3}


def test_one_repeat_says_spread_unknown(fake_repo, tmp_path):
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a-flags", "", "--b-flags", "--fake.scale 0.5",
                 "--repeats", "1", "--steps", "2", "--warmup", "0", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| A: working tree (1/1 runs) |" in r.stdout and "| B: working tree + --fake.scale 0.5 (1/1 runs) |" in r.stdout
    assert "-50.00% (spread unknown: 1 repeat)" in r.stdout
    assert "spread unknown with 1 repeat" in r.stdout
    assert _load(out)["table"]["delta_b_vs_a"]["tps"]["spread_pct"] is None


def test_fake_same_commit_on_both_sides_shares_one_worktree(fake_repo, tmp_path):
    """--a HEAD --b HEAD (B with a flag): both sides run the commit from one temporary
    worktree, removed afterwards."""
    head = subprocess.run(["git", "-C", str(fake_repo), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a", "HEAD", "--b", "HEAD", "--b-flags", "--fake.scale 0.5",
                 "--repeats", "1", "--steps", "2", "--warmup", "0", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    data = _load(out)
    for s in "AB":
        assert data["sides"][s]["commit"] == head and data["sides"][s]["worktree"]
    assert data["sides"]["A"]["tree"] == data["sides"]["B"]["tree"]  # one worktree per commit
    assert not os.path.exists(data["sides"]["A"]["tree"])  # removed afterwards
    assert f"| A: HEAD@{head[:8]} (1/1 runs) |" in r.stdout
    wt = subprocess.run(["git", "-C", str(fake_repo), "worktree", "list"], capture_output=True, text=True)
    assert len(wt.stdout.strip().splitlines()) == 1


@pytest.mark.slow
def test_dirty_tree_with_head_ref_is_rejected(fake_repo, tmp_path):
    (fake_repo / "tps.txt").write_text("5000")  # uncommitted change
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a", "HEAD~1", "--b", "HEAD", "--out", str(out))
    assert r.returncode == 2
    assert "--b HEAD is HEAD" in r.stderr and "commit or stash" in r.stderr.lower()
    assert "flags-only sides" in r.stderr and "tps.txt" in r.stderr
    assert not out.exists()
    # a ref that is not HEAD, against the working tree: fine with a dirty tree
    r = _compare("--repo", str(fake_repo), "--a", "HEAD~1", "--dry-run", "--out", str(out))
    assert r.returncode == 0, r.stderr
    # --allow-dirty runs the committed HEAD on purpose
    r = _compare("--repo", str(fake_repo), "--a", "HEAD~1", "--b", "HEAD", "--allow-dirty",
                 "--dry-run", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "would run" in r.stdout and not out.exists()


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_fake_timeout_kills_the_run_and_its_workers(fake_repo, tmp_path):
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a-flags", "", "--b-flags", "--fake.hang", "--repeats", "1",
                 "--steps", "2", "--warmup", "0", "--run-timeout", "3", "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    data = _load(out)
    b = [x for x in data["runs"] if x["side"] == "B"][0]
    assert b["status"] == "failed" and "timed out after 3s" in b["error"]
    assert not _alive(int(open(os.path.join(b["dump_folder"], "worker.pid")).read()))
    assert data["runs"][0]["status"] == "ok"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])  # Ctrl-C, and `timeout` around the script
def test_fake_ctrl_c_reports_finished_runs(fake_repo, tmp_path, signame):
    """The signal comes once the tool reports B1's step 1: A1 has finished, the fake
    trainer has written worker.pid (before its step line) and the tool is streaming B1,
    the run it must stop."""
    out = tmp_path / "cmp"
    p = subprocess.Popen([sys.executable, SCRIPT, "--repo", str(fake_repo), "--a-flags", "",
                          "--b-flags", "--fake.hang", "--repeats", "2", "--steps", "2", "--warmup", "0",
                          "--out", str(out)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines, ready = [], threading.Event()
    b1_step1 = lambda line: line.startswith("[2/4] B1 (") and " step 1/2 " in line  # noqa: E731

    def read():  # the tool's output; `ready` at B1's progress line of step 1 (or at the end)
        for line in p.stdout:
            lines.append(line)
            if b1_step1(line):
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready.wait(timeout=120)  # a bound for a broken tool, not a guess: B1 hangs until signalled
        assert any(b1_step1(line) for line in lines), "".join(lines)
        p.send_signal(getattr(signal, signame))
        p.wait(timeout=60)
    finally:
        if p.poll() is None:  # a failed check above: let the tool stop its run, then make sure
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    reader.join(timeout=60)
    stdout = "".join(lines)
    assert p.returncode == 130, stdout
    assert "interrupted; reporting the finished runs" in stdout
    data = _load(out)
    assert [(x["side"], x["status"]) for x in data["runs"]] == [
        ("A", "ok"), ("B", "interrupted"), ("A", "pending"), ("B", "pending")]
    assert data["ok"] is False and data["table"]["runs_ok"] == {"A": 1, "B": 0}
    assert "| B: working tree + --fake.hang (0/2 runs) | interrupted |" in stdout
    worker_pid = out / "runs" / "B1" / "worker.pid"
    assert not _alive(int(worker_pid.read_text()))


def test_ctrl_c_while_a_run_starts_stops_it(tmp_path, monkeypatch):
    """A Ctrl-C the moment ``Popen`` has started the run (before ``execute`` holds it):
    ``execute`` raises KeyboardInterrupt and the run is stopped, not left behind."""
    started = []

    class PopenThenCtrlC(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(runs.subprocess, "Popen", PopenThenCtrlC)
    side = Side(name="B", ref=None, flags=[], root=str(tmp_path), config_file="none.toml")
    run = runs.Run(side="B", repeat=1, index=1, dump_folder=str(tmp_path / "B1"), log=str(tmp_path / "B1.log"),
                   cmd=[sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        with pytest.raises(KeyboardInterrupt):
            runs.execute(run, side, 2, 0, "[B1]", False, None, runs.Progress(io.StringIO()))
        assert len(started) == 1 and started[0].poll() is not None  # stopped and reaped
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ----------------------------------------------------------------------------------
# bad input on the real tree: errors before any run
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tree, a_side, b_flags, needle",
    [
        pytest.param("fake", ["--a", "HEAD~1"], "--fake.bad 1", "unrecognized option --fake.bad", id="fake"),
        pytest.param("real", ["--a-flags", ""], "--training.no_such_flag 1", "--training.no_such_flag", id="real",
                     marks=pytest.mark.slow),  # the real config parser, on both sides
    ],
)
def test_bad_flag_on_one_side_is_rejected_before_any_run(tree, a_side, b_flags, needle, tmp_path, request):
    """A flag that the trainer's config parser rejects on side B: exit 2 naming side B (and
    not A), nothing run, no output folder; on the fake tree and on the real one (TINY)."""
    where = ["--repo", str(request.getfixturevalue("fake_repo"))] if tree == "fake" else []
    extra = ["--", *TINY] if tree == "real" else []
    out = tmp_path / "cmp"
    r = _compare(*where, *a_side, "--b-flags", b_flags, "--out", str(out), *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "side B" in r.stderr and needle in r.stderr
    assert "side A" not in r.stderr
    assert "validating" in r.stdout and "step 1" not in r.stdout
    assert not out.exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--a-flags", "", "--", "--training.steps", "5"], "use --steps instead"),
        (["--a-flags", "--job.dump_folder=/tmp/x"], "use --out instead"),
        (["--a-flags", "", "--steps", "3", "--warmup", "3"], "leaves no step to measure"),
        (["--a-flags", "", "--steps", "3", "--warmup", "0", "--profile-step", "4"], "--profile-step must be in 2..--steps (3)"),
        (["--steps", "5"], "nothing to compare"),
        (["--a-flags", "'unbalanced"], "not a valid shell-quoted string"),
        (["--a", "no-such-branch-xyz", "--", *TINY], "unknown git ref 'no-such-branch-xyz'"),
    ],
)
def test_usage_errors(args, needle, tmp_path):
    """Bad input on the real tree: exit 2 before any run, no output folder."""
    r = _compare("--out", str(tmp_path / "cmp"), *args)  # before `args`: never taken as an argument after --
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert not (tmp_path / "cmp").exists()


# ----------------------------------------------------------------------------------
# the real trainer (CPU, eager, 2 steps)
# ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_head_ref_against_working_tree_flags(tmp_path):
    """Side A the committed HEAD, run from a temporary git worktree (removed afterwards);
    side B the working tree with --training.max_norm 0.5; both profiled at step 2.
    --allow-dirty: in a checkout with uncommitted changes A deliberately runs the committed
    HEAD (on a clean CI checkout it changes nothing). Outside a git checkout A is the working
    tree without flags."""
    git = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True)
    head = git.stdout.strip() if git.returncode == 0 else None
    a_side = ["--a", "HEAD", "--allow-dirty"] if head else ["--a-flags", ""]
    out = tmp_path / "cmp"
    r = _compare(*a_side, "--b-flags", "--training.max_norm 0.5", "--repeats", "1",
                 "--steps", "2", "--warmup", "0", "--profile-step", "2", "--out", str(out), "--", *TINY)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| side | tps | tflops | MFU | memory |" in r.stdout
    if head:
        assert f"| A: HEAD@{head[:8]} (1/1 runs) |" in r.stdout
    else:
        assert "| A: working tree (1/1 runs) |" in r.stdout
    assert "| B: working tree + --training.max_norm 0.5 (1/1 runs) |" in r.stdout
    assert "[1/2] A1" in r.stdout and "[2/2] B1" in r.stdout and "step 2/2" in r.stdout
    data = _load(out)
    if head:
        assert data["sides"]["A"]["commit"] == head and data["sides"]["A"]["worktree"]
        assert not os.path.exists(data["sides"]["A"]["tree"])  # removed afterwards
        wt = subprocess.run(["git", "-C", REPO, "worktree", "list", "--porcelain"], capture_output=True, text=True)
        assert data["sides"]["A"]["tree"] not in wt.stdout
    assert not data["sides"]["B"]["worktree"]  # the working tree itself
    assert data["sides"]["B"]["flags"] == ["--training.max_norm", "0.5"]
    assert [x["side"] for x in data["runs"]] == ["A", "B"]
    for x in data["runs"]:
        assert x["status"] == "ok"
        assert [row["step"] for row in x["rows"]] == [1, 2]
        assert x["stats"]["tps"] > 0 and x["stats"]["mfu"] is None  # CPU: MFU n/a
        assert x["stats"]["memory_gib"] > 0
        assert os.path.isfile(os.path.join(x["dump_folder"], "metrics.jsonl"))
    assert data["table"]["sides"]["A"]["mfu"]["median"] is None
    assert data["table"]["delta_b_vs_a"]["mfu"]["verdict"] == "n/a"
    assert data["table"]["delta_b_vs_a"]["tps"]["pct"] is not None
    assert open(out / data["plot"], "rb").read(8) == PNG_MAGIC
    # --profile-step 2: both runs profiled step 2; kernel time by category, A vs B
    k = data["kernels"]
    assert k["step"] == 2 and k["unit"] == "CPU" and k["runs"] == {"A": 1, "B": 1}
    assert k["sides"]["A"]["matmul"] > 0 and k["sides"]["B"]["matmul"] > 0
    assert k["sides"]["A"]["total"] >= k["sides"]["A"]["matmul"]
    assert "CPU ms of step 2 by kernel category" in r.stdout and "| matmul |" in r.stdout
    for side in "AB":  # the step timeline: compute + exposed communication + idle = wall
        t = k["timeline"][side]
        assert 0 < t["compute_ms"] <= t["wall_ms"]
        assert t["compute_ms"] + t["exposed_comm_ms"] + t["idle_ms"] == pytest.approx(t["wall_ms"])
    assert "| nothing running |" in r.stdout
    # the profiled step of A above B's
    assert data["timeline_plot"] == "timeline_a_vs_b.png"
    assert open(out / "timeline_a_vs_b.png", "rb").read(8) == PNG_MAGIC
    assert f"step 2 timeline, A above B: {out / 'timeline_a_vs_b.png'}" in r.stdout


# ----------------------------------------------------------------------------------
# pure functions
# ----------------------------------------------------------------------------------


def _row(step, tps, mfu=None, mem=1.0):
    return {"step": step, "tps": tps, "tflops": tps / 1000, "mfu": mfu, "memory_gib": mem,
            "memory_pct": None, "loss": 1.0, "step_time_s": 1.0}


def test_run_stats_excludes_step_one_and_warmup():
    rows = [_row(1, 1.0, mem=0.5), _row(2, 50.0), _row(3, 100.0, mem=2.0), _row(4, 120.0), _row(5, 110.0)]
    s = stats.run_stats(rows, warmup=0)
    assert s["steady_steps"] == [2, 3, 4, 5] and s["tps"] == 105.0
    s = stats.run_stats(rows, warmup=2)
    assert s["steady_steps"] == [3, 4, 5] and s["tps"] == 110.0
    assert s["mfu"] is None and s["memory_gib"] == 2.0  # max over all steps


def test_delta_verdicts_and_table():
    a = stats.side_stats([{"tps": 100.0, "tflops": 1.0, "mfu": 10.0, "memory_gib": 30.0},
                            {"tps": 102.0, "tflops": 1.02, "mfu": 10.2, "memory_gib": 30.0}])
    b = stats.side_stats([{"tps": 110.0, "tflops": 1.1, "mfu": 10.0, "memory_gib": 30.0},
                            {"tps": 111.0, "tflops": 1.11, "mfu": 10.4, "memory_gib": 30.0}])
    assert a["tps"]["spread_pct"] == pytest.approx(2 / 101 * 100)
    d = stats.delta(a, b)
    assert d["tps"]["verdict"] == "real" and d["tps"]["pct"] == pytest.approx((110.5 - 101) / 101 * 100)
    assert d["mfu"]["verdict"] == "within noise"  # +0.99% vs a 3.9% spread
    assert d["memory_gib"]["verdict"] == "no change"
    md = stats.markdown_table({"A": "main", "B": "pr"}, {"A": a, "B": b}, d, {"A": 2, "B": 2}, 2)
    assert "| A: main (2/2 runs) | 101 (100–102) | 1.01 (1.00–1.02) | 10.10% (10.00–10.20) | 30.00 GiB (30.00–30.00) |" in md
    assert "+9.41% (real, spread 1.98%)" in md
    line = stats.one_liner({"A": "main", "B": "pr"}, {"A": a, "B": b}, {"A": 2, "B": 2})
    assert line.startswith("A (main): 101 tps, 1.01 tflops, 10.10% MFU, 30.00 GiB — B (pr): ")


def test_flag_values_that_look_like_options():
    args, extra = compare_mfu.parse(["--b-flags", "--compile.numerics_changing_optim", "--a", "main",
                                 "--", "--compile.mode", "eager"])
    assert args.b_flags == "--compile.numerics_changing_optim" and args.a == "main"
    assert extra == ["--compile.mode", "eager"]
    args, _ = compare_mfu.parse(["--a-flags", "", "--b-flags=--x 1"])
    assert args.a_flags == "" and args.b_flags == "--x 1"


def test_step_line_regex():
    line = ("[rank0]:[graph_trainer] 2026-11-22 07:53:31,358 - INFO - step:  1  loss:  8.10024  "
            "grad_norm:  1.9553  memory: 0.66GiB  tps: 6,538  tflops: 0.00  mfu: 38.29%  step_time: 4.246s")
    m = runs.STEP_RE.search(line)
    assert m and m.group("step") == "1" and m.group("tps") == "6,538" and m.group("mfu") == "38.29%"


def test_timeline_plot_draws_the_median_run_of_each_side(tmp_path, capsys):
    """--profile-step's A-vs-B picture, from the runs' rank0_kernels.json (no trainer run)."""
    from graph_trainer.tools.profiling import _json_text
    from graph_trainer.tools.timeline import pack_step

    def run(side, repeat, wall_us, profiled=True):
        r = runs.Run(side=side, repeat=repeat, index=repeat, dump_folder=str(tmp_path / f"{side}{repeat}"), log="")
        if profiled:
            path = compare_mfu.profile_json(r.dump_folder, 3)
            os.makedirs(os.path.dirname(path))
            kernels = [(0, wall_us / 2, "matmul"), (wall_us / 4, 3 * wall_us / 4, "communication")]
            with open(path, "w") as f:
                f.write(_json_text({"step": 3, "unit": "CPU", "step_intervals": pack_step(kernels, (0, wall_us), 3)}))
        return r

    all_runs = [run("A", 1, 900), run("B", 1, 500), run("A", 2, 1000), run("B", 2, 400, profiled=False),
                run("A", 3, 1100)]
    path = str(tmp_path / "timeline_a_vs_b.png")
    assert compare_mfu.timeline_plot(path, all_runs, {"A": "main", "B": "pr"}, 3) == path
    assert open(path, "rb").read(8) == PNG_MAGIC
    assert compare_mfu.timeline_plot(str(tmp_path / "none.png"), all_runs[:1], {"A": "a", "B": "b"}, 3) is None
    assert "no run of side B has step intervals of step 3" in capsys.readouterr().out
    assert not (tmp_path / "none.png").exists()


def test_timeline_plot_labels_name_the_picked_run(tmp_path, monkeypatch):
    from graph_trainer.tools import timeline

    seen = {}
    monkeypatch.setattr(timeline, "timeline_a_vs_b", lambda path, a, b, labels: seen.update(a=a, b=b, labels=labels))
    for side, repeat, wall in (("A", 1, 900.0), ("A", 2, 1000.0), ("A", 3, 1100.0), ("B", 1, 500.0)):
        path = compare_mfu.profile_json(str(tmp_path / f"{side}{repeat}"), 3)
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as f:
            json.dump({"step_intervals": {"wall_ms": wall, "categories": [], "kernels": []}}, f)
    all_runs = [runs.Run(side=s, repeat=k, index=k, dump_folder=str(tmp_path / f"{s}{k}"), log="")
                for s, k in (("A", 3), ("A", 1), ("B", 1), ("A", 2))]
    compare_mfu.timeline_plot("x.png", all_runs, {"A": "main", "B": "pr"}, 3)
    assert seen["a"] == compare_mfu.profile_json(str(tmp_path / "A2"), 3)  # the median wall of A's three
    assert seen["labels"] == ("A2 main, median wall of 3 runs", "B1 pr")
