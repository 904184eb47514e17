"""Tests for scripts/bench_rmsnorm.py (the RMSNorm microbenchmark), in --tiny CPU mode."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _scripts import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_rmsnorm.py"
REQUIRED = ["eager", "make_fx", "regional", "regional[guarded]", "torch.compile"]
OPTIONAL = ["liger", "quack"]


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "tmp.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json", str(out), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc, report


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    proc, report = _run(tmp_path_factory.mktemp("bench_rmsnorm"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc, report


@pytest.mark.slow
def test_tiny_report_has_every_variant(tiny):
    proc, report = tiny
    assert report["device_type"] == "cpu"
    assert report["shapes"] == [[256, 128]]
    assert report["torch"]
    assert math.isfinite(report["copy"]["GBps"]) and report["copy"]["GBps"] > 0
    by_name = {r["variant"]: r for r in report["results"]}
    assert set(by_name) == set(REQUIRED + OPTIONAL)
    tol = report["tolerance"]
    for name in REQUIRED:
        r = by_name[name]
        assert r["status"] == "ok", f"{name}: {r['reason']}"
        assert r["ms"] is not None and math.isfinite(r["ms"]) and r["ms"] > 0, name
        assert math.isfinite(r["GBps"]) and r["GBps"] > 0, name
        assert math.isfinite(r["pct_of_copy_bw"]), name
        assert set(r["max_abs_diff"]) == {"y", "dx", "dw"}, name
        assert r["rel_err"] <= tol and r["ok"] is True, f"{name}: rel_err {r['rel_err']} > {tol}"
    for name in OPTIONAL:  # need CUDA: reported, not timed
        assert by_name[name]["status"] in ("ok", "unavailable"), by_name[name]["reason"]
    assert by_name["eager"]["max_abs_diff"] == {"y": 0.0, "dx": 0.0, "dw": 0.0}


@pytest.mark.slow
def test_tiny_regional_compiles_one_region_per_norm(tiny):
    _, report = tiny
    r = next(r for r in report["results"] if r["variant"] == "regional")
    assert r["inductor_configs"] == {}
    stats = r["pass_stats"]
    assert stats["norms_forward"] == 1 and stats["norms_backward"] == 1
    assert stats["regions"] == 2


@pytest.mark.slow
def test_tiny_markdown_table(tiny):
    proc, _ = tiny
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| shape (M x N) | variant | ms | GB/s | % copy BW")
    for name in REQUIRED:
        assert any(f"| {name} |" in line for line in lines), name


def test_bad_inductor_config_fails_the_run(tmp_path):
    proc, report = _run(tmp_path, "--variants", "eager,regional", "--inductor-configs", 'bad={"not_a_key": 1}')
    assert proc.returncode == 1
    by_name = {r["variant"]: r for r in report["results"]}
    assert by_name["eager"]["status"] == "ok"
    assert by_name["regional[bad]"]["status"] == "failed"
    assert "not_a_key" in by_name["regional[bad]"]["reason"]


def _load_script():
    return load_script("bench_rmsnorm")


def test_parse_inductor_configs():
    mod = _load_script()
    assert mod.parse_inductor_configs(None) == {"default": {}, "guarded": None}
    assert mod.parse_inductor_configs(["guarded"]) == {"guarded": None}
    got = mod.parse_inductor_configs(['{}', 'cdt={"coordinate_descent_tuning": true}', '{"a": 1}'])
    assert got == {"default": {}, "cdt": {"coordinate_descent_tuning": True}, "cfg2": {"a": 1}}
    assert [mod.regional_name(n) for n in got] == ["regional", "regional[cdt]", "regional[cfg2]"]
    with pytest.raises(SystemExit):
        mod.parse_inductor_configs(["x=[1]"])
    with pytest.raises(SystemExit):
        mod.parse_inductor_configs(["x=not json"])
    assert mod.parse_shapes("32768x4096, 16x8") == [(32768, 4096), (16, 8)]
