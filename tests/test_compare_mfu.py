"""scripts/compare_mfu.py on a fake trainer tree (a git repo printing step lines) and on the real debug model."""

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from graph_trainer.tools import compare_mfu, profiling, runs, stats, timeline
from graph_trainer.tools.sides import Side, parse_cli

import _early  # tests/ is on sys.path
from _launch import REPO, run_script
from _runs import SMALL
from _scripts import git

SCRIPT = os.path.join(REPO, "scripts", "compare_mfu.py")
TINY = ["--compile.mode", "eager", *SMALL]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env(env):
    """``env`` without the launcher variables: a run's own config and world, never the caller's."""
    return {k: v for k, v in env.items() if k not in ("CONFIG_FILE", "CONFIG", "NGPU")}


ENV = _env(os.environ)

FAKE_TRAIN = r'''
import json, os, subprocess, sys, time
args = sys.argv[1:]
opt = lambda name, default: args[args.index(name) + 1] if name in args else default
steps, dump = int(opt("--training.steps", "10")), opt("--job.dump_folder", None)
tps = float(open("tps.txt").read()) * float(opt("--fake.scale", "1"))  # run_train.sh cds to the tree
os.makedirs(dump, exist_ok=True)
if "--fake.hang" in args:  # like torchrun: a worker in its own session, then wait
    worker = subprocess.Popen(["sleep", "300"], start_new_session=True)
    open(os.path.join(dump, "worker.pid"), "w").write(str(worker.pid))
    print("[rank0]: step:  1  loss:  8.00000  grad_norm: 1.0  tps: 100  mfu: n/a", flush=True)
    time.sleep(300)
if "--fake.usererror" in args:
    print("[rank0]:error: pass list conflicts with --fake.x", flush=True)
    sys.exit(2)
with open(os.path.join(dump, "metrics.jsonl"), "w") as f:
    for step in range(1, steps + 1):  # step 1 (trace and compile) is slow
        row = dict(step=step, loss=8.0 - 0.1 * step, tps=tps / 10 if step == 1 else tps, tflops=0.1, memory_gib=1.5)
        f.write(json.dumps(row) + "\n")
        print(f"[rank0]:[graph_trainer] - INFO - step: {step:2}  loss: {row['loss']:8.5f}  grad_norm:  1.0000  "
              f"memory: 1.50GiB  tps: {round(row['tps']):,}  tflops: 0.10  mfu: n/a  step_time: 1.000s", flush=True)
'''
FAKE_CONFIG = r'''
import sys
if bad := [a for a in sys.argv if a.startswith("--fake.bad")]:
    print(f"error: unrecognized option {bad[0]}", file=sys.stderr)
    sys.exit(2)
'''


def _compare(*args, env=ENV):  # forked from tests/_launch.py's server (its imports done)
    return run_script([SCRIPT, *args], env=env, cwd=REPO, timeout=400)


@pytest.fixture
def fake_repo(tmp_path):
    """A git repo with two commits: HEAD~1 runs at 1000 tps, HEAD at 1100 tps."""
    root = tmp_path / "fake"
    files = {"graph_trainer/__init__.py": "", "graph_trainer/config.py": FAKE_CONFIG, "tps.txt": "1000",
             "train_configs/debug_model.toml": "[job]\n", "fake_train.py": FAKE_TRAIN,
             "run_train.sh": '#!/usr/bin/env bash\ncd "$(dirname "$0")"\nexec python3 fake_train.py "$@"\n'}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        git(root, *args)
    (root / "tps.txt").write_text("1100")
    git(root, "commit", "-q", "-am", "faster")
    return root


def _fake(fake_repo, rc, args):  # into cmp/ beside the fake repo
    r = _compare("--repo", str(fake_repo), *shlex.split(args), "--out", str(out := fake_repo.parent / "cmp"))
    assert r.returncode == rc, r.stdout + r.stderr
    return r, json.loads((out / "comparison.json").read_text())


def test_fake_refs_alternate_and_real_delta(fake_repo, tmp_path):
    out = tmp_path / "cmp"
    r, data = _fake(fake_repo, 0, "--a HEAD~1 --b HEAD --repeats 2 --steps 5 --warmup 2")
    assert [(x["side"], x["repeat"], x["status"]) for x in data["runs"]] == [(s, i, "ok") for i in (1, 2) for s in "AB"]
    assert data["runs"][0]["stats"]["steady_steps"] == [3, 4, 5]  # steps 1..warmup excluded
    assert all("--metrics.log_freq" in x["cmd"] and x["dump_folder"].startswith(str(out)) for x in data["runs"])
    assert [data["table"]["sides"][s]["tps"]["median"] for s in "AB"] == pytest.approx([1000, 1100])
    assert (d := data["table"]["delta_b_vs_a"])["tps"]["pct"] == pytest.approx(10.0)
    assert [d[k]["verdict"] for k in ("tps", "mfu", "memory_gib")] == ["real", "n/a", "no change"]
    assert data["sides"]["A"]["commit"] != data["sides"]["B"]["commit"] and data["sides"]["B"]["worktree"]
    assert not os.path.exists(data["sides"]["A"]["tree"])  # each ref side ran its own commit, from a worktree gone now
    assert len(git(fake_repo, "worktree", "list").strip().splitlines()) == 1
    assert all(s in r.stdout for s in ("| Δ B vs A | +10.00% (real, spread 0.00%)", "step 5/5", "MFU n/a"))  # progress
    assert open(out / "tps_per_step.png", "rb").read(8) == PNG_MAGIC


def test_fake_same_commit_on_both_sides_shares_one_worktree_and_one_repeat_has_no_spread(fake_repo):
    head = git(fake_repo, "rev-parse", "HEAD").strip()
    r, data = _fake(fake_repo, 0, "--a HEAD --b HEAD --b-flags '--fake.scale 0.5' --repeats 1 --steps 2 --warmup 0")
    assert all(data["sides"][s]["commit"] == head and data["sides"][s]["worktree"] for s in "AB")
    assert data["sides"]["A"]["tree"] == data["sides"]["B"]["tree"]  # one worktree per commit
    assert f"| A: HEAD@{head[:8]} (1/1 runs) |" in r.stdout
    assert f"| B: HEAD@{head[:8]} + --fake.scale 0.5 (1/1 runs) |" in r.stdout
    assert "-50.00% (spread unknown: 1 repeat)" in r.stdout and "spread unknown with 1 repeat" in r.stdout
    assert data["table"]["delta_b_vs_a"]["tps"]["spread_pct"] is None


def test_fake_input_error_skips_the_remaining_repeats_of_that_side_and_failure_causes(fake_repo, tmp_path):
    r, data = _fake(fake_repo, 1, "--a-flags --fake.usererror --b-flags '' --repeats 3 --steps 2 --warmup 0")
    assert [(x["side"], x["status"]) for x in data["runs"]] == [
        ("A", "failed"), ("B", "ok"), ("A", "skipped"), ("B", "ok"), ("A", "skipped"), ("B", "ok")]
    assert data["runs"][0]["error"] == "exit code 2: pass list conflicts with --fake.x"
    assert "A1 failed on an input error" in data["runs"][2]["error"]
    assert data["table"]["runs_ok"] == {"A": 0, "B": 3} and data["ok"] is False
    assert data["table"]["sides"]["B"]["tps"]["median"] == pytest.approx(1100)
    assert "last 40 lines" in r.stdout and "| [rank0]:error: pass list conflicts" in r.stdout  # the tail
    assert "| A: working tree + --fake.usererror (0/3 runs) | failed |" in r.stdout
    assert "3 run(s) failed or skipped" in r.stderr
    log = tmp_path / "run.log"  # the cause of a failure, in a log
    log.write_text("[rank0]:Traceback (most recent call last):\n[rank0]:RuntimeError: fake failure at step 2\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \nValueError: not this\n")
    assert runs.failure_cause(str(log)) == ("RuntimeError: fake failure at step 2", False)
    log.write_text("step: 1\n[rank1]:error: --compile.passes: unknown pass 'x'\nRuntimeError: later\n")
    assert runs.failure_cause(str(log)) == ("--compile.passes: unknown pass 'x'", True)
    assert runs.failure_cause(str(tmp_path / "none.log")) == (None, False)


@pytest.mark.slow
def test_dirty_tree_with_head_ref_is_rejected(fake_repo, tmp_path):
    (fake_repo / "tps.txt").write_text("5000")  # uncommitted change
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a", "HEAD~1", "--b", "HEAD", "--out", str(out))
    assert r.returncode == 2 and "--b HEAD is HEAD" in r.stderr and "commit or stash" in r.stderr.lower()
    assert "flags-only sides" in r.stderr and "tps.txt" in r.stderr and not out.exists()
    for args in (["--a", "HEAD~1"], ["--a", "HEAD~1", "--b", "HEAD", "--allow-dirty"]):  # fine: not HEAD, or allowed
        r = _compare("--repo", str(fake_repo), *args, "--dry-run", "--out", str(out))
        assert r.returncode == 0 and "would run" in r.stdout and not out.exists(), r.stderr


def _alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_fake_timeout_kills_the_run_and_its_workers(fake_repo):
    a, b = _fake(fake_repo, 1, "--a-flags '' --b-flags --fake.hang --repeats 1 --steps 2 --warmup 0 "
                 "--run-timeout 3")[1]["runs"]
    assert a["status"] == "ok" and b["status"] == "failed" and "timed out after 3s" in b["error"]
    assert not _alive(int(open(os.path.join(b["dump_folder"], "worker.pid")).read()))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])  # Ctrl-C, and `timeout` around the script
def test_fake_ctrl_c_reports_finished_runs(fake_repo, tmp_path, signame):
    """Signalled at B1's step 1 (its worker.pid is written before): A1 is reported, B1 stopped."""
    out, args = tmp_path / "cmp", "--a-flags '' --b-flags --fake.hang --repeats 2 --steps 2 --warmup 0"
    p = subprocess.Popen([sys.executable, SCRIPT, "--repo", str(fake_repo), *shlex.split(args), "--out", str(out)],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,  # SIGINT's default
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as under a terminal
    bound, lines = threading.Timer(240, p.kill), []  # the bound: for a broken tool only
    bound.start()
    try:
        for line in p.stdout:  # B1 hangs until signalled, so its step-1 line comes before the end
            lines.append(line)
            if line.startswith("[2/4] B1 (") and " step 1/2 " in line:
                p.send_signal(getattr(signal, signame))
        p.wait()
    finally:
        bound.cancel()
    stdout = "".join(lines)
    assert p.returncode == 130 and "interrupted; reporting the finished runs" in stdout, stdout
    data = json.loads((out / "comparison.json").read_text())
    assert [(x["side"], x["status"]) for x in data["runs"]] == [
        ("A", "ok"), ("B", "interrupted"), ("A", "pending"), ("B", "pending")]
    assert data["ok"] is False and data["table"]["runs_ok"] == {"A": 1, "B": 0}
    assert "| B: working tree + --fake.hang (0/2 runs) | interrupted |" in stdout
    assert not _alive(int((out / "runs" / "B1" / "worker.pid").read_text()))


def test_ctrl_c_while_a_run_starts_stops_it(tmp_path, monkeypatch, request):
    """A Ctrl-C the moment ``Popen`` has started the run: it is stopped, not left behind."""
    started = []

    class PopenThenCtrlC(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(runs.subprocess, "Popen", PopenThenCtrlC)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as under a terminal
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    side = Side(name="B", ref=None, flags=[], root=str(tmp_path), config_file="none.toml")
    run = runs.Run(side="B", repeat=1, index=1, dump_folder=str(tmp_path / "B1"), log=str(tmp_path / "B1.log"),
                   cmd=[sys.executable, "-c", "import time; time.sleep(30)"])  # 30 s: a bound if it were not stopped
    with pytest.raises(KeyboardInterrupt):
        runs.execute(run, side, 2, 0, "[B1]", False, None, runs.Progress(io.StringIO()))
    assert len(started) == 1 and started[0].poll() is not None  # stopped and reaped


def test_bad_flag_on_one_side_is_rejected_before_any_run(fake_repo, tmp_path):
    """A: HEAD~1, B: --fake.bad 1 (the real tree's config parser rejecting a flag: tests/test_bench.py)."""
    out = tmp_path / "cmp"
    r = _compare("--repo", str(fake_repo), "--a", "HEAD~1", "--b-flags", "--fake.bad 1", "--out", str(out))
    assert r.returncode == 2 and "side B" in r.stderr and "side A" not in r.stderr, r.stdout + r.stderr
    assert "unrecognized option --fake.bad" in r.stderr and "validating" in r.stdout and "step 1" not in r.stdout
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [
    (["--a-flags", "", "--", "--training.steps", "5"], "use --steps instead"),
    (["--a-flags", "--job.dump_folder=/tmp/x"], "use --out instead"),
    (["--a-flags", "", "--steps", "3", "--warmup", "3"], "leaves no step to measure"),
    (["--a-flags", "", "--steps", "5", "--profile-step", "6"], "--profile-step must be in 2..--steps (5)"),
    (["--steps", "5"], "nothing to compare"),
    (["--a-flags", "'unbalanced"], "not a valid shell-quoted string"),
    (["--a", "no-such-branch-xyz", "--", *TINY], "unknown git ref 'no-such-branch-xyz'"),
])
def test_usage_errors(args, needle, tmp_path):
    r = _compare("--out", str(tmp_path / "cmp"), *args)  # before `args`: never an argument after --
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "cmp").exists()


@_early.job("compare_mfu_real_head_ref")
def _real_head_ref(tmp, env):  # A: HEAD (outside git: the working tree)
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = tmp / "cmp"
    return head, out, _compare(*(["--a", "HEAD", "--allow-dirty"] if head else ["--a-flags", ""]),
                               "--b-flags", "--training.max_norm 0.5", "--repeats", "1", "--steps", "4",
                               "--warmup", "0", "--profile-step", "2", "--out", str(out), "--", *TINY, env=_env(env))


@_early.uses("compare_mfu_real_head_ref")
def test_real_head_ref_against_working_tree_flags():
    head, out, r = _early.result("compare_mfu_real_head_ref")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"| A: {f'HEAD@{head[:8]}' if head else 'working tree'} (1/1 runs) |" in r.stdout
    assert "| B: working tree + --training.max_norm 0.5 (1/1 runs) |" in r.stdout
    data = json.loads((out / "comparison.json").read_text())
    if head:
        assert data["sides"]["A"]["commit"] == head and data["sides"]["A"]["worktree"]
        assert data["sides"]["A"]["tree"] not in git(REPO, "worktree", "list", "--porcelain")
    for x in data["runs"]:
        assert x["status"] == "ok" and [row["step"] for row in x["rows"]] == [1, 2, 3, 4]
        assert x["stats"]["steady_steps"] == [4]  # steps 1..3: the profiler's on step 2
        assert x["stats"]["tps"] > 0 and x["stats"]["mfu"] is None and x["stats"]["memory_gib"] > 0  # CPU: no MFU
    assert data["table"]["delta_b_vs_a"]["tps"]["pct"] is not None and data["settings"]["excluded_steps"] == [1, 2, 3]
    k = data["kernels"]  # --profile-step 2: kernel time by category and the step timeline, A vs B
    assert k["step"] == 2 and k["unit"] == "CPU" and k["runs"] == {"A": 1, "B": 1}
    assert 0 < k["sides"]["A"]["matmul"] <= k["sides"]["A"]["total"] and k["sides"]["B"]["matmul"] > 0
    assert all(s in r.stdout for s in ("CPU ms of step 2 by kernel category", "| matmul |", "| nothing running |"))
    assert all(0 < t["compute_ms"] <= t["wall_ms"] for t in k["timeline"].values())
    assert f"step 2 timeline, A above B: {out / 'timeline_a_vs_b.png'}" in r.stdout
    folder = out / "runs" / "B1" / "profile_traces" / "iteration_2"  # what --profiling.* wrote for B1's step 2
    pngs = (out / data["plot"], out / data["timeline_plot"], folder / "rank0_timeline.png")
    assert [open(png, "rb").read(8) for png in pngs] == [PNG_MAGIC] * 3
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank0_kernels.json", "rank0_kernels.md", "rank0_timeline.png", "rank0_trace.json"]
    assert json.loads((folder / "rank0_trace.json").read_text())["traceEvents"]
    summary = json.loads((folder / "rank0_kernels.json").read_text())
    assert summary["step"] == 2 and summary["categories"]["matmul"]["calls"] > 0
    kernels, step = timeline.unpack_step(summary["step_intervals"])  # the step's kernels: the same breakdown
    assert summary["step_intervals"]["step"] == 2 and len(kernels) > 100
    again = timeline.timeline_breakdown(kernels, [step])  # times rounded to 0.1 us
    assert {key: again[key] for key in summary["timeline"]} == pytest.approx(summary["timeline"], abs=0.05)


def test_run_stats_delta_verdicts_and_table():
    rows = [{"step": i + 1, "tps": tps, "mfu": None, "memory_gib": mem}
            for i, (tps, mem) in enumerate([(1.0, 0.5), (50.0, 1.0), (100.0, 2.0), (120.0, 1.0), (110.0, 1.0)])]
    assert (s := stats.run_stats(rows, warmup=0))["steady_steps"] == [2, 3, 4, 5] and s["tps"] == 105.0
    s = stats.run_stats(rows, warmup=2)
    assert s["steady_steps"] == [3, 4, 5] and s["tps"] == 110.0 and s["mfu"] is None and s["memory_gib"] == 2.0  # max
    s = stats.run_stats(rows, warmup=0, exclude=stats.profiler_steps(3))  # its warm-up, step and trace export
    assert s["steady_steps"] == [5] and s["tps"] == 110.0 and stats.profiler_steps(None) == ()
    def side(*runs):  # (tps, tflops, mfu) per run, 30 GiB each
        return stats.side_stats([{"tps": t, "tflops": f, "mfu": m, "memory_gib": 30.0} for t, f, m in runs])

    a, b = side((100.0, 1.0, 10.0), (102.0, 1.02, 10.2)), side((110.0, 1.1, 10.0), (111.0, 1.11, 10.4))
    assert a["tps"]["spread_pct"] == pytest.approx(2 / 101 * 100)
    d = stats.delta(a, b)
    assert d["tps"]["verdict"] == "real" and d["tps"]["pct"] == pytest.approx((110.5 - 101) / 101 * 100)
    assert d["mfu"]["verdict"] == "within noise" and d["memory_gib"]["verdict"] == "no change"  # mfu +0.99% vs 3.9%
    assert stats.delta(side((100.0, 1.0, 10.0)), b)["tps"]["verdict"] == "spread unknown: a side has 1 successful run"
    md = stats.markdown_table({"A": "main", "B": "pr"}, {"A": a, "B": b}, d, {"A": 2, "B": 2}, 2)
    assert ("| A: main (2/2 runs) | 101 (100–102) | 1.01 (1.00–1.02) | 10.10% (10.00–10.20) "
            "| 30.00 GiB (30.00–30.00) |") in md and "+9.41% (real, spread 1.98%)" in md
    line = stats.one_liner({"A": "main", "B": "pr"}, {"A": a, "B": b}, {"A": 2, "B": 2})
    assert line.startswith("A (main): 101 tps, 1.01 tflops, 10.10% MFU, 30.00 GiB — B (pr): ")


def test_flag_values_that_look_like_options_and_step_line_regex():
    args, extra = parse_cli(compare_mfu.build_parser(), ["--b-flags=--x 1", "--a", "main", "--", "--compile.mode"])
    assert args.b_flags == "--x 1" and args.a == "main" and extra == ["--compile.mode"]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S,358")  # the trainer's logging format
    m = runs.STEP_RE.search(f"[rank0]:[graph_trainer] {stamp} - INFO - step:  1  loss:  8.10024  grad_norm:  1.9553  "
                            "memory: 0.66GiB  tps: 6,538  tflops: 0.00  mfu: 38.29%  step_time: 4.246s")
    assert m and m.group("step") == "1" and m.group("tps") == "6,538" and m.group("mfu") == "38.29%"


def _profiled(tmp_path, name, step, summary):
    run = runs.Run(side=name[0], repeat=int(name[1]), index=int(name[1]), dump_folder=str(tmp_path / name), log="")
    if summary is not None:
        os.makedirs(os.path.dirname(path := stats.profile_json(run.dump_folder, step)))
        with open(path, "w") as f:
            json.dump(summary, f)
    return run


def test_timeline_plot_draws_the_median_run_of_each_side(tmp_path, capsys, monkeypatch):
    all_runs = [_profiled(tmp_path, name, 3, wall and {"step": 3, "unit": "CPU", "step_intervals": timeline.pack_step(
                    [(0, wall / 2, "matmul"), (wall / 4, wall, "communication")], (0, wall), 3)})
                for name, wall in (("A3", 1100), ("B1", 500), ("A1", 900), ("B2", None), ("A2", 1000))]  # B2: none
    seen = {}  # drawing: the real runs' test and tests/test_profiling.py
    monkeypatch.setattr(timeline, "timeline_a_vs_b", lambda path, a, b, labels: seen.update(a=a, labels=labels))
    assert compare_mfu.timeline_plot("none.png", all_runs[:1], {"A": "a", "B": "b"}, 3) is None and not seen
    assert "no run of side B has step intervals of step 3" in capsys.readouterr().out
    assert compare_mfu.timeline_plot("x.png", all_runs, {"A": "main", "B": "pr"}, 3) == "x.png"
    assert seen["a"] == stats.profile_json(str(tmp_path / "A2"), 3)  # the median wall of A's three
    assert seen["labels"] == ("A2 main, median wall of 3 runs", "B1 pr")


def test_kernel_comparison_names_the_kernels_that_moved_but_inductors(tmp_path):
    def profile(name, kernels):
        return _profiled(tmp_path, name, 8, profiling.summarize_events([(k, ms * 1e3, 2) for k, ms in kernels], 1))

    gemm_nt, gemm_tn, flash = "nvjet_tst_128x256_NNT", "nvjet_tst_128x256_TNT", "flash_bwd_kernel<128>"
    softmax = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>"  # eager's, "other"
    found = [profile("A1", [(gemm_nt, 10.0), (flash, 5.0), (softmax, 4.0), ("triton_poi_fused_0", 3.0)]),
             profile("A2", [(gemm_nt, 12.0), (flash, 5.0), (softmax, 4.0)]),
             profile("B1", [(gemm_tn, 11.0), (gemm_nt, 2.0), (flash, 6.5), ("triton_poi_fused_7", 9.0)])]
    k = stats.kernel_comparison(found, {"A": "jit", "B": "full"}, 8, per_kernel=3)
    assert [r["name"] for r in k["per_kernel"]] == [gemm_tn, gemm_nt, softmax]  # +11, -9, -4; flash +1.5: the 4th
    assert k["per_kernel"][1]["A"] == {"ms": 11.0, "calls": 2} and k["per_kernel"][0]["A"]["ms"] == 0
    assert f"| `{gemm_tn}` | matmul | 0.00 (0) | 11.00 (2) | +11.00 |" in k["markdown"]
    assert f"| `{softmax}` | other | 4.00 (2) | 0.00 (0) | -4.00 |" in k["markdown"] and "triton_poi" not in k["markdown"]
