"""The bench command: one workload, named variants (run_train.sh flag sets), alternating rounds,
a table, and a JSON record of the call for the results page.

Round ``r`` runs every variant once, in the order given (drift hits every variant). Per run, as
:mod:`graph_trainer.tools.compare_mfu`: medians of tps / MFU over the steps after ``max(--warmup,
1)``, the max memory; per variant the median, min and max over its runs. Each variant is
compared with the first: the tps ratio, and "real" when the change exceeds the larger spread
``(max - min) / median`` of the two (:func:`graph_trainer.tools.stats.delta`). Beside them the
predicted peak and the compile time that traced runs report in their summary. ``--deadline-s``
starts no run that the variant's longest earlier run says would end past it.

The record (``--record-dir``, default ``docs/results``; ``--no-record`` for none) is what
``scripts/results_page.py`` renders: date, device, torch, git sha, the exact command, the
settings, per variant its statistics and every run's figures. A record is never overwritten.

Examples::

  NGPU=4 CONFIG=graph_trainer_llama3_8b scripts/bench.py --workload "llama3_8b fsdp2tp2" \\
      --variant jit="--compile.mode jit" --variant plain="" --variant full="--compile.inductor_compilation full" \\
      --repeats 3 --deadline-s 560 -- --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2
  scripts/bench.py --variant plain="" --variant norm="--compile.numerics_changing_optim" --repeats 2 --no-record

Arguments after -- go to run_train.sh in every run; NGPU, CONFIG / CONFIG_FILE, COMM_MODE, ...
are inherited. Exit codes: 0 every run ok; 1 a run failed or was skipped; 2 bad input; 130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

from graph_trainer.tools.runs import Progress, Run, execute, tail
from graph_trainer.tools.sides import (CompareError, Side, _config_for_side, _git_out, check_owned_flags,
                                       default_repo, forced_flags, out_folder, parse_cli, resolve_config, run_cli,
                                       validate_sides)
from graph_trainer.tools.stats import delta, fmt_number, side_stats

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    """The CLI's options (the arguments before ``--``)."""
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                epilog="examples:" + __doc__.split("Examples::")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                   help='a named variant: run_train.sh flags as one shell-quoted string ("" for none); the first '
                        "is the baseline; repeat the option for each")
    p.add_argument("--workload", help="the record's workload name (default: config + layout flags)")
    p.add_argument("--title", help="the results page's heading for this workload")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every variant once (default 3)")
    p.add_argument("--steps", type=int, default=20, help="--training.steps of every run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="steps 1..W excluded from the medians (default 3)")
    p.add_argument("--deadline-s", type=float, default=None, metavar="S",
                   help="start no run that would end more than S seconds after the first started")
    p.add_argument("--profile-step", type=int, default=None, metavar="N",
                   help="profile step N of every run (kernel categories and a timeline in its dump folder)")
    p.add_argument("--record-dir", default=os.path.join(REPO, "docs", "results"),
                   help="where the call's JSON record goes (default docs/results)")
    p.add_argument("--no-record", action="store_true", help="write no record")
    p.add_argument("--note", help="one line shown under the table on the results page")
    p.add_argument("--run-timeout", type=float, default=None, metavar="S", help="kill a run after S seconds")
    p.add_argument("-v", "--verbose", action="store_true", help="stream every run's full output")
    p.add_argument("--out", help="output folder of the runs (default ./outputs/bench_<timestamp>)")
    return p


def parse_variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``["jit=--compile.mode jit", "plain="]`` -> ``[("jit", ["--compile.mode", "jit"]), ("plain", [])]``.

    Raises:
        CompareError: no ``=``, an empty or repeated name, unparsable flags, a flag the tool sets itself.
    """
    out = []
    for spec in specs:
        name, sep, flags = spec.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
            raise CompareError(f"--variant {spec!r}: write NAME=FLAGS (NAME of letters, digits, _ . + -).")
        if name in (n for n, _ in out):
            raise CompareError(f"--variant {name!r} is given twice.")
        try:
            fl = shlex.split(flags)
        except ValueError as e:
            raise CompareError(f"--variant {name}: {flags!r} is not a valid shell-quoted string: {e}") from None
        check_owned_flags(fl, f"--variant {name}")
        out.append((name, fl))
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
    """Per variant: tps / MFU / memory statistics over its successful runs, the median predicted
    peak (GiB) and compile time (s) of their summaries, and the tps ratio and verdict against the first."""
    out, stats = [], []
    for name in names:
        ok = [r for r in runs if r.side == name and r.status == "ok"]
        stats.append(side_stats([r.stats for r in ok]))
        out.append({"name": name, **{k: stats[-1][k] for k in ("tps", "mfu", "memory_gib")},
                    "predicted_peak_gib": _median((r.summary or {}).get("predicted_peak_gib") for r in ok),
                    "compile_time_s": _median((r.summary or {}).get("compile_time_s") for r in ok)})
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
             "| compile s |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for v in variants:
        t = v["tps"]
        tps = "failed" if not t["n"] else f"{num('tps', t['median'])} ({num('tps', t['min'])}–{num('tps', t['max'])})"
        ratio = "–" if v["ratio"] is None else f"{v['ratio']:.3f}×"
        mfu = "–" if v["mfu"]["median"] is None else f"{v['mfu']['median']:.1f} %"
        lines.append(f"| {v['name']} ({t['n']} runs) | {tps} | {ratio} | {v['verdict']} | {mfu} | "
                     f"{num('memory_gib', v['memory_gib']['max'])} | {num('', v['predicted_peak_gib'], 2)} | "
                     f"{num('', v['compile_time_s'], 0)} |")
    return "\n".join(lines)


def utc_date_time() -> dict[str, str]:
    """A record's ``date`` (YYYY-MM-DD) and ``time`` (HH:MM), UTC: the results page orders a day's records by them."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"date": now.strftime("%Y-%m-%d"), "time": now.strftime("%H:%M")}


def write_record(folder: str, record: dict) -> str:
    """Write ``record`` as ``<folder>/<date>_<HHMM>_<workload slug>.json`` (``HHMM``: its UTC
    ``time``, omitted when absent; ``_2``, ``_3``, ... when taken); returns the path. Never overwrites."""
    os.makedirs(folder, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", record["workload"]).strip("_").lower() or "bench"
    when = "_".join(filter(None, (record["date"], record.get("time", "").replace(":", ""))))
    stem = os.path.join(folder, f"{when}_{slug}")
    path, n = stem + ".json", 2
    while os.path.exists(path):
        path, n = f"{stem}_{n}.json", n + 1
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
    if args.repeats < 1 or args.warmup < 0 or args.steps <= max(args.warmup, 1):
        raise CompareError(f"need --repeats >= 1, --warmup >= 0 and --steps > max(--warmup, 1); got --repeats "
                           f"{args.repeats}, --warmup {args.warmup}, --steps {args.steps}.")
    if args.profile_step is not None and not 2 <= args.profile_step <= args.steps:
        raise CompareError(f"--profile-step must be in 2..--steps ({args.steps}), got {args.profile_step}.")
    check_owned_flags(extra, "the arguments after --")
    variants = parse_variants(args.variant)
    repo, config = default_repo(), resolve_config(None, os.environ)[0]
    head = _git_out(repo, "rev-parse", "HEAD")
    sides = {}
    for name, flags in variants:
        sides[name] = Side(name=name, ref=None, flags=flags, label=name, commit=head, root=repo)
        _config_for_side(config, sides[name])
    out = out_folder(args.out, "bench")
    if os.path.isdir(out) and os.listdir(out):
        raise CompareError(f"--out {out} exists and is not empty; choose a new folder so runs do not mix.")
    print(f"bench: {len(variants)} variant(s) x {args.repeats} round(s), {args.steps} steps; config {config}"
          + (f"; run_train.sh {shlex.join(extra)}" if extra else ""), flush=True)
    validate_sides(sides, extra, args.steps, os.path.join(out, "check"))
    profile = ["--profiling.enable_profiling", "--profiling.profile_freq", str(args.profile_step),
               "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1"] if args.profile_step else []
    runs = []
    for rnd in range(1, args.repeats + 1):
        for name, _ in variants:
            dump = os.path.join(out, "runs", f"{name}{rnd}")
            cmd = ["bash", os.path.join(repo, "run_train.sh"), *sides[name].flags, *extra,
                   *forced_flags(args.steps, dump), *profile]
            runs.append(Run(side=name, repeat=rnd, index=len(runs) + 1, dump_folder=dump, log=dump + ".log", cmd=cmd))
    interrupted = _run_all(runs, sides, args)
    results = variant_results([n for n, _ in variants], runs)
    print("\n" + table(results))
    layout = " ".join(a for a in extra if not a.startswith("--") or "parallelism" in a)
    record = {
        "schema": 1, "kind": "bench",
        "workload": args.workload or f"{os.path.splitext(os.path.basename(config))[0]} {layout}".strip(),
        "title": args.title or args.workload or os.path.basename(config),
        **utc_date_time(), "device": device_name(), "torch": _torch_version(),
        "git_sha": head, "command": _command(argv),
        "settings": {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "extra_args": extra},
        "variants": [{**v, "flags": sides[v["name"]].flags} for v in results],
        "runs": [{"variant": r.side, "round": r.repeat, "status": r.status, "error": r.error, "wall_s": r.wall_s,
                  **{k: (r.stats or {}).get(k) for k in ("tps", "mfu", "memory_gib")},
                  **{k: (r.summary or {}).get(k) for k in ("predicted_peak_gib", "compile_time_s")},
                  "dump_folder": r.dump_folder} for r in runs],
        "profile_png": None, "note": args.note,
    }
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(record, f, indent=1)
    if not args.no_record and not interrupted:
        print(f"record: {write_record(args.record_dir, record)}")
    bad = [r for r in runs if r.status != "ok"]
    return 130 if interrupted else 1 if bad else 0


def _command(argv: list[str]) -> str:
    """The call as a shell line, with the environment that shapes it."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ("NGPU", "CONFIG", "CONFIG_FILE", "COMM_MODE")
           if os.environ.get(k)]
    return " ".join([*env, "scripts/bench.py", shlex.join(argv)])


def _torch_version() -> str:
    import torch

    return torch.__version__


def _run_all(runs: list[Run], sides: dict, args) -> bool:
    """Run ``runs`` in order, the deadline and failures permitting; True when interrupted."""
    progress, start, longest = Progress(), time.monotonic(), {}
    try:
        for run in runs:
            prefix = f"[{run.index}/{len(runs)}] {run.side} round {run.repeat}:"
            if args.deadline_s and time.monotonic() - start + longest.get(run.side, 0.0) > args.deadline_s:
                run.status, run.error = "skipped", f"--deadline-s {args.deadline_s:.0f} would be passed"
                progress.done(f"{prefix} skipped ({run.error})")
                continue
            execute(run, sides[run.side], args.steps, args.warmup, prefix, args.verbose, args.run_timeout, progress)
            longest[run.side] = max(longest.get(run.side, 0.0), run.wall_s or 0.0)
            if run.status == "ok":
                progress.done(f"{prefix} ok in {run.wall_s:.0f}s, tps {fmt_number('tps', run.stats['tps'])}")
            else:
                progress.done(f"{prefix} FAILED ({run.error}); last lines of {run.log}:\n{tail(run.log)}")
    except KeyboardInterrupt:
        progress.done("\ninterrupted; the finished runs are reported")
        return True
    return False


if __name__ == "__main__":
    sys.exit(main())
