"""scripts/bench.py: variants, statistics, table, records never overwritten, bad input, one CPU run."""

import json
import os

import pytest

from graph_trainer.tools import bench
from graph_trainer.tools.bench import parse_variants, table, variant_results, write_record
from graph_trainer.tools.runs import Run, next_run_s
from graph_trainer.tools.sides import CompareError, Side, child_env, git_state
from graph_trainer.tools.stats import run_stats

from _launch import run_script  # tests/ is on sys.path
from _runs import SMALL, launch_env
from _scripts import git


def test_parse_variants_and_bad_input_exits_2_before_any_run(tmp_path, capsys):
    assert parse_variants(["jit=--compile.mode jit", "plain=", "c=NCCL_MAX_CTAS=8 A_B='x y' --x 1"]) == [
        ("jit", ["--compile.mode", "jit"], {}), ("plain", [], {}),
        ("c", ["--x", "1"], {"NCCL_MAX_CTAS": "8", "A_B": "x y"})]
    assert child_env(Side("c", None, [], env={"NCCL_MAX_CTAS": "8"}))["NCCL_MAX_CTAS"] == "8"  # what its runs see
    for bad, msg in [(["plain"], "NAME=FLAGS"), (["a=", "a=--x 1"], "twice"), (["a=--x '1"], "shell-quoted"),
                     (["a=--training.steps 3"], "training.steps"), (["a=CONFIG_FILE=x.toml"], "the call's")]:
        with pytest.raises(CompareError, match=msg):
            parse_variants(bad)
    assert bench.main(["--variant", "plain", "--out", str(tmp_path / "o")]) == 2
    assert "NAME=FLAGS" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert bench.main(["--variant", "plain=--compile.mode fast", "--out", str(tmp_path / "o2"), "--no-record"]) == 2
    assert "fast" in capsys.readouterr().err


def test_git_state_names_the_working_tree_as_a_commit_would_hold_it(tmp_path):
    """Untracked files count, ignored ones do not; the index and the files stay as they were."""
    assert git_state(str(tmp_path)) == {"git_sha": None, "git_tree": None, "git_dirty": False}  # not a repository
    (tmp_path / ".gitignore").write_text("*.whl\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        git(tmp_path, *args)
    base = git(tmp_path, "rev-parse", "HEAD")
    clean = git_state(str(tmp_path))
    assert clean == {"git_sha": base, "git_tree": git(tmp_path, "rev-parse", "HEAD^{tree}"), "git_dirty": False}
    (tmp_path / "a.py").write_text("a = 2\n")
    (tmp_path / "new_pass.py").write_text("b = 1\n")
    (tmp_path / "x.whl").write_bytes(b"wheel")
    status = git(tmp_path, "status", "--porcelain")
    state = git_state(str(tmp_path))
    assert git(tmp_path, "status", "--porcelain") == status and (tmp_path / "a.py").read_text() == "a = 2\n"
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "the tree that ran")
    assert state == {"git_sha": base, "git_tree": git(tmp_path, "rev-parse", "HEAD^{tree}"), "git_dirty": True}


def _run(name, rnd, tps, status="ok", predicted=None):
    rows = [{"step": s, "tps": tps if s > 1 else 1.0, "tflops": 1.0, "mfu": 40.0, "memory_gib": 10.0 + rnd}
            for s in (1, 2, 3)]
    r = Run(side=name, repeat=rnd, index=rnd, dump_folder="", log="", status=status, step2_s=130.0 - 40.0 * rnd)
    if status == "ok":
        r.rows, r.stats = rows, run_stats(rows, 1)
        r.summary = {"predicted_peak_gib": predicted, "compile_time_s": 30.0 if predicted else None}
    return r


def test_variant_results_ratio_verdict_and_table():
    runs = [_run("jit", 1, 100.0), _run("plain", 1, 120.0, predicted=9.5), _run("bad", 1, 0, status="failed"),
            _run("jit", 2, 102.0), _run("plain", 2, 121.0, predicted=9.7), _run("bad", 2, 0, status="failed")]
    v = {x["name"]: x for x in variant_results(["jit", "plain", "bad"], runs)}
    assert v["jit"]["ratio"] == 1.0 and v["jit"]["verdict"] == "baseline"
    assert v["plain"]["ratio"] == pytest.approx(120.5 / 101.0) and v["plain"]["verdict"] == "real"
    assert v["plain"]["predicted_peak_gib"] == pytest.approx(9.6) and v["plain"]["memory_gib"]["max"] == 12.0
    assert v["bad"]["ratio"] is None and v["bad"]["tps"]["n"] == 0
    text = table(list(v.values()))
    assert "| plain (2 runs) | 120 (120–121) | 1.193× | real | 40.0 % | 12.00 | 9.60 | 30 | 90 / 50 |" in text
    assert "| bad (0 runs) | failed |" in text


def test_deadline_estimate_of_a_variant_next_run():
    """A first, cold run scaled by the later/first ratio of the variants that ran twice (never up); later: the last."""
    walls = {"jit": [85.0, 72.0], "plain": [117.0], "full": [174.0]}
    assert next_run_s(walls, "plain") == pytest.approx(117.0 * 72.0 / 85.0)
    assert next_run_s(walls, "jit") == 72.0 and next_run_s(walls, "new") == 0.0
    assert next_run_s({"a": [50.0, 60.0], "b": [100.0]}, "b") == 100.0  # a slower second run never raises it
    assert next_run_s({"a": [50.0], "b": [100.0]}, "b") == 100.0  # nothing ran twice yet


@pytest.mark.slow
def test_bench_debug_model_writes_a_record(tmp_path):
    r = run_script(["scripts/bench.py", "--variant", "eager=GT_VARIANT_ENV=1 --compile.mode eager", "--repeats", "1",
                    "--steps", "4", "--warmup", "1", "--profile-step", "2", "--workload", "debug one", "--record-dir",
                    str(tmp_path / "results"), "--out", str(tmp_path / "o"), "--", *SMALL],
                   env=launch_env(), timeout=900)  # forked from tests/_launch.py's server, CPU only
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| eager (1 runs) |" in r.stdout
    path = next((tmp_path / "results").glob("*.json"))
    rec = json.loads(path.read_text())
    assert rec["profile_png"] == [f"{path.stem}_eager.png"]
    (rank0,) = rec["profile"]["variants"]["eager"]  # one rank: rank 0 is also the one with the most compute
    assert rec["profile"]["step"] == 2 and rank0["rank"] == 0 and 0 < rank0["compute_ms"] <= rank0["wall_ms"]
    rows = [json.loads(x) for x in open(os.path.join(rec["runs"][0]["dump_folder"], "metrics.jsonl"))]
    assert rec["runs"][0]["step_time_s"] == rows[3]["step_time_s"] > 0  # the median of step 4 alone: not profiled
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == sorted([path.name, *rec["profile_png"]])
    assert rec["kind"] == "bench" and rec["workload"] == "debug one" and rec["device"] == "cpu"
    assert isinstance(rec["git_dirty"], bool) and len(rec["git_tree"]) == 40  # tracked files changed; what ran
    assert rec["command"].startswith("scripts/bench.py --variant 'eager=GT_VARIANT_ENV=1 --compile.mode eager'")
    assert "--training.seq_len 64" in rec["command"]
    (v,), (run,) = rec["variants"], rec["runs"]  # one variant, one run: no warm start (step2_later_s)
    assert v["name"] == "eager" and v["flags"] == ["--compile.mode", "eager"] and v["env"] == {"GT_VARIANT_ENV": "1"}
    assert v["ratio"] == 1.0 and v["step2_later_s"] is None and run["status"] == "ok" and run["tps"] > 0
    assert 0 < run["step2_s"] == v["step2_first_s"] < run["wall_s"]


def test_records_never_overwritten_and_an_interrupted_call_records_its_finished_runs(tmp_path, monkeypatch, capsys):
    """Records never overwritten; SIGTERM / Ctrl-C after run 1: exit 130, the table, a noted record of run 1."""
    rec = {"workload": "llama3_1b fsdp2", "date": "2026-11-27"}
    paths = [write_record(str(tmp_path / "w"), rec) for _ in range(3)]
    assert [os.path.basename(p) for p in paths] == [f"2026-11-27_llama3_1b_fsdp2{n}.json" for n in ("", "_2", "_3")]
    assert json.loads(open(paths[0]).read()) == rec
    timed = write_record(str(tmp_path / "w"), {**rec, "time": "23:05"})
    assert os.path.basename(timed) == "2026-11-27_2305_llama3_1b_fsdp2.json"

    def first_ok_then_interrupted(runs, *args, **kwargs):
        runs[0].status, runs[0].wall_s = "ok", 1.0
        runs[0].stats = run_stats([{"step": s, "tps": 100.0, "mfu": 1.0, "memory_gib": 1.0} for s in (1, 2, 3)], 1)
        runs[1].status = "interrupted"
        os.makedirs(tmp_path / "o")
        return True

    monkeypatch.setattr(bench, "validate_sides", lambda *a: None)
    monkeypatch.setattr(bench, "run_all", first_ok_then_interrupted)
    argv = ["--variant", "a=", "--variant", "b=--compile.mode eager", "--repeats", "1", "--out", str(tmp_path / "o"),
            "--record-dir", str(tmp_path / "results"), "--note", "n"]
    assert bench.main(argv) == 130 and "| a (1 runs) |" in capsys.readouterr().out
    rec = json.loads(next((tmp_path / "results").glob("*.json")).read_text())
    assert rec["note"] == "n; interrupted after 1 of 2 runs"
    assert [r["status"] for r in rec["runs"]] == ["ok", "interrupted"] and rec["runs"][0]["tps"] == 100.0
