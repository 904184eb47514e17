"""Tests for scripts/ablate_inductor.py: one --tiny CPU run, CLI validation, helpers."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _scripts import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ablate_inductor.py"
ROWS = ["inductor", "inductor_no_all", "inductor_no_divisible_by_16",
        "inductor_no_persistent_reductions", "inductor_no_split_reductions"]  # fmt: skip
BENCHMARKS = ["train_step", "rmsnorm"]


def _load():
    return load_script("ablate_inductor")


def _run(*extra, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *extra], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate") / "report.json"
    proc = _run("--tiny", "--json", str(out))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc, json.loads(out.read_text())


def _table(stdout):
    rows = [line for line in stdout.splitlines() if line.startswith("|")]
    return rows[0], {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in rows[2:]}


@pytest.mark.slow
def test_tiny_has_every_row_in_order(tiny):
    proc, report = tiny
    assert report["device_type"] == "cpu" and report["benchmarks"] == BENCHMARKS
    assert [r["setting"] for r in report["rows"]] == ROWS
    header, body = _table(proc.stdout)
    assert header == "| setting | train_step | rmsnorm | geomean |"
    assert list(body) == ROWS


@pytest.mark.slow
def test_tiny_speedups_finite_or_knob_missing(tiny):
    proc, report = tiny
    _, body = _table(proc.stdout)
    for eager in report["eager_ms"].values():
        assert math.isfinite(eager) and eager > 0
    for row in report["rows"]:
        cells = body[row["setting"]]
        if row["status"] == "knob missing":
            assert row["missing"] and all(c.startswith("knob missing") for c in cells), row
            continue
        assert row["status"] == "ok" and row["missing"] == [], row
        for i, name in enumerate(BENCHMARKS):
            r = row["results"][name]
            assert r["status"] == "ok", r
            assert math.isfinite(r["speedup"]) and r["speedup"] > 0 and math.isfinite(r["ms"]) and r["ms"] > 0
            assert r["speedup"] == pytest.approx(report["eager_ms"][name] / r["ms"])
            assert r["rel_err"] <= report["tolerance"][name]
            assert r["kernels_generated"] > 0, "Inductor did not generate code: a cache hit?"
            assert cells[i] == f"{r['speedup']:.2f}x"


@pytest.mark.slow
def test_tiny_geomean_matches_speedups(tiny):
    proc, report = tiny
    _, body = _table(proc.stdout)
    for row in report["rows"]:
        if row["status"] != "ok":
            continue
        speedups = [row["results"][n]["speedup"] for n in BENCHMARKS]
        expected = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        assert row["geomean"] == pytest.approx(expected, rel=1e-12)
        assert min(speedups) <= row["geomean"] <= max(speedups)
        assert body[row["setting"]][-1] == f"{expected:.2f}x"


def test_unknown_setting_is_rejected():
    proc = _run("--tiny", "--settings", "inductor,inductor_no_magic", timeout=120)
    assert proc.returncode == 2
    assert "unknown setting(s) ['inductor_no_magic']" in proc.stderr
    assert "inductor_no_split_reductions" in proc.stderr  # lists the valid names
    assert "|" not in proc.stdout


def test_missing_knobs_reports_each_absent_key():
    mod = _load()
    full = SimpleNamespace(triton=SimpleNamespace(divisible_by_16=True, persistent_reductions=True), split_reductions=True)
    assert all(mod.missing_knobs(p, full) == [] for p in mod.SETTINGS.values())
    old = SimpleNamespace(triton=SimpleNamespace(persistent_reductions=True), split_reductions=True)
    assert mod.missing_knobs(mod.SETTINGS["inductor_no_all"], old) == ["triton.divisible_by_16"]
    assert mod.missing_knobs(mod.SETTINGS["inductor_no_split_reductions"], SimpleNamespace()) == ["split_reductions"]
    assert mod.missing_knobs(mod.SETTINGS["inductor_no_persistent_reductions"], SimpleNamespace()) == [
        "triton.persistent_reductions"]  # fmt: skip
    import torch._inductor.config as ic  # the installed torch: every knob of this script exists?

    for key in mod.SETTINGS["inductor_no_all"]:
        assert (key in mod.missing_knobs({key: False})) != hasattr(ic.triton if "." in key else ic, key.split(".")[-1])


def test_knob_missing_row_in_table():
    mod = _load()
    ok = {"status": "ok", "speedup": 2.0, "ms": 1.0}
    report = {
        "device": "cpu", "torch": "x", "timer": "t", "benchmarks": BENCHMARKS,
        "shapes": {n: "s" for n in BENCHMARKS}, "eager_ms": {n: 2.0 for n in BENCHMARKS},
        "rows": [
            {"setting": "inductor", "status": "ok", "missing": [], "results": {n: ok for n in BENCHMARKS}, "geomean": 2.0},
            {"setting": "inductor_no_divisible_by_16", "status": "knob missing", "missing": ["triton.divisible_by_16"],
             "results": {}, "geomean": None},
        ],
    }  # fmt: skip
    _, body = _table(mod.markdown_table(report))
    assert body["inductor"] == ["2.00x", "2.00x", "2.00x"]
    assert body["inductor_no_divisible_by_16"] == ["knob missing (triton.divisible_by_16)"] * 3
