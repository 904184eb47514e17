"""Statistics and tables of compared runs, from their ``metrics.jsonl`` rows and profile summaries:
step 1 (trace and compile) and the warm-up steps are excluded from the medians; memory is the max."""

import json
import os
import statistics

from graph_trainer.tools.timeline import TIMELINE_ROWS

METRICS = ("tps", "tflops", "mfu", "memory_gib")
_UNITS = {"tps": "", "tflops": "", "mfu": "%", "memory_gib": " GiB"}


def profiler_steps(profile_step: int | None) -> tuple[int, ...]:
    """The steps a profiler on ``profile_step`` slows (its warm-up, the recorded step, the next, which
    writes the trace); ``()`` without one."""
    return (profile_step - 1, profile_step, profile_step + 1) if profile_step else ()


def steady_rows(rows: list[dict], warmup: int, exclude=()) -> list[dict]:
    """Rows with ``step > max(warmup, 1)`` and not in ``exclude`` (:func:`profiler_steps`): step 1
    (trace + compile) is always excluded."""
    return [r for r in rows if r.get("step", 0) > max(warmup, 1) and r.get("step") not in exclude]


def run_stats(rows: list[dict], warmup: int, exclude=()) -> dict:
    """One run's medians of tps/tflops/mfu/step time over :func:`steady_rows`, max memory (GiB, %),
    final loss; ``None`` where a metric is null on every step (MFU on CPU)."""
    steady = steady_rows(rows, warmup, exclude)

    def agg(f, key, rs):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return f(vals) if vals else None

    out = {k: agg(statistics.median, k, steady) for k in ("tps", "tflops", "mfu", "step_time_s")}
    return {"steady_steps": [r["step"] for r in steady], **out, "memory_gib": agg(max, "memory_gib", rows),
            "memory_pct": agg(max, "memory_pct", rows), "final_loss": rows[-1].get("loss") if rows else None}


def side_stats(per_run: list[dict]) -> dict:
    """Per metric over one side's runs: median, min, max, n and the relative spread
    ``100 * (max - min) / |median|`` (%; None below 2 runs)."""
    out = {}
    for key in METRICS:
        vals = [s[key] for s in per_run if s.get(key) is not None]
        med = statistics.median(vals) if vals else None
        spread = 100.0 * (max(vals) - min(vals)) / abs(med) if len(vals) >= 2 and med else None
        out[key] = {"median": med, "min": min(vals, default=None), "max": max(vals, default=None),
                    "n": len(vals), "spread_pct": spread}
    return out


def delta(a: dict, b: dict) -> dict:
    """B vs A per metric: ``pct`` change of the medians, ``spread_pct`` (the larger side's) and a
    ``verdict``: "real" when ``|pct|`` exceeds the spread, else "within noise"; "no change", "n/a", or
    "spread unknown: ..." with one run on a side."""
    out = {}
    for key in METRICS:
        ma, mb = a[key]["median"], b[key]["median"]
        if ma is None or mb is None or ma == 0:
            out[key] = {"pct": None, "spread_pct": None, "verdict": "n/a"}
            continue
        pct = 100.0 * (mb - ma) / abs(ma)
        spreads = [a[key]["spread_pct"], b[key]["spread_pct"]]
        if None not in spreads:
            spread = max(spreads)
            verdict = "real" if abs(pct) > spread else "within noise"
        elif a[key]["n"] >= 2 or b[key]["n"] >= 2:
            spread, verdict = None, "spread unknown: a side has 1 successful run"
        else:
            spread, verdict = None, "spread unknown: 1 repeat"
        out[key] = {"pct": pct, "spread_pct": spread, "verdict": "no change" if mb == ma else verdict}
    return out


def fmt_number(key: str, v: float) -> str:
    """tps with thousands separators (a decimal below 100), tflops 2 decimals (4 digits below 1), else 2 decimals."""
    if key == "tps":
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"
    if key == "tflops":
        return f"{v:,.2f}" if abs(v) >= 1 else f"{v:.4g}"
    return f"{v:.2f}"


def fmt_value(key: str, v: float | None) -> str:
    """The number with its unit (``12.34%`` MFU, ``12.34 GiB``); ``n/a`` for None."""
    return "n/a" if v is None else fmt_number(key, v) + _UNITS[key]


def _cell(key: str, s: dict) -> str:
    if s["median"] is None or s["n"] < 2:
        return fmt_value(key, s["median"])
    return f"{fmt_value(key, s['median'])} ({fmt_number(key, s['min'])}–{fmt_number(key, s['max'])})"


def _delta_cell(d: dict) -> str:
    if d["pct"] is None:
        return "n/a"
    spread = f", spread {d['spread_pct']:.2f}%" if d["spread_pct"] is not None else ""
    return f"{d['pct']:+.2f}% ({d['verdict']}{spread})"


def markdown_table(labels: dict, stats: dict, deltas: dict | None, runs_ok: dict, repeats: int,
                   no_result: dict | None = None) -> str:
    """One row per side (``median (min–max)``), then B vs A; ``no_result[side]`` fills a side without a
    successful run (default "not run")."""
    lines = ["| side | tps | tflops | MFU | memory |", "|---|" + "---|" * len(METRICS)]
    for side in ("A", "B"):
        cells = ([_cell(k, stats[side][k]) for k in METRICS] if runs_ok[side] else
                 [(no_result or {}).get(side, "not run")] * len(METRICS))
        lines.append(f"| {side}: {labels[side]} ({runs_ok[side]}/{repeats} runs) | " + " | ".join(cells) + " |")
    cells = [_delta_cell(deltas[k]) if deltas else "n/a" for k in METRICS]
    return "\n".join(lines + ["| Δ B vs A | " + " | ".join(cells) + " |"])


def one_liner(labels: dict, stats: dict, runs_ok: dict) -> str:
    """``A (main): N tps, T tflops, M% MFU, G GiB — B (...): ...`` (the medians per side)."""
    parts = []
    for side in ("A", "B"):
        v = {k: fmt_value(k, stats[side][k]["median"]) for k in METRICS}
        numbers = f"{v['tps']} tps, {v['tflops']} tflops, {v['mfu']} MFU, {v['memory_gib']}"
        parts.append(f"{side} ({labels[side]}): {numbers if runs_ok[side] else 'no successful run'}")
    return " — ".join(parts)


def build_results(sides: dict, runs: list, repeats: int) -> dict:
    """Sides A and B's stats over their successful runs, B vs A, run counts, the table and the summary."""
    stats, runs_ok, runs_failed, no_result = {}, {}, {}, {}
    for s in ("A", "B"):
        ok = [r.stats for r in runs if r.side == s and r.status == "ok"]
        stats[s], runs_ok[s] = side_stats(ok), len(ok)
        runs_failed[s] = sum(r.side == s and r.status in ("failed", "skipped") for r in runs)
        interrupted = any(r.side == s and r.status == "interrupted" for r in runs)
        no_result[s] = "failed" if runs_failed[s] else "interrupted" if interrupted else "not run"
    deltas = delta(stats["A"], stats["B"]) if runs_ok["A"] and runs_ok["B"] else None
    labels = {s: sides[s].label for s in ("A", "B")}
    return {"sides": stats, "delta_b_vs_a": deltas, "runs_ok": runs_ok, "runs_failed": runs_failed,
            "markdown": markdown_table(labels, stats, deltas, runs_ok, repeats, no_result),
            "summary": one_liner(labels, stats, runs_ok)}


def profile_json(dump_folder: str, step: int, rank: int = 0) -> str:
    """Where a run's profile summary of ``step`` lies (:mod:`graph_trainer.tools.profiling`)."""
    return os.path.join(dump_folder, "profile_traces", f"iteration_{step}", f"rank{rank}_kernels.json")


#: The category whose kernels :func:`kernel_comparison` does not compare one by one: Inductor names its Triton kernels
#: anew in each compile, while cuBLAS's tiles, the attention templates, eager's ATen kernels and NCCL's keep theirs.
RENAMED_CATEGORY = "inductor triton"


def kernel_comparison(runs: list, labels: dict, step: int, per_kernel: int = 12) -> dict:
    """Milliseconds of the profiled ``step`` by kernel category and of its timeline, per side the median
    over the runs with a readable :func:`profile_json`, and the ``per_kernel`` kernels that moved most
    (:func:`_kernels_moved`). Returns ``{"step", "unit", "runs": {side: n}, "sides": {side: {category: ms,
    "total": ms}}, "timeline": {side: {key: ms}}, "per_kernel": [{"name", "category", "A", "B"}], "markdown"}``."""
    found: dict[str, list[dict]] = {"A": [], "B": []}
    for r in runs:
        try:
            with open(profile_json(r.dump_folder, step)) as f:
                found[r.side].append(json.load(f))
        except (OSError, ValueError):
            continue
    unit = next((k.get("unit", "device") for s in found.values() for k in s), "device")
    cats = sorted({c for s in found.values() for k in s for c in k["categories"]})
    sides = {s: {c: statistics.median(k["categories"].get(c, {}).get("ms", 0.0) for k in ks) for c in cats}
             for s, ks in found.items() if ks}
    for s in sides:
        sides[s]["total"] = sum(sides[s][c] for c in cats)
    timeline = {s: {key: statistics.median(k["timeline"][key] for k in ks) for key, _ in TIMELINE_ROWS}
                for s, ks in found.items() if ks and all(k.get("timeline", {}).get("wall_ms") for k in ks)}
    header = f"| A: {labels['A']} | B: {labels['B']} | Δ B − A |"

    def row(label: str, per_side: dict, key: str) -> str:
        a, b = (per_side.get(s, {}).get(key) for s in ("A", "B"))
        d = f"{b - a:+.2f}" if a is not None and b is not None else "n/a"
        return f"| {label} | " + " | ".join("n/a" if v is None else f"{v:.2f}" for v in (a, b)) + f" | {d} |"

    order = sorted(cats, key=lambda c: -max(sides[s][c] for s in sides)) if sides else []
    lines = [f"{unit} ms of step {step} by kernel category (median over runs; "
             f"runs with a profile: A {len(found['A'])}, B {len(found['B'])})", "",
             f"| category {header}", "|---|---:|---:|---:|"]
    lines += [row(c, sides, c) for c in order] + [row("**total**", sides, "total")]
    if timeline:
        lines += ["", f"| step timeline {header}", "|---|---:|---:|---:|"]
        lines += [row(label, timeline, key) for key, label in TIMELINE_ROWS]
    moved = _kernels_moved(found, per_kernel)
    if moved:
        lines += ["", f"| kernel (ms, launches) | category {header}", "|---|---|---:|---:|---:|"]
        for k in moved:
            name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
            a, b = (f"{k[s]['ms']:.2f} ({k[s]['calls']:.0f})" for s in ("A", "B"))
            lines.append(f"| `{name}` | {k['category']} | {a} | {b} | {k['B']['ms'] - k['A']['ms']:+.2f} |")
    return {"step": step, "unit": unit, "runs": {s: len(v) for s, v in found.items()}, "sides": sides,
            "timeline": timeline, "per_kernel": moved, "markdown": "\n".join(lines)}


def _kernels_moved(found: dict[str, list[dict]], n: int) -> list[dict]:
    """The ``n`` kernels outside :data:`RENAMED_CATEGORY` with the largest ``|B - A|``: per side the
    median over runs of ms and launches per step (0 in a run without the kernel)."""
    if not (found["A"] and found["B"]) or not all("kernels" in k for ks in found.values() for k in ks):
        return []
    per_run = {s: [{r["name"]: r for r in k["kernels"] if r["category"] != RENAMED_CATEGORY} for k in ks]
               for s, ks in found.items()}
    names = {name for runs in per_run.values() for run in runs for name in run}

    def med(side: str, name: str, key: str) -> float:
        return statistics.median(run[name][key] if name in run else 0.0 for run in per_run[side])

    rows = [{"name": name, "category": next(run[name]["category"] for rs in per_run.values() for run in rs
                                           if name in run),
             **{s: {"ms": med(s, name, "ms"), "calls": med(s, name, "calls")} for s in ("A", "B")}}
            for name in names]
    return sorted(rows, key=lambda r: (-abs(r["B"]["ms"] - r["A"]["ms"]), r["name"]))[:n]
