"""Statistics and formatting of compared runs: medians, spreads, deltas, tables.

Pure functions over metrics rows, the per-step dicts of a run's ``metrics.jsonl``
(:func:`graph_trainer.metrics.read_metrics`): step 1 (trace and compile) and the
warm-up steps are excluded from the medians; memory is the max over all steps.
:func:`kernel_comparison` also reads the runs' profiler summaries
(:mod:`graph_trainer.tools.profiling`).
"""

from __future__ import annotations

import json
import os
import statistics

from graph_trainer.tools.timeline import TIMELINE_ROWS

METRICS = ("tps", "tflops", "mfu", "memory_gib")
METRIC_TITLES = {"tps": "tps", "tflops": "tflops", "mfu": "MFU", "memory_gib": "memory"}


def steady_rows(rows: list[dict], warmup: int) -> list[dict]:
    """Rows with ``step > max(warmup, 1)``: step 1 (trace + compile) is always excluded."""
    first = max(warmup, 1)
    return [r for r in rows if r.get("step", 0) > first]


def run_stats(rows: list[dict], warmup: int) -> dict:
    """One run's numbers: medians of tps/tflops/mfu over steady steps, max memory.

    ``None`` where a metric is null on every steady step (MFU on CPU).
    """
    steady = steady_rows(rows, warmup)

    def med(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    mem = [r["memory_gib"] for r in rows if r.get("memory_gib") is not None]
    mem_pct = [r["memory_pct"] for r in rows if r.get("memory_pct") is not None]
    return {
        "steady_steps": [r["step"] for r in steady],
        "tps": med("tps"),
        "tflops": med("tflops"),
        "mfu": med("mfu"),
        "memory_gib": max(mem) if mem else None,
        "memory_pct": max(mem_pct) if mem_pct else None,
        "step_time_s": med("step_time_s"),
        "final_loss": rows[-1].get("loss") if rows else None,
    }


def side_stats(per_run: list[dict]) -> dict:
    """Aggregate the per-run stats of one side: median, min, max, n, relative spread."""
    out = {}
    for key in METRICS:
        vals = [s[key] for s in per_run if s.get(key) is not None]
        if not vals:
            out[key] = {"median": None, "min": None, "max": None, "n": 0, "spread_pct": None}
            continue
        med = statistics.median(vals)
        spread = None
        if len(vals) >= 2:
            spread = 100.0 * (max(vals) - min(vals)) / abs(med) if med else None
        out[key] = {"median": med, "min": min(vals), "max": max(vals), "n": len(vals),
                    "spread_pct": spread}
    return out


def delta(a: dict, b: dict) -> dict:
    """B vs A for each metric: ``pct`` change of the medians, the noise ``spread_pct``
    (the larger of the two sides' relative ranges) and a ``verdict``."""
    out = {}
    for key in METRICS:
        ma, mb = a[key]["median"], b[key]["median"]
        if ma is None or mb is None or ma == 0:
            out[key] = {"pct": None, "spread_pct": None, "verdict": "n/a"}
            continue
        pct = 100.0 * (mb - ma) / abs(ma)
        spreads = [a[key]["spread_pct"], b[key]["spread_pct"]]
        if None in spreads:
            spread, verdict = None, "spread unknown: 1 repeat"
            if a[key]["n"] >= 2 or b[key]["n"] >= 2:
                verdict = "spread unknown: a side has 1 successful run"
        else:
            spread = max(spreads)
            verdict = "real" if abs(pct) > spread else "within noise"
        if mb == ma:
            verdict = "no change"
        out[key] = {"pct": pct, "spread_pct": spread, "verdict": verdict}
    return out


def fmt_number(key: str, v: float) -> str:
    """The number alone: tps with thousands separators (``12,345``; one decimal below
    100), tflops with 2 decimals (4 significant digits below 1), MFU % and GiB with 2
    decimals."""
    if key == "tps":
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"
    if key == "tflops":
        return f"{v:,.2f}" if abs(v) >= 1 else f"{v:.4g}"
    return f"{v:.2f}"


_UNITS = {"tps": "", "tflops": "", "mfu": "%", "memory_gib": " GiB"}


def fmt_value(key: str, v: float | None) -> str:
    """The number with its unit (``12.34%`` MFU, ``12.34 GiB``); ``n/a`` for None."""
    return "n/a" if v is None else fmt_number(key, v) + _UNITS[key]


def fmt_cell(key: str, s: dict) -> str:
    """``median (min–max)``; just the median for one run; ``n/a`` when null."""
    if s["median"] is None:
        return "n/a"
    if s["n"] < 2:
        return fmt_value(key, s["median"])
    return f"{fmt_value(key, s['median'])} ({fmt_number(key, s['min'])}–{fmt_number(key, s['max'])})"


def fmt_delta(d: dict) -> str:
    """One cell of the delta row: ``+1.23% (real, spread 0.45%)``; ``n/a`` without a delta."""
    if d["pct"] is None:
        return "n/a"
    spread = f", spread {d['spread_pct']:.2f}%" if d["spread_pct"] is not None else ""
    return f"{d['pct']:+.2f}% ({d['verdict']}{spread})"


def markdown_table(labels: dict, stats: dict, deltas: dict | None, runs_ok: dict, repeats: int,
                   no_result: dict | None = None) -> str:
    """The markdown table: one row per side, one delta row (B vs A). ``no_result[side]``
    fills the cells of a side without a successful run ("failed", "interrupted")."""
    no_result = no_result or {}
    cols = [METRIC_TITLES[k] for k in METRICS]
    lines = [
        "| side | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for side in ("A", "B"):
        name = f"{side}: {labels[side]} ({runs_ok[side]}/{repeats} runs)"
        if runs_ok[side] == 0:
            cells = [no_result.get(side, "not run")] * len(METRICS)
        else:
            cells = [fmt_cell(k, stats[side][k]) for k in METRICS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if deltas is not None:
        lines.append("| Δ B vs A | " + " | ".join(fmt_delta(deltas[k]) for k in METRICS) + " |")
    else:
        lines.append("| Δ B vs A | " + " | ".join("n/a" for _ in METRICS) + " |")
    return "\n".join(lines)


def one_liner(labels: dict, stats: dict, runs_ok: dict) -> str:
    """``A (main): N tps, T tflops, M% MFU, G GiB — B (...): ...`` (the medians per side)."""
    parts = []
    for side in ("A", "B"):
        if runs_ok[side] == 0:
            parts.append(f"{side} ({labels[side]}): no successful run")
            continue
        s = stats[side]
        parts.append(
            f"{side} ({labels[side]}): {fmt_value('tps', s['tps']['median'])} tps, "
            f"{fmt_value('tflops', s['tflops']['median'])} tflops, "
            f"{fmt_value('mfu', s['mfu']['median'])} MFU, "
            f"{fmt_value('memory_gib', s['memory_gib']['median'])}"
        )
    return " — ".join(parts)


def build_results(sides: dict, runs: list, repeats: int) -> dict:
    """The comparison of finished runs (:class:`~graph_trainer.tools.runs.Run`) of sides A
    and B: per-side stats over the successful runs, the delta B vs A (when both sides have
    one), run counts, the markdown table and the one-line summary."""
    per_side = {s: [r.stats for r in runs if r.side == s and r.status == "ok"] for s in ("A", "B")}
    stats = {s: side_stats(per_side[s]) for s in ("A", "B")}
    runs_ok = {s: len(per_side[s]) for s in ("A", "B")}
    runs_failed = {s: sum(r.side == s and r.status in ("failed", "skipped") for r in runs) for s in ("A", "B")}
    no_result = {}
    for s in ("A", "B"):
        if runs_failed[s]:
            no_result[s] = "failed"
        elif any(r.side == s and r.status == "interrupted" for r in runs):
            no_result[s] = "interrupted"
    deltas = delta(stats["A"], stats["B"]) if runs_ok["A"] and runs_ok["B"] else None
    labels = {s: sides[s].label for s in ("A", "B")}
    return {
        "sides": stats,
        "delta_b_vs_a": deltas,
        "runs_ok": runs_ok,
        "runs_failed": runs_failed,
        "markdown": markdown_table(labels, stats, deltas, runs_ok, repeats, no_result),
        "summary": one_liner(labels, stats, runs_ok),
    }



def kernel_comparison(runs: list, labels: dict, step: int) -> dict:
    """Device (CPU on CPU) milliseconds of the profiled step by kernel category, per side.

    Reads ``<dump>/profile_traces/iteration_<step>/rank0_kernels.json`` of every finished
    run (written by :mod:`graph_trainer.tools.profiling`) and takes, per side and category, the
    median over its runs; likewise for the step timeline (wall, compute running, exposed
    communication, idle). Returns ``{"step", "unit", "runs": {side: n}, "sides": {side:
    {category: ms}}, "timeline": {side: {key: ms}}, "markdown"}``; a side without a
    readable summary has no entry.
    """
    found: dict[str, list[dict]] = {"A": [], "B": []}
    for r in runs:
        path = os.path.join(r.dump_folder, "profile_traces", f"iteration_{step}", "rank0_kernels.json")
        try:
            with open(path) as f:
                found[r.side].append(json.load(f))
        except (OSError, ValueError):
            continue
    unit = next((k.get("unit", "device") for s in found.values() for k in s), "device")
    cats = sorted({c for s in found.values() for k in s for c in k["categories"]})
    sides = {
        s: {c: statistics.median(k["categories"].get(c, {}).get("ms", 0.0) for k in ks) for c in cats}
        for s, ks in found.items() if ks
    }
    for s in sides:
        sides[s]["total"] = sum(sides[s][c] for c in cats)
    order = sorted(cats, key=lambda c: -max(sides[s][c] for s in sides)) if sides else []
    lines = [
        f"{unit} ms of step {step} by kernel category (median over runs; "
        f"runs with a profile: A {len(found['A'])}, B {len(found['B'])})",
        "",
        f"| category | A: {labels['A']} | B: {labels['B']} | Δ B − A |",
        "|---|---:|---:|---:|",
    ]
    def row(label: str, per_side: dict, key: str) -> str:
        a, b = (per_side.get(s, {}).get(key) for s in ("A", "B"))
        d = f"{b - a:+.2f}" if a is not None and b is not None else "n/a"
        cell = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        return f"| {label} | {cell(a)} | {cell(b)} | {d} |"

    for c in order + ["total"]:
        lines.append(row("**total**" if c == "total" else c, sides, c))
    timeline = {
        s: {key: statistics.median(k["timeline"][key] for k in ks) for key, _ in TIMELINE_ROWS}
        for s, ks in found.items() if ks and all(k.get("timeline", {}).get("wall_ms") for k in ks)
    }
    if timeline:
        lines += ["", f"| step timeline | A: {labels['A']} | B: {labels['B']} | Δ B − A |", "|---|---:|---:|---:|"]
        lines += [row(label, timeline, key) for key, label in TIMELINE_ROWS]
    return {"step": step, "unit": unit, "runs": {s: len(v) for s, v in found.items()}, "sides": sides,
            "timeline": timeline, "markdown": "\n".join(lines)}

