"""scripts/results_page.py: docs/perf.md from fabricated records in a tmp repo root."""

import json
import subprocess
import sys

import pytest
from _scripts import SCRIPTS, load_script, table

rp = load_script("results_page")

H100 = "4x NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
TEMPLATE = "# GPU results\n\nProse before the records.\n\n{{records}}\n\nProse after the records.\n"
COMMAND = "NGPU=2 CONFIG=graph_trainer_llama3_1b scripts/bench.py --variant jit='--compile.mode jit' --variant plain=''"


def stat(median, low=None, high=None):
    """A statistics object of the record format."""
    return {"median": median, "min": median if low is None else low, "max": median if high is None else high, "n": 3,
            "spread_pct": 0.0}


def bench(date, tps_jit=41847.0, workload="llama3_1b fsdp2", device=H100, **extra):
    """A bench record: variants jit (baseline), plain (no ratio given, no MFU), broken (no successful run)."""
    return {
        "schema": 1, "kind": "bench", "workload": workload, "title": f"Bench {workload}", "date": date,
        "device": device, "torch": "2.11.0+cu130", "git_sha": "abc1234def5678", "command": COMMAND,
        "settings": {"steps": 20, "warmup": 3, "repeats": 3}, "variants": [
            {"name": "jit", "flags": ["--compile.mode", "jit"], "tps": stat(tps_jit, 41000.0, 42500.0),
             "mfu": stat(38.24), "memory_gib": stat(45.123), "predicted_peak_gib": 45.1, "compile_time_s": 30.6,
             "step2_first_s": 95.2, "step2_later_s": 40.6, "ratio": 1.0, "verdict": "baseline"},
            {"name": "plain", "flags": [], "tps": stat(37000.0, 36000.0, 37500.0), "mfu": None,
             "memory_gib": stat(50.0), "predicted_peak_gib": None, "compile_time_s": None, "verdict": "slower"},
            {"name": "broken", "flags": ["--x"], "tps": {"median": None, "min": None, "max": None, "n": 0},
             "mfu": None, "memory_gib": None, "predicted_peak_gib": 60.0, "compile_time_s": None},
        ], "profile_png": None, **extra}


def tier(date):
    """A tier record with one passed and one failed claim (the latter with a detail)."""
    return {
        "schema": 1, "kind": "tier", "workload": "gpu tier", "title": "GPU tier", "date": date, "device": H100,
        "torch": "2.11.0+cu130", "git_sha": "0123456789ab", "command": "bash scripts/gpu/tier.sh", "claims": [
            {"claim": "test_eager_equals_traced[fsdp2]", "what": "eager == traced, FSDP2, 1B", "result": "PASSED"},
            {"claim": "test_resume", "what": "resume | bitwise", "result": "FAILED", "detail": "step 7 differs"},
        ], "note": "Run on one   machine."}


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A tmp repository root for the script: docs/results/ holds the template, no records."""
    root = tmp_path.resolve()
    monkeypatch.setattr(rp, "REPO", root)
    (root / "docs" / "results").mkdir(parents=True)
    (root / "docs" / "results" / "template.md").write_text(TEMPLATE)
    return root


def put(root, name, record):
    """Write ``record`` as docs/results/``name``."""
    (root / "docs" / "results" / name).write_text(json.dumps(record, indent=1))


@pytest.fixture
def records(repo):
    """Two records of one bench group, one of another device, an earlier-sorting workload, a tier record."""
    put(repo, "2026-11-20_llama3_1b_fsdp2.json", bench("2026-11-20", tps_jit=30123.0))
    put(repo, "2026-11-27_llama3_1b_fsdp2.json",
        bench("2026-11-27", profile_png="docs/results/2026-11-27_llama3_1b_fsdp2.png", note="One  line\nnote."))
    put(repo, "2026-11-25_llama3_1b_fsdp2_h200.json", bench("2026-11-25", device=H200, tps_jit=50000.0))
    put(repo, "2026-11-26_debug.json", bench("2026-11-26", workload="debug fsdp1"))
    put(repo, "2026-11-27_tier.json", tier("2026-11-27"))
    (repo / "docs" / "results" / "2026-11-27_llama3_1b_fsdp2.png").write_bytes(b"png")
    return repo


def sections(page):
    """``{heading: section text}`` of the rendered page, in page order."""
    return {p.split("\n", 1)[0]: p for p in page.split("\n### ")[1:]}


def generate(capsys, *args):
    """Run the script's main; ``(exit status, stdout, stderr)``."""
    code = rp.main(list(args))
    return (code, *capsys.readouterr())


def written(root, capsys):
    """The page the script writes (exit 0) under ``root``."""
    assert generate(capsys)[0] == 0
    return (root / "docs" / "perf.md").read_text()


def tier_call(root, name, time, sha, results, model="llama3_1b", device=H100):
    """A tier call's record, its claims ``{claim: result}``."""
    record = {**tier("2026-11-27"), "model": model, "workload": name, "time": time, "device": device, "git_sha": sha,
              "command": f"TIER_K={name} bash scripts/gpu/tier.sh", "note": None}
    record["claims"] = [{"claim": c, "what": c, "result": r} for c, r in results.items()]
    put(root, f"2026-11-27_{name}.json", record)


def test_page(records, capsys):
    """Header, template prose, latest record per group only, order, tables, command, link, note."""
    code, out, err = generate(capsys)
    assert code == 0 and "wrote docs/perf.md" in out and err == ""
    page = (records / "docs" / "perf.md").read_text()
    lines = page.splitlines()
    assert lines[0] == ("<!-- generated by `python3 scripts/results_page.py` from docs/results/ "
                        "(records + template.md); do not edit by hand -->")
    assert lines[1:6] == ["# GPU results", "", "Prose before the records.", "", "### GPU tier — " + H100]
    assert lines[-1] == "Prose after the records." and page.endswith("records.\n")
    assert "{{records}}" not in page and "30,123" not in page  # the older record is not rendered
    parts = sections(page)
    assert list(parts) == ["GPU tier — " + H100, "Bench debug fsdp1 — " + H100, "Bench llama3_1b fsdp2 — " + H100,
                           "Bench llama3_1b fsdp2 — " + H200]
    main = parts["Bench llama3_1b fsdp2 — " + H100]
    header, rows = table(main)
    assert header == ("| variant | tps/GPU median (min–max) | vs first | verdict | MFU | peak GiB | predicted GiB "
                      "| compile s | to step 2 s (first / later) |")
    assert rows["jit"] == ["41,847 (41,000–42,500)", "1.000×", "baseline", "38.2%", "45.12", "45.10", "31",
                           "95 / 41"]
    assert rows["plain"] == ["37,000 (36,000–37,500)", f"{37000 / 41847:.3f}×", "slower",  # ratio computed
                             "–", "50.00", "–", "–", "– / –"]  # a record from before the column
    assert rows["broken"] == ["failed", "failed", "failed", "failed", "failed", "60.00", "failed", "failed"]
    assert all(s in main for s in ("2026-11-27, torch 2.11.0+cu130, git `abc1234d` (steps 20, warmup 3, repeats 3); 1 earlier record "
                                   "in docs/results/\n",
                                   f"```bash\n{COMMAND}\n```\n", "\nOne line note.\n",
                                   "Profile: [2026-11-27_llama3_1b_fsdp2.png](results/2026-11-27_llama3_1b_fsdp2.png)"))
    assert all(s not in parts["Bench llama3_1b fsdp2 — " + H200] for s in ("earlier", "Profile:"))
    tier_section = parts["GPU tier — " + H100]
    header, rows = table(tier_section)
    assert header == "| claim | what | result | detail |"
    assert rows["`test_eager_equals_traced[fsdp2]`"] == ["eager == traced, FSDP2, 1B", "PASSED", "–"]
    assert "\n| `test_resume` | resume \\| bitwise | FAILED | step 7 differs |\n" in tier_section  # pipe escaped
    assert "\nRun on one machine.\n" in tier_section and "```bash\nbash scripts/gpu/tier.sh\n```" in tier_section


def test_latest_by_date_then_file_name(repo, capsys):
    """Same date: the later file name wins; two earlier records are counted."""
    put(repo, "2026-11-27_a.json", bench("2026-11-27", tps_jit=11111.0))
    put(repo, "2026-11-27_b.json", bench("2026-11-27", tps_jit=22222.0))
    put(repo, "2026-11-28_0old_name.json", bench("2026-11-01", tps_jit=33333.0))  # the date field decides
    page = written(repo, capsys)
    assert "22,222" in page and "11,111" not in page and "33,333" not in page
    assert "; 2 earlier records in docs/results/" in page


def test_profile_pictures_beside_the_record(repo, capsys):
    """Per-variant pictures link into the results folder (missing ones named); a dirty tree is said."""
    put(repo, "r.json", bench("2026-11-27", profile_png=["r_jit.png", "r_plain.png"], git_dirty=True))
    (repo / "docs" / "results" / "r_jit.png").write_bytes(b"png")  # r_plain.png was not kept: named, not linked
    page = written(repo, capsys)
    assert "\nProfile: [r_jit.png](results/r_jit.png), r_plain.png (not kept)\n" in page
    assert "git `abc1234d` + uncommitted changes (steps" in page  # the record's tree differed from its sha


def test_tier_calls_of_one_model_and_device_merge_claim_by_claim(repo, capsys):
    """Tier calls of one model and device merge claim by claim, latest result first."""
    tier_call(repo, "a_second", "22:56", "bbbbbbbbbb", {"tp2-full": "PASSED"})
    tier_call(repo, "b_first", "22:43", "aaaaaaaaaa", {"tp2-full": "FAILED", "fsdp2-full": "PASSED"})
    tier_call(repo, "c_superseded", "21:00", "aaaaaaaaaa", {"tp2-full": "FAILED"})  # b_first's sha: still not shown
    tier_call(repo, "d_other_model", "23:00", "dddddddddd", {"tp2-full": "FAILED"}, model="llama3_8b")
    page = sections(written(repo, capsys))
    assert list(page) == ["GPU tier, llama3_1b — " + H100, "GPU tier — " + H100]
    merged = page["GPU tier, llama3_1b — " + H100]
    assert table(merged) == ("| claim | what | result | call |", {
        "`fsdp2-full`": ["fsdp2-full", "PASSED", "`aaaaaaaa`"], "`tp2-full`": ["tp2-full", "PASSED", "`bbbbbbbb`"]})
    assert "TIER_K=b_first bash scripts/gpu/tier.sh\nTIER_K=a_second bash" in merged
    assert "; 1 earlier record in docs/results/" in merged and "c_superseded" not in merged


def test_tier_claims_merge_across_devices_naming_each(repo, capsys):
    """A claim's latest result counts on any device; each row then names its call's device."""
    for name, time, device, result in (("h100", "21:00", H100, "FAILED"), ("h200", "22:00", H200, "PASSED")):
        tier_call(repo, name, time, name * 2, {"tp2-full": result, f"only-{name}": "PASSED"}, device=device)
    page = sections(written(repo, capsys))
    assert list(page) == ["GPU tier, llama3_1b — 2 devices"]
    _, rows = table(page["GPU tier, llama3_1b — 2 devices"])
    assert rows == {"`only-h100`": ["only-h100", "PASSED", f"`h100h100`, {H100}"],
                    "`only-h200`": ["only-h200", "PASSED", f"`h200h200`, {H200}"],
                    "`tp2-full`": ["tp2-full", "PASSED", f"`h200h200`, {H200}"]}


def test_edge_cases_accepted(repo, capsys):
    """No records; a tier record without details (three columns); a template of 60 lines."""
    assert "_No records in docs/results/._" in written(repo, capsys)
    record = tier("2026-11-27")
    record["claims"][1].pop("detail")
    put(repo, "t.json", record)
    assert table(written(repo, capsys))[0] == "| claim | what | result |"
    (repo / "docs" / "results" / "template.md").write_text("line\n" * 59 + "{{records}}\n")
    assert generate(capsys)[0] == 0


def test_idempotent_check_and_options(records, tmp_path, capsys):
    """--check: 1 when missing or stale, 0 when current; reruns write identical bytes or nothing; --results, --out."""
    out = records / "docs" / "perf.md"
    code, stdout, _ = generate(capsys, "--check")
    assert code == 1 and "docs/perf.md" in stdout and not out.exists()
    assert generate(capsys)[0] == 0
    first, mtime = out.read_bytes(), out.stat().st_mtime_ns
    code, stdout, _ = generate(capsys)
    assert code == 0 and "unchanged" in stdout and out.read_bytes() == first and out.stat().st_mtime_ns == mtime
    assert rp.render(records / "docs" / "results", out) == first.decode()
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]  # no temporary file left
    assert generate(capsys, "--check")[0] == 0
    out.write_text(out.read_text() + "hand edit\n")
    stale = out.read_bytes()
    code, stdout, _ = generate(capsys, "--check")
    assert code == 1 and "docs/perf.md is out of date" in stdout and out.read_bytes() == stale
    # --results / --out: relative to the repository root, or absolute
    assert generate(capsys, "--out", "elsewhere/page.md")[0] == 0
    assert (records / "elsewhere" / "page.md").read_text().count("\n### ") == 4
    (other := tmp_path / "other_results").mkdir()
    (other / "template.md").write_text("{{records}}\n")
    (other / "x.json").write_text(json.dumps(tier("2026-01-01")))
    code, _, _ = generate(capsys, "--results", str(other), "--out", str(tmp_path / "p.md"))
    page = (tmp_path / "p.md").read_text()
    assert code == 0 and "from other_results/" in page.splitlines()[0] and page.count("\n### ") == 1


def refused(root, capsys, *names):
    """Over a sentinel page: exit 2, one stderr line naming all ``names``, the page untouched; the message."""
    out = root / "docs" / "perf.md"
    out.write_text("sentinel\n")
    code, stdout, err = generate(capsys)
    assert code == 2 and stdout == "" and len(err.splitlines()) == 1 and all(n in err for n in names), err
    assert out.read_text() == "sentinel\n"
    return err


def _template(text):
    return lambda root: (root / "docs" / "results" / "template.md").write_text(text)


def _record(name, edit, make=bench):
    def setup(root):
        record = make("2026-11-28")
        edit(record)
        put(root, name, record)
    return setup


T = "docs/results/template.md"
#: id: (fixture, setup of the bad input, what the one-line message names)
REFUSALS = {
    "template_61_lines": ("repo", _template("line\n" * 60 + "{{records}}\n"), [T, "61 lines"]),
    "template_no_placeholder": ("repo", _template("# no placeholder\n"), [T, "found 0"]),
    "template_two_placeholders": ("repo", _template("{{records}}\n{{records}}\n"), [T, "found 2"]),
    "missing_template": ("repo", lambda root: (root / "docs" / "results" / "template.md").unlink(), [T]),
    "invalid_json": ("records", lambda root: (root / "docs" / "results" / "2026-11-28_bad.json").write_text(
        '{"schema": 1,,}'), ["docs/results/2026-11-28_bad.json", "not valid JSON"]),
    **{f"missing_{field}": ("records", _record("2026-11-28_partial.json", edit), [
        "docs/results/2026-11-28_partial.json", "missing required field", f"'{field}'"]) for field, edit in [
        ("device", lambda r: r.pop("device")), ("variants", lambda r: r.pop("variants")),
        ("variants[1].name", lambda r: r["variants"][1].pop("name")), ("git_sha", lambda r: r.update(git_sha=None))]},
    "claim_missing_field": ("repo", _record("t.json", lambda r: r["claims"][0].pop("result"), tier),
                            ["docs/results/t.json", "'claims[0].result'"]),
    **{f"bad_{field}": ("repo", _record("r.json", lambda r, kw=kw: r.update(kw)), ["docs/results/r.json", f"'{field}'"])
       for field, kw in [("schema", {"schema": 2}), ("kind", {"kind": "other"}), ("date", {"date": "27.11.2026"}),
                         ("variants", {"variants": []})]},
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_template_or_record_refused(request, capsys, case):
    fixture, setup, names = REFUSALS[case]
    root = request.getfixturevalue(fixture)
    setup(root)
    refused(root, capsys, *names)


def test_line_cap(repo, capsys):
    """Over 250 lines: exit 2 with the policy message, nothing written; exactly 250 is fine."""
    for i in range(25):
        put(repo, f"2026-11-27_w{i:02d}.json", bench("2026-11-27", workload=f"w{i:02d}"))
    assert "lines" in refused(repo, capsys, "docs/perf.md", "250")
    rp.check_length("x\n" * 250, repo / "p.md")
    with pytest.raises(rp.PageError, match="251 lines"):
        rp.check_length("x\n" * 251, repo / "p.md")


def test_cli(tmp_path):
    """As a process: --help; a bad record gives exit 2 and one line, no traceback."""
    script = SCRIPTS / "results_page.py"
    help_ = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "--check" in help_.stdout and "--results" in help_.stdout
    (tmp_path / "template.md").write_text("{{records}}\n")
    (tmp_path / "x.json").write_text(json.dumps({"schema": 1, "kind": "bench"}))
    proc = subprocess.run([sys.executable, script, "--results", tmp_path, "--out", tmp_path / "perf.md"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not (tmp_path / "perf.md").exists()
    assert proc.stderr.count("\n") == 1 and "x.json" in proc.stderr and "'workload'" in proc.stderr


def test_profiled_step_per_variant_and_rank(repo, capsys):
    """A bench record's ``profile``: a row per variant and rank, the most exposed collectives, the host's idle."""
    coll = {"ReduceScatter f32": {"ms": 51.1, "exposed_ms": 40.04}, "AllGather": {"ms": 65.2, "exposed_ms": 30.0}}
    plain0 = {"rank": 0, "wall_ms": 503.8, "compute_ms": 391.7, "exposed_comm_ms": 98.3, "idle_ms": 13.8,
              "collectives": coll}
    plain3 = {"rank": 3, "wall_ms": 503.9, "compute_ms": 411.8, "exposed_comm_ms": 78.1, "idle_ms": 13.9,
              "collectives": {}, "idle_host_ms": 9.04, "idle_by_host_op": {"aten::mm": 9.04}}
    jit0 = {"rank": 0, "wall_ms": 620.8, "compute_ms": 442.1, "exposed_comm_ms": 160.5, "idle_ms": 18.3}
    prof = {"step": 10, "variants": {"jit": [jit0], "plain": [plain0, plain3]}}
    put(repo, "r.json", bench("2026-11-27", profile=prof))
    page = written(repo, capsys)
    assert "\n| step 10 profiled, ms | rank | wall | compute | exposed comm | idle |" in page
    assert "\n| jit | 0 | 620.8 | 442.1 | 160.5 | 18.3 | – |\n" in page
    assert "\n| plain | 0 | 503.8 | 391.7 | 98.3 | 13.8 | ReduceScatter f32 40.0, AllGather 30.0 |\n" in page
    assert "\n| plain | 3 | 503.9 | 411.8 | 78.1 | 13.9 (host 9.0) | – |\n" in page  # idle waiting for a launch
    put(repo, "r.json", bench("2026-11-27", profile={"step": 10, "variants": {"jit": prof["variants"]["jit"]}}))
    assert "\n| jit | 0 | 620.8 | 442.1 | 160.5 | 18.3 |\n" in written(repo, capsys)  # no collectives: no column


def test_superseded_group_left_out_and_named(repo, capsys):
    """A group whose latest record names its newer records is left out and named; unknown ``superseded_by`` refused."""
    put(repo, "2026-11-26_old.json", bench("2026-11-26", workload="old", superseded_by=["2026-11-27_new.json"]))
    put(repo, "2026-11-27_new.json", bench("2026-11-27", workload="new"))
    page = written(repo, capsys)
    assert list(sections(page)) == ["Bench new — " + H100]
    assert "_Superseded, not shown: `2026-11-26_old.json` (by `2026-11-27_new.json`)._" in page
    put(repo, "2026-11-26_old.json", bench("2026-11-26", workload="old", superseded_by=["missing.json"]))
    code, _, err = generate(capsys)
    assert code == 2 and "2026-11-26_old.json: field 'superseded_by' must list record files" in err


def test_fewer_runs_than_repeats_named(repo, capsys):
    """A variant with fewer successful runs than the record's repeats (a deadline) says how many in its name."""
    record = bench("2026-11-27")
    record["variants"][1]["tps"]["n"] = 2
    put(repo, "r.json", record)
    _, rows = table(sections(written(repo, capsys))["Bench llama3_1b fsdp2 — " + H100])
    assert "plain (2 of 3 runs)" in rows and "jit" in rows and "broken" in rows  # 3 of 3; failed: no count
