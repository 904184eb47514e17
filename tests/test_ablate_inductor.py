"""scripts/ablate_inductor.py: one --tiny CPU run, CLI validation, helpers."""

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
from _scripts import SCRIPTS, load_script, table

ROWS = ["inductor", "inductor_no_all", "inductor_no_divisible_by_16", "inductor_no_persistent_reductions",
        "inductor_no_split_reductions"]
BENCHMARKS = ["train_step", "rmsnorm"]


def _run(*extra, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPTS / "ablate_inductor.py"), *extra], cwd=SCRIPTS.parent,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_tiny_run(tmp_path):
    """Every row in order; each speedup finite (or the knob reported missing), numerics within
    tolerance, code generated; the geomean of each row; the table matches the JSON."""
    proc = _run("--tiny", "--json", str(tmp_path / "report.json"))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["device_type"] == "cpu" and report["benchmarks"] == BENCHMARKS
    assert [r["setting"] for r in report["rows"]] == ROWS
    header, body = table(proc.stdout)
    assert header == "| setting | train_step | rmsnorm | geomean |" and list(body) == ROWS
    assert all(math.isfinite(eager) and eager > 0 for eager in report["eager_ms"].values())
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
        speedups = [row["results"][n]["speedup"] for n in BENCHMARKS]
        expected = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        assert row["geomean"] == pytest.approx(expected, rel=1e-12)
        assert min(speedups) <= row["geomean"] <= max(speedups) and cells[-1] == f"{expected:.2f}x"


def test_unknown_setting_is_rejected():
    proc = _run("--tiny", "--settings", "inductor,inductor_no_magic", timeout=120)
    assert proc.returncode == 2 and "unknown setting(s) ['inductor_no_magic']" in proc.stderr
    assert "inductor_no_split_reductions" in proc.stderr and "|" not in proc.stdout  # lists the valid names


def test_missing_knobs_reports_each_absent_key():
    import torch._inductor.config as ic

    mod = load_script("ablate_inductor")
    full = SimpleNamespace(triton=SimpleNamespace(divisible_by_16=True, persistent_reductions=True),
                           split_reductions=True)
    assert all(mod.missing_knobs(p, full) == [] for p in mod.SETTINGS.values())
    old = SimpleNamespace(triton=SimpleNamespace(persistent_reductions=True), split_reductions=True)
    assert mod.missing_knobs(mod.SETTINGS["inductor_no_all"], old) == ["triton.divisible_by_16"]
    assert mod.missing_knobs(mod.SETTINGS["inductor_no_split_reductions"], SimpleNamespace()) == ["split_reductions"]
    assert mod.missing_knobs(mod.SETTINGS["inductor_no_persistent_reductions"],
                             SimpleNamespace()) == ["triton.persistent_reductions"]
    for key in mod.SETTINGS["inductor_no_all"]:  # the installed torch: does every knob of this script exist?
        assert (key in mod.missing_knobs({key: False})) != hasattr(ic.triton if "." in key else ic, key.split(".")[-1])


def test_knob_missing_row_in_table():
    ok = {"status": "ok", "speedup": 2.0, "ms": 1.0}
    report = {"device": "cpu", "torch": "x", "timer": "t", "benchmarks": BENCHMARKS,
              "shapes": {n: "s" for n in BENCHMARKS}, "eager_ms": {n: 2.0 for n in BENCHMARKS},
              "rows": [{"setting": "inductor", "status": "ok", "missing": [], "results": {n: ok for n in BENCHMARKS},
                        "geomean": 2.0},
                       {"setting": "inductor_no_divisible_by_16", "status": "knob missing",
                        "missing": ["triton.divisible_by_16"], "results": {}, "geomean": None}]}
    _, body = table(load_script("ablate_inductor").markdown_table(report))
    assert body["inductor"] == ["2.00x", "2.00x", "2.00x"]
    assert body["inductor_no_divisible_by_16"] == ["knob missing (triton.divisible_by_16)"] * 3
