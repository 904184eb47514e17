"""Compare tps / TFLOPS / MFU / memory of two sides (git refs and/or run_train.sh flag sets).

``--repeats R`` runs per side alternate A B A B (drift hits both sides); statistics and verdict:
:mod:`graph_trainer.tools.stats`. ``--out`` gets ``comparison.json``, ``tps_per_step.png``, the runs'
folders and logs, and with ``--profile-step N`` ``timeline_a_vs_b.png`` and the kernel tables.

Examples::

  scripts/compare_mfu.py --a main --b HEAD --repeats 3 -- --compile.mode aot_fx_trace
  scripts/compare_mfu.py --a-flags "" --b-flags "--compile.numerics_changing_optim" --repeats 3
  scripts/compare_mfu.py --a main                      # B = the working tree (uncommitted changes included)
  NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml scripts/compare_mfu.py --a main --steps 30 --warmup 5

A side with neither a ref nor flags is the working tree of --repo with no extra flags.
Arguments after -- go to run_train.sh on both sides. The environment (NGPU, CONFIG_FILE,
CONFIG, LOG_RANK, CUDA_VISIBLE_DEVICES, ...) is inherited by every run.
Exit codes: 0 all runs ok; 1 a run failed (the others are still reported; the later
repeats of a side that failed on a trainer input error are skipped); 2 bad input (nothing
was run); 130 interrupted."""

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys

from graph_trainer.tools.runs import Run, plan_runs, run_all
from graph_trainer.tools.sides import (CompareError, Side, check_run_args, out_folder, parse_cli, resolve_sides,
                                       run_cli, tool_parser, validate_sides, write_json)
from graph_trainer.tools.stats import build_results, kernel_comparison, profile_json, profiler_steps, steady_rows

# Environment variables recorded in comparison.json.
ENV_RECORDED = ("NGPU", "CONFIG_FILE", "CONFIG", "LOG_RANK", "MODULE", "COMM_MODE", "CUDA_VISIBLE_DEVICES",
                "PYTHONPATH")
COLORS, STYLES = {"A": "tab:blue", "B": "tab:orange"}, ["-", "--", ":", "-."]  # of the tps plot


def plot(path: str, runs: list[Run], sides: dict, warmup: int) -> str:
    """tps per step of every run (A blue, B orange; excluded steps shaded) to ``path`` (PNG); returns it."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(9, 5))
    ax = fig.subplots()
    steady = []
    for r in runs:
        steady += [row["tps"] for row in steady_rows(r.rows, warmup, r.excluded)]
        label = f"{r.side}{r.repeat}: {sides[r.side].label}" + ("" if r.status == "ok" else f" [{r.status}]")
        ax.plot([row["step"] for row in r.rows], [row["tps"] for row in r.rows], STYLES[(r.repeat - 1) % len(STYLES)],
                color=COLORS[r.side], marker=".", label=label, alpha=0.9)
    first = max(warmup, 1)
    excluded = "step 1" if first == 1 else f"steps 1..{first}"
    ax.axvspan(0.5, first + 0.5, color="grey", alpha=0.15, label=f"excluded from stats ({excluded})")
    if prof := next((r.excluded for r in runs if r.excluded), ()):
        ax.axvspan(min(prof) - 0.5, max(prof) + 0.5, color="grey", alpha=0.15, hatch="//",
                   label=f"excluded: the profiler's steps {min(prof)}..{max(prof)}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if steady:
        lo, hi = min(steady), max(steady)
        pad = max((hi - lo) * 0.3, hi * 0.02)
        ax.set_ylim(max(lo - pad, 0), hi + pad)
    ax.set(xlabel="step", ylabel="tokens/s per GPU", title="tps per step: A vs B")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def timeline_plot(path: str, runs: list[Run], labels: dict[str, str], step: int) -> str | None:
    """Draw the profiled ``step`` of each side's median-wall run (the lower of two), A above B, to
    ``path`` (PNG); returns it, or None with one printed line (no such run, no matplotlib)."""
    from graph_trainer.tools import timeline

    paths, names = [], []
    for side in ("A", "B"):
        found = []
        for r in (r for r in runs if r.side == side):
            try:
                with open(profile_json(r.dump_folder, step)) as f:
                    found.append((json.load(f)["step_intervals"]["wall_ms"], r.repeat, r))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        if not found:
            print(f"no step timeline picture: no run of side {side} has step intervals of step {step}")
            return None
        run = sorted(found, key=lambda x: x[:2])[(len(found) - 1) // 2][2]
        note = f", median wall of {len(found)} runs" if len(found) > 1 else ""
        paths.append(profile_json(run.dump_folder, step))
        names.append(f"{side}{run.repeat} {labels[side]}{note}")
    try:
        timeline.timeline_a_vs_b(path, *paths, tuple(names))
    except ImportError as e:
        print(f"no step timeline picture ({e})")
        return None
    return path


def build_parser() -> argparse.ArgumentParser:
    """The CLI's options (the arguments before ``--``)."""
    p = tool_parser("compare_mfu.py", "Run run_train.sh for two sides (git refs and/or flag sets), alternating, "
                    "and compare tps / tflops / MFU / memory with a noise estimate.", __doc__, "compare")
    p.add_argument("--repeats", type=int, default=3, help="runs per side, alternating A B A B (default 3)")
    p.add_argument("--steps", type=int, default=20, help="--training.steps of every run (default 20)")
    p.add_argument("--warmup", type=int, default=3,
                   help="steps 1..W are excluded from the statistics; step 1 always is (default 3)")
    p.add_argument("--profile-step", type=int, default=None, metavar="N",
                   help="profile step N of every run (--profiling.*) and print device time per step by kernel "
                        "category, A vs B (graph_trainer/tools/profiling.py), then the kernels that moved most "
                        "(Inductor's aside: renamed per compile); steps N-1..N+1 (the profiler's) are not in medians")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    """The CLI (``scripts/compare_mfu.py``, ``graph-trainer-compare``); the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parse_cli(build_parser(), argv)
    return run_cli(lambda cleanup: _main(args, extra, argv, cleanup))


def _print_plan(ctx: dict, args: argparse.Namespace, extra: list[str]) -> None:
    print(f"compare_mfu: {args.repeats} run(s) per side, alternating A B; {args.steps} steps, "
          f"steps 1..{max(args.warmup, 1)} excluded; config {ctx['config']} ({ctx['config_source']})")
    for s in ctx["sides"].values():
        if s.worktree:
            where = f"worktree of {s.ref} @ {s.commit[:8]}"
        else:
            state = f" + {len(s.dirty)} uncommitted path(s))" if s.dirty else ", clean)"
            where = f"working tree {s.root}" + (f" (HEAD {s.commit[:8]}{state}" if s.commit else "")
        print(f"  {s.name}: {s.label}\n     {where}; flags: {shlex.join(s.flags) or '(none)'}; "
              f"config {s.config_file} ({s.config_note})")
    if extra:
        print(f"  both: {shlex.join(extra)}")
    if env_shown := [f"{k}={os.environ[k]}" for k in ("NGPU", "CUDA_VISIBLE_DEVICES", "LOG_RANK") if k in os.environ]:
        print("  env: " + " ".join(env_shown))
    a, b = ctx["sides"]["A"], ctx["sides"]["B"]
    if a.root == b.root and a.flags == b.flags:
        print("  note: A and B are identical; this measures run-to-run noise.")


def _main(args, extra, argv, cleanup) -> int:
    check_run_args(args)
    if all(x is None for x in (args.a, args.b, args.a_flags, args.b_flags)):
        raise CompareError("nothing to compare: give a ref (--a REF / --b REF) and/or flags (--a-flags / --b-flags) "
                           "for at least one side; a side without either is the working tree.")
    ctx = resolve_sides(args, extra, cleanup)
    sides: dict[str, Side] = ctx["sides"]
    out = out_folder(args.out, "compare")
    if os.path.isdir(out) and os.listdir(out) and not args.dry_run:
        raise CompareError(f"--out {out} exists and is not empty; choose a new folder so runs do not mix.")
    _print_plan(ctx, args, extra)
    print("validating both sides' flags with graph_trainer.config ...", flush=True)
    validate_sides(sides, extra, args.steps, os.path.join(out, "runs", "check"))

    order = [(s, rep) for rep in range(1, args.repeats + 1) for s in "AB"]
    runs = plan_runs(order, sides, extra, args.steps, out, args.profile_step)
    if args.dry_run:
        print("dry run; would run:")
        for r in runs:
            sd = sides[r.side]
            print(f"  [{r.side}{r.repeat}] (cd {sd.root} && CONFIG_FILE={shlex.quote(sd.config_file)} "
                  f"PYTHONPATH={shlex.quote(sd.root)} {shlex.join(r.cmd)})")
        if any(sd.worktree for sd in sides.values()):
            print("  (the temporary worktree is removed again now; a real run keeps it until the end)")
        return 0

    os.makedirs(out, exist_ok=True)
    print(f"output: {out}", flush=True)
    env = {k: os.environ[k] for k in ENV_RECORDED if k in os.environ}
    payload = {"created": datetime.datetime.now().isoformat(timespec="seconds"), "command": ["compare_mfu.py", *argv],
               "cwd": os.getcwd(), "repo": ctx["repo"], "head": ctx["head"], "config_file": ctx["config"],
               "config_source": ctx["config_source"], "env": env,
               "settings": {"repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
                            "excluded_steps": sorted({*range(1, max(args.warmup, 1) + 1),
                                                      *profiler_steps(args.profile_step)}), "extra_args": extra},
               "sides": {n: s.describe() for n, s in sides.items()}, "runs": [], "table": None, "plot": None,
               "ok": False}
    json_path = os.path.join(out, "comparison.json")

    def save_runs():
        payload["runs"] = [dataclasses.asdict(r) for r in runs if r.status != "pending"]
        write_json(json_path, payload)

    interrupted = run_all(runs, sides, args, lambda r: f"{r.side}{r.repeat} ({sides[r.side].label})", save_runs)

    results = build_results(sides, runs, args.repeats)
    payload.update(runs=[dataclasses.asdict(r) for r in runs], table=results)
    try:
        payload["plot"] = os.path.basename(plot(os.path.join(out, "tps_per_step.png"),
                                                [r for r in runs if r.rows], sides, args.warmup))
    except Exception as e:  # the numbers matter more than the picture
        print(f"warning: could not write the plot: {e}", file=sys.stderr)
    failed = [r for r in runs if r.status in ("failed", "skipped")]
    payload["ok"] = not failed and not interrupted
    if args.profile_step:
        labels = {s: sides[s].label for s in sides}
        payload["kernels"] = kernel_comparison(runs, labels, args.profile_step)
        try:
            drawn = timeline_plot(os.path.join(out, "timeline_a_vs_b.png"), runs, labels, args.profile_step)
            payload["timeline_plot"] = drawn and os.path.basename(drawn)
        except Exception as e:  # the numbers matter more than the picture
            print(f"warning: could not write the step timeline picture: {e}", file=sys.stderr)
    write_json(json_path, payload)

    print(f"\n{results['markdown']}\n\n{results['summary']}\n" + (
        "spread unknown with 1 repeat per side: use --repeats 3 (or more) to tell a real change from noise."
        if args.repeats == 1 else
        '"real": |Δ| exceeds the spread ((max - min) / median) of the repeats of either side; else "within noise".'))
    if payload.get("kernels"):
        print("\n" + payload["kernels"]["markdown"])
    if payload.get("timeline_plot"):
        print(f"\nstep {args.profile_step} timeline, A above B: {os.path.join(out, payload['timeline_plot'])}")
    print(f"\nwrote {json_path}" + (f" and {os.path.join(out, payload['plot'])}" if payload["plot"] else ""))
    if failed:
        print(f"{len(failed)} run(s) failed or skipped:", file=sys.stderr)
        for r in failed:
            err = r.error if len(r.error or "") <= 200 else r.error[:197] + "..."
            log = f" (log {r.log})" if r.status == "failed" else ""
            print(f"  {r.side}{r.repeat}: {r.status}: {err}{log}", file=sys.stderr)
    return 130 if interrupted else 1 if failed else 0
