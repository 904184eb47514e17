"""scripts/bench_rmsnorm.py (the RMSNorm microbenchmark) in --tiny CPU mode, and its parsers."""

import json
import math
import subprocess
import sys

import pytest
from _launch import run_script
from _scripts import SCRIPTS, load_script

REQUIRED = ["eager", "make_fx", "regional", "regional[guarded]", "torch.compile"]
OPTIONAL = ["liger", "quack"]


def _run(tmp_path, *extra, forked=True, rc=0):
    argv = [str(SCRIPTS / "bench_rmsnorm.py"), "--tiny", "--json", str(out := tmp_path / "tmp.json"), *extra]
    proc = (run_script(argv, cwd=SCRIPTS.parent, timeout=600) if forked else
            subprocess.run([sys.executable, *argv], cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=600))
    assert proc.returncode == rc, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    return proc, report, {r["variant"]: r for r in report["results"]}


@pytest.mark.slow
def test_tiny_report(tmp_path):
    proc, report, by_name = _run(tmp_path)
    assert report["device_type"] == "cpu" and report["shapes"] == [[256, 128]] and report["torch"]
    assert math.isfinite(report["copy"]["GBps"]) and report["copy"]["GBps"] > 0
    assert set(by_name) == set(REQUIRED + OPTIONAL + ["copy (same bytes)"])
    same = by_name.pop("copy (same bytes)")  # the reference row: a copy that moves the norm's bytes
    assert same["pct_of_same_bytes_copy"] == 100.0 and same["GBps"] > 0
    assert by_name["eager"]["pct_of_same_bytes_copy"] == pytest.approx(100.0 * by_name["eager"]["GBps"] / same["GBps"])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| shape (M x N) | variant | ms | GB/s | % copy BW")
    for name in REQUIRED:  # each in the table
        assert any(f"| {name} |" in line for line in lines), name
        assert (r := by_name[name])["status"] == "ok", f"{name}: {r['reason']}"
        assert r["ms"] is not None and math.isfinite(r["ms"]) and r["ms"] > 0, name
        assert math.isfinite(r["GBps"]) and r["GBps"] > 0 and math.isfinite(r["pct_of_copy_bw"]), name
        assert set(r["max_abs_diff"]) == {"y", "dx", "dw"}, name
        assert r["rel_err"] <= report["tolerance"] and r["ok"] is True, f"{name}: rel_err {r['rel_err']}"
    for name in OPTIONAL:  # need CUDA: reported, not timed
        assert by_name[name]["status"] in ("ok", "unavailable"), by_name[name]["reason"]
    assert by_name["eager"]["max_abs_diff"] == {"y": 0.0, "dx": 0.0, "dw": 0.0}
    assert (regional := by_name["regional"])["inductor_configs"] == {}
    assert [regional["pass_stats"][k] for k in ("norms_forward", "norms_backward", "regions")] == [1, 1, 2]


@pytest.mark.slow
def test_tiny_residual_report(tmp_path):
    proc, report, by_name = _run(tmp_path, "--residual", "--variants", "eager,regional,liger",
                                 "--inductor-configs", "{}")
    assert report["residual"] and report["bytes_formula"].startswith("8*M*N")
    assert by_name["eager"]["max_abs_diff"] == {"y": 0.0, "dx": 0.0, "dw": 0.0}
    regional = by_name["regional"]
    assert regional["ok"] is True and regional["pass_stats"]["residual_adds"]["forward"] == 1
    assert regional["pass_stats"]["regions"] == 2
    assert by_name["liger"]["status"] == "unavailable" and "residual" in by_name["liger"]["reason"]
    assert "residual add + RMSNorm fwd+bwd" in proc.stdout


def test_parse_inductor_configs_and_a_bad_one_fails_the_run(tmp_path):
    _, _, by_name = _run(tmp_path, "--variants", "eager,regional", "--inductor-configs", 'bad={"not_a_key": 1}',
                         forked=False, rc=1)  # the script as a user starts it
    assert by_name["eager"]["status"] == "ok"
    assert by_name["regional[bad]"]["status"] == "failed" and "not_a_key" in by_name["regional[bad]"]["reason"]
    assert (mod := load_script("bench_rmsnorm")).parse_inductor_configs(None) == {"default": {}, "guarded": None}
    assert mod.parse_inductor_configs(["guarded"]) == {"guarded": None}
    got = mod.parse_inductor_configs(['{}', 'cdt={"coordinate_descent_tuning": true}', '{"a": 1}'])
    assert got == {"default": {}, "cdt": {"coordinate_descent_tuning": True}, "cfg2": {"a": 1}}
    assert [mod.regional_name(n) for n in got] == ["regional", "regional[cdt]", "regional[cfg2]"]
    for bad in ("x=[1]", "x=not json"):
        with pytest.raises(SystemExit):
            mod.parse_inductor_configs([bad])
    assert mod.parse_shapes("32768x4096, 16x8") == [(32768, 4096), (16, 8)]
