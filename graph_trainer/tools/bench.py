"""The bench command: one workload, named variants (run_train.sh flag sets), alternating rounds,
a table, and a JSON record of the call for the results page.

Round ``r`` runs every variant once, in the order given (drift hits every variant). Statistics as
:mod:`graph_trainer.tools.compare_mfu`'s, each variant against the first
(:func:`graph_trainer.tools.stats.delta`), beside the predicted peak and compile time of the runs'
summaries. The record (``--record-dir``) is what ``scripts/results_page.py`` renders; never overwritten.
Interrupted (Ctrl-C, SIGTERM from a time limit), the call still records its finished runs, noted as such.

Examples::

  NGPU=4 CONFIG=graph_trainer_llama3_8b scripts/bench.py --workload "llama3_8b fsdp2tp2" \\
      --variant jit="--compile.mode jit" --variant plain="" --variant full="--compile.inductor_compilation full" \\
      --repeats 3 --deadline-s 560 -- --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2
  scripts/bench.py --variant plain="" --variant norm="--compile.numerics_changing_optim" --repeats 2 --no-record

Arguments after -- go to run_train.sh in every run; NGPU, CONFIG / CONFIG_FILE, COMM_MODE, ...
are inherited. Exit codes: 0 every run ok; 1 a run failed or was skipped; 2 bad input; 130 interrupted."""

import argparse
import datetime
import glob
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys

from graph_trainer.tools.runs import Run, plan_runs, run_all
from graph_trainer.tools.sides import (CompareError, Side, check_owned_flags, check_run_args, config_for_side,
                                       default_repo, git_out, git_state, out_folder, parse_cli, resolve_config, run_cli,
                                       tool_parser, validate_sides, write_json)
from graph_trainer.tools.stats import delta, fmt_number, profile_json, side_stats
from graph_trainer.tools.timeline import TIMELINE_ROWS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    """The CLI's options (the arguments before ``--``)."""
    p = tool_parser("bench.py", __doc__.split("\n\n")[0], __doc__, "bench", two_sided=False)
    p.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                   help='a named variant: run_train.sh flags as one shell-quoted string ("" for none), '
                        "NAME=VALUE words before them set its runs' environment (NCCL_MAX_CTAS=8); the first is "
                        "the baseline; repeat the option for each")
    p.add_argument("--workload", help="the record's workload name (default: config + layout flags)")
    p.add_argument("--title", help="the results page's heading for this workload")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every variant once (default 3)")
    p.add_argument("--steps", type=int, default=20, help="--training.steps of every run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="steps 1..W excluded from the medians (default 3)")
    p.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="start no run that would end more than S seconds after the first started (a variant's next "
                        "run is taken as long as its last; its first, cold one scaled by the later/first ratio "
                        "of the variants that ran twice)")
    p.add_argument("--profile-step", type=int, default=None, metavar="N",
                   help="profile step N of every run (kernel categories and a timeline in its dump folder; "
                        "each variant's first timeline picture goes beside the record); steps N-1..N+1 "
                        "(the profiler's) are left out of the medians")
    p.add_argument("--record-dir", default=os.path.join(REPO, "docs", "results"),
                   help="where the call's JSON record goes (default docs/results)")
    p.add_argument("--no-record", action="store_true", help="write no record")
    p.add_argument("--note", help="one line shown under the table on the results page")
    return p


def parse_variants(specs: list[str]) -> list[tuple[str, list[str], dict]]:
    """``["jit=--compile.mode jit", "c8=NCCL_MAX_CTAS=8"]`` -> ``[("jit", ["--compile.mode", "jit"], {}), ("c8", [],
    {"NCCL_MAX_CTAS": "8"})]``: ``NAME=VALUE`` words before the flags set the variant's environment, as in a shell.
    Raises CompareError: no ``=``, an empty or repeated name, unparsable flags, a flag the tool sets, CONFIG(_FILE)."""
    out = []
    for spec in specs:
        name, sep, flags = spec.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
            raise CompareError(f"--variant {spec!r}: write NAME=FLAGS (NAME of letters, digits, _ . + -).")
        if name in (n for n, *_ in out):
            raise CompareError(f"--variant {name!r} is given twice.")
        try:
            fl = shlex.split(flags)
        except ValueError as e:
            raise CompareError(f"--variant {name}: {flags!r} is not a valid shell-quoted string: {e}") from None
        env = {}
        while fl and (m := re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", fl[0], re.S)):
            if m[1] in ("CONFIG", "CONFIG_FILE", "PYTHONPATH"):
                raise CompareError(f"--variant {name}: {m[1]} is the call's, not a variant's; set it before the call.")
            env[m[1]], fl = m[2], fl[1:]
        check_owned_flags(fl, f"--variant {name}")
        out.append((name, fl, env))
    return out


def device_name() -> str:
    """``"4x NVIDIA H100 80GB HBM3"`` from nvidia-smi (the GPUs the runs may see), else ``"cpu"``."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    names = [n.strip() for n in names if n.strip()]
    if visible := os.environ.get("CUDA_VISIBLE_DEVICES"):
        names = [names[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) < len(names)]
    return f"{len(names)}x {names[0]}" if names else "cpu"


def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def variant_results(names: list[str], runs: list[Run]) -> list[dict]:
    """Per variant: statistics over its successful runs, their median predicted peak (GiB) and compile
    time (s), the seconds from launch to step 2 of its first run (``step2_first_s``: cold when the
    machine's Inductor and graph caches hold nothing of it yet) and the median of its later runs
    (``step2_later_s``: those caches warm), the tps ratio and verdict against the first."""
    out, stats = [], []
    for name in names:
        ok = [r for r in runs if r.side == name and r.status == "ok"]
        stats.append(side_stats([r.stats for r in ok]))
        out.append({"name": name, **{k: stats[-1][k] for k in ("tps", "mfu", "memory_gib")},
                    "predicted_peak_gib": _median((r.summary or {}).get("predicted_peak_gib") for r in ok),
                    "compile_time_s": _median((r.summary or {}).get("compile_time_s") for r in ok),
                    "step2_first_s": ok[0].step2_s if ok else None,
                    "step2_later_s": _median(r.step2_s for r in ok[1:])})
    base = out[0]["tps"]["median"]
    for i, v in enumerate(out):
        if i == 0:
            v["ratio"], v["verdict"] = (1.0 if base else None), "baseline"
        elif base and v["tps"]["median"]:
            v["ratio"], v["verdict"] = v["tps"]["median"] / base, delta(stats[0], stats[i])["tps"]["verdict"]
        else:
            v["ratio"], v["verdict"] = None, "no successful run"
    return out


def table(variants: list[dict]) -> str:
    """The markdown table of :func:`variant_results`."""
    def num(key, x, digits=None):
        return "–" if x is None else (f"{x:.{digits}f}" if digits is not None else fmt_number(key, x))

    lines = ["| variant | tps/GPU median (min–max) | vs first | verdict | MFU | peak GiB | predicted GiB "
             "| compile s | to step 2 s (first / later) |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for v in variants:
        t = v["tps"]
        tps = "failed" if not t["n"] else f"{num('tps', t['median'])} ({num('tps', t['min'])}–{num('tps', t['max'])})"
        ratio = "–" if v["ratio"] is None else f"{v['ratio']:.3f}×"
        mfu = "–" if v["mfu"]["median"] is None else f"{v['mfu']['median']:.1f} %"
        lines.append(f"| {v['name']} ({t['n']} runs) | {tps} | {ratio} | {v['verdict']} | {mfu} | "
                     f"{num('memory_gib', v['memory_gib']['max'])} | {num('', v['predicted_peak_gib'], 2)} | "
                     f"{num('', v['compile_time_s'], 0)} | {num('', v['step2_first_s'], 0)} / "
                     f"{num('', v['step2_later_s'], 0)} |")
    return "\n".join(lines)


def utc_date_time() -> dict[str, str]:
    """A record's ``date`` (YYYY-MM-DD) and ``time`` (HH:MM), UTC: the results page orders a day's records by them."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"date": now.strftime("%Y-%m-%d"), "time": now.strftime("%H:%M")}


def record_path(folder: str, record: dict) -> str:
    """``<folder>/<date>_<HHMM>_<workload slug>.json`` (``HHMM``: the record's UTC ``time``, if any;
    ``_2``, ``_3``, ... when taken)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", record["workload"]).strip("_").lower() or "bench"
    when = "_".join(filter(None, (record["date"], record.get("time", "").replace(":", ""))))
    stem = os.path.join(folder, f"{when}_{slug}")
    path, n = stem + ".json", 2
    while os.path.exists(path):
        path, n = f"{stem}_{n}.json", n + 1
    return path


def copy_profiles(runs: list, path: str) -> list[str]:
    """Per variant, its first profiled run's ``rank0_timeline.png`` copied beside the record at ``path`` as
    ``<record stem>_<variant>.png``; returns the file names (the record's ``profile_png``)."""
    folder, stem = os.path.split(os.path.splitext(path)[0])
    names: dict[str, str] = {}
    for run in runs:
        if run.side in names:
            continue
        if pngs := sorted(glob.glob(os.path.join(run.dump_folder, "**", "rank0_timeline.png"), recursive=True)):
            names[run.side] = f"{stem}_{run.side}.png"
            os.makedirs(folder or ".", exist_ok=True)
            shutil.copyfile(pngs[-1], os.path.join(folder, names[run.side]))
    return list(names.values())


def profile_summary(runs: list, step: int, top: int = 4) -> dict:
    """Per profiled variant, where the ``step`` of its first run with readable ``rank<r>_kernels.json`` went:
    ``[{"rank", "wall_ms", "compute_ms", "exposed_comm_ms", "idle_ms", "collectives": {label: {"ms", "exposed_ms"}},
    "idle_host_ms", "idle_by_host_op": {op: ms}}]`` (the ``top`` most exposed collectives and host ops; ms per step; the
    idle keys where the run recorded host launches) for rank 0 and the rank with most compute."""
    out: dict[str, list[dict]] = {}
    for run in runs:
        if run.side in out:
            continue
        ranks = []
        for path in sorted(glob.glob(os.path.join(os.path.dirname(profile_json(run.dump_folder, step)),
                                                  "rank*_kernels.json"))):
            try:
                with open(path) as f:
                    s = json.load(f)
                t = s["timeline"]
                idle = s.get("idle_causes") or {}
                ranks.append({"rank": int(s.get("rank", 0)), **{k: round(t[k], 2) for k, _ in TIMELINE_ROWS},
                              "collectives": {label: {k: round(c[k], 2) for k in ("ms", "exposed_ms")}
                                              for label, c in list(s.get("collectives", {}).items())[:top]},
                              **({"idle_host_ms": round(idle["host_ms"], 2),
                                  "idle_by_host_op": {op: round(ms, 2) for op, ms in
                                                      list(idle["by_host_op"].items())[:top]}} if idle else {})})
            except (OSError, ValueError, KeyError, TypeError):
                continue
        if ranks:
            ranks.sort(key=lambda r: r["rank"])
            slowest = max(ranks, key=lambda r: r["compute_ms"])
            out[run.side] = [ranks[0]] + ([slowest] if slowest is not ranks[0] else [])
    return out


def write_record(folder: str, record: dict, path: str | None = None) -> str:
    """Write ``record`` to ``path`` (default :func:`record_path`); returns the path. Never overwrites."""
    os.makedirs(folder, exist_ok=True)
    path = path or record_path(folder, record)
    with open(path, "x") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """The CLI (``scripts/bench.py``); the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parse_cli(build_parser(), argv, joined=("--variant",))  # NAME=--flag x: one value
    return run_cli(lambda cleanup: _main(args, extra, argv))


def _main(args, extra: list[str], argv: list[str]) -> int:
    check_run_args(args)
    check_owned_flags(extra, "the arguments after --")
    variants = parse_variants(args.variant)  # bad input refused before git or the config is read
    repo, config = default_repo(), resolve_config(None, os.environ)[0]
    head = git_out(repo, "rev-parse", "HEAD")
    sides = {name: Side(name=name, ref=None, flags=fl, label=name, commit=head, root=repo, env=env)
             for name, fl, env in variants}
    for side in sides.values():
        config_for_side(config, side)
    out = out_folder(args.out, "bench")
    if os.path.isdir(out) and os.listdir(out):
        raise CompareError(f"--out {out} exists and is not empty; choose a new folder so runs do not mix.")
    print(f"bench: {len(sides)} variant(s) x {args.repeats} round(s), {args.steps} steps; config {config}"
          + (f"; run_train.sh {shlex.join(extra)}" if extra else ""), flush=True)
    validate_sides(sides, extra, args.steps, os.path.join(out, "check"))
    order = [(name, rnd) for rnd in range(1, args.repeats + 1) for name in sides]
    runs = plan_runs(order, sides, extra, args.steps, out, args.profile_step)
    interrupted = run_all(runs, sides, args, lambda r: f"{r.side} round {r.repeat}")
    results = variant_results(list(sides), runs)
    print("\n" + table(results))
    layout = " ".join(a for a in extra if not a.startswith("--") or "parallelism" in a)
    record = {
        "schema": 1, "kind": "bench",
        "workload": args.workload or f"{os.path.splitext(os.path.basename(config))[0]} {layout}".strip(),
        "title": args.title or args.workload or os.path.basename(config),
        **utc_date_time(), "device": device_name(), "torch": __import__("torch").__version__,
        **git_state(repo), "command": _command(argv),
        "settings": {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "extra_args": extra},
        "variants": [{**v, "flags": sides[v["name"]].flags, **({"env": e} if (e := sides[v["name"]].env) else {})}
                     for v in results],
        "runs": [{"variant": r.side, "round": r.repeat, "status": r.status, "error": r.error, "wall_s": r.wall_s,
                  "step2_s": r.step2_s, "dump_folder": r.dump_folder,
                  **{k: (r.stats or {}).get(k) for k in ("tps", "mfu", "memory_gib", "step_time_s")},
                  **{k: (r.summary or {}).get(k) for k in ("predicted_peak_gib", "compile_time_s")}} for r in runs],
        "profile_png": None, "note": args.note,
    }
    if args.profile_step:
        record["profile"] = {"step": args.profile_step, "variants": profile_summary(runs, args.profile_step)}
    if interrupted:  # the finished runs are kept: a call's time limit often ends it
        ran = sum(r.status == "ok" for r in runs)
        record["note"] = "; ".join(filter(None, [args.note, f"interrupted after {ran} of {len(runs)} runs"]))
    write_json(os.path.join(out, "bench.json"), record)
    if not args.no_record and (not interrupted or any(r.status == "ok" for r in runs)):
        path = record_path(args.record_dir, record)
        record["profile_png"] = copy_profiles(runs, path) or None
        print(f"record: {write_record(args.record_dir, record, path)}")
    return 130 if interrupted else 1 if any(r.status != "ok" for r in runs) else 0


def _command(argv: list[str]) -> str:
    """The call as a shell line, with the environment that shapes it."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ("NGPU", "CONFIG", "CONFIG_FILE", "COMM_MODE")
           if os.environ.get(k)]
    return " ".join([*env, "scripts/bench.py", shlex.join(argv)])
