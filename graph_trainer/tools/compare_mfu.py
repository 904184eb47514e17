"""Compare tps / TFLOPS / MFU / memory between two sides (branches or flag sets).

One command that a reviewer can trust for "main: N tps, M% MFU — this PR: N tps,
M% MFU"::

    scripts/compare_mfu.py --a main --b HEAD --repeats 3 -- --compile.mode aot_fx_trace
    scripts/compare_mfu.py --a-flags "" --b-flags "--compile.numerics_changing_optim"
    graph-trainer-compare --a main        # B = the working tree as it is (uncommitted changes too)

Sides. Each of A and B is a git ref (``--a REF``: checked out with ``git worktree add
--detach`` into a temporary folder, run from there, removed afterwards), extra
``run_train.sh`` flags (``--a-flags "..."``, shell-quoted), or both. A side given
neither is the working tree of ``--repo`` with no extra flags. Arguments after ``--``
go to ``run_train.sh`` on both sides.

Runs. ``--repeats R`` runs per side, alternating A B A B ... so that drift (thermals,
other jobs) hits both sides. Each run is ``bash <side>/run_train.sh <side flags> <args
after --> --training.steps N --job.dump_folder <out>/runs/<side><k> --metrics.log_freq 1``
with ``PYTHONPATH=<side>``. The environment is inherited (``NGPU``, ``LOG_RANK``,
``CUDA_VISIBLE_DEVICES``, ...); the config is ``--config-file``, else ``CONFIG_FILE``,
else ``CONFIG`` (a name in ``graph_trainer.config.CONFIG_NAMES``), else
``train_configs/debug_model.toml``. A relative config path is taken from each side's
own tree when it exists there (a ref side runs the ref's version of the config), else
from the current directory.

Statistics. Steps ``1..max(--warmup, 1)`` are excluded (step 1 traces and compiles).
Per run: the median over the remaining steps of tps, tflops and MFU, and the max
memory over all steps. Per side: the median over its successful runs, with the
min-max range. The delta of B vs A (%) is called "real" when ``|delta|`` exceeds the
spread, the larger relative range ``(max - min) / median`` of the two sides' repeats;
else "within noise". With one repeat per side the spread is unknown.

Output (``--out DIR``, default ``./outputs/compare_<timestamp>``): ``comparison.json``
(settings, sides, every run with its per-step rows and log path, the table),
``tps_per_step.png``, ``timeline_a_vs_b.png`` (with ``--profile-step``), ``runs/<side><k>/``
(each run's dump folder, metrics.jsonl) and ``runs/<side><k>.log`` (its full output).

Kernels (``--profile-step N``): every run also records step N with the profiler
(:mod:`graph_trainer.tools.profiling`); the device (on CPU: CPU) milliseconds of that step by
kernel category -- matmul, attention, communication, Inductor Triton, eager pointwise,
copy -- are printed per side (median over its runs) with the difference, and stored as
``comparison.json["kernels"]``. The profiled step stays in the tps medians (one slower
step of many barely moves a median). ``timeline_a_vs_b.png`` draws that step of one run
per side (the one with the median wall time of the step), A above B on one time scale:
compute and communication kernels, exposed communication and idle time
(:mod:`graph_trainer.tools.timeline`, from each run's ``rank0_kernels.json``).

Errors before any run starts (exit 2): an unknown ref, a ref that is HEAD while the
working tree has uncommitted changes (you probably meant those changes: commit or
stash, use a side without a ref to run the working tree, or ``--allow-dirty``), flags
that the trainer's config parser rejects (checked with ``python3 -m
graph_trainer.config`` in each side's tree), bad ``--steps`` / ``--warmup``.
A failed run is recorded as failed, its cause and the tail of its log are printed, the
other runs go on; the exit code is then 1. When the cause is the trainer's own input
error (an ``error: ...`` line, e.g. a pass-list conflict that the config pre-check does
not see), the remaining repeats of that side are recorded as skipped, since they would
fail the same way. ``--run-timeout S`` kills a hung run (and its torchrun workers).
Ctrl-C stops the current run and reports the finished ones (exit 130).

Progress: one line per step of the current run (side, repeat, step, loss, tps, MFU),
parsed from the trainer's ``step:`` lines; ``-v`` streams the full output.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import signal
import sys

from graph_trainer.tools.plot import plot
from graph_trainer.tools.runs import LOG_TAIL_LINES, Progress, Run, execute, tail
from graph_trainer.tools.sides import (
    CompareError,
    add_side_arguments,
    Side,
    forced_flags,
    join_flag_values,
    resolve_sides,
    run_cli,
    validate_sides,
)
from graph_trainer.tools.stats import build_results, fmt_value, kernel_comparison

# Environment variables recorded in comparison.json.
ENV_RECORDED = ("NGPU", "CONFIG_FILE", "CONFIG", "LOG_RANK", "MODULE", "COMM_MODE",
                "CUDA_VISIBLE_DEVICES", "PYTHONPATH")


def profile_flags(step: int | None) -> list[str]:
    """run_train.sh flags that record exactly step ``step`` (>= 2) with the profiler: wait
    ``step - 2`` steps, warm up 1, record 1 (the window repeats every ``step`` steps)."""
    if not step:
        return []
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(step),
            "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1"]


def profile_json(dump_folder: str, step: int, rank: int = 0) -> str:
    """Where a run's profile summary of ``step`` lies (:mod:`graph_trainer.tools.profiling`)."""
    return os.path.join(dump_folder, "profile_traces", f"iteration_{step}", f"rank{rank}_kernels.json")


def timeline_plot(path: str, runs: list[Run], labels: dict[str, str], step: int) -> str | None:
    """Draw the profiled ``step`` of one run per side, A above B
    (:func:`graph_trainer.tools.timeline.timeline_a_vs_b`), to ``path`` (PNG).

    Per side the run whose ``rank0_kernels.json`` has step intervals and whose step wall
    time is the median (the lower one of an even count) of the side's runs. Returns
    ``path``, or ``None`` with one printed line when a side has no such run or matplotlib
    is missing. Raises what writing the PNG raises (OSError).
    """
    from graph_trainer.tools.timeline import timeline_a_vs_b

    picked = {}
    for side in ("A", "B"):
        found = []
        for r in runs:
            if r.side != side:
                continue
            try:
                with open(profile_json(r.dump_folder, step)) as f:
                    summary = json.load(f)
                found.append((summary["step_intervals"]["wall_ms"], r.repeat, r))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        if not found:
            print(f"no step timeline picture: no run of side {side} has step intervals of step {step}")
            return None
        found.sort(key=lambda x: x[:2])
        run = found[(len(found) - 1) // 2][2]
        note = f", median wall of {len(found)} runs" if len(found) > 1 else ""
        picked[side] = (profile_json(run.dump_folder, step), f"{side}{run.repeat} {labels[side]}{note}")
    try:
        timeline_a_vs_b(path, picked["A"][0], picked["B"][0], (picked["A"][1], picked["B"][1]))
    except ImportError as e:
        print(f"no step timeline picture ({e})")
        return None
    return path


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's options (the arguments before ``--``)."""
    p = argparse.ArgumentParser(
        description="Run run_train.sh for two sides (git refs and/or flag sets), alternating, "
        "and compare tps / tflops / MFU / memory with a noise estimate.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""examples:
  %(prog)s --a main --b HEAD --repeats 3 -- --compile.mode aot_fx_trace
  %(prog)s --a-flags "" --b-flags "--compile.numerics_changing_optim" --repeats 3
  %(prog)s --a main                      # B = the working tree (uncommitted changes included)
  NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml %(prog)s --a main --steps 30 --warmup 5

A side with neither a ref nor flags is the working tree of --repo with no extra flags.
Arguments after -- go to run_train.sh on both sides. The environment (NGPU, CONFIG_FILE,
CONFIG, LOG_RANK, CUDA_VISIBLE_DEVICES, ...) is inherited by every run.
Exit codes: 0 all runs ok; 1 a run failed (the others are still reported; the later
repeats of a side that failed on a trainer input error are skipped); 2 bad input (nothing
was run); 130 interrupted.""",
    )
    add_side_arguments(p)
    p.add_argument("--repeats", type=int, default=3, help="runs per side, alternating A B A B (default 3)")
    p.add_argument("--steps", type=int, default=20, help="--training.steps of every run (default 20)")
    p.add_argument("--warmup", type=int, default=3,
                   help="steps 1..W are excluded from the statistics; step 1 always is (default 3)")
    p.add_argument("--out", help="output folder (default ./outputs/compare_<timestamp>)")
    p.add_argument("--profile-step", type=int, default=None, metavar="N",
                   help="profile step N of every run (--profiling.*) and print device time per step by kernel "
                        "category, A vs B (graph_trainer/tools/profiling.py); the profiled step stays in the medians")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan, run nothing")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the parsed options, the arguments after ``--`` for run_train.sh on both sides)."""
    if "--" in argv:
        i = argv.index("--")
        own, extra = argv[:i], argv[i + 1:]
    else:
        own, extra = argv, []
    return build_parser().parse_args(join_flag_values(own)), extra


def prepare(args: argparse.Namespace, extra: list[str], tmpdir_holder: list) -> dict:
    """Check the run options (``--repeats``, ``--warmup``, ``--steps``, ``--profile-step``, at
    least one side given), then resolve both sides (:func:`~graph_trainer.tools.sides.resolve_sides`).
    Raises CompareError."""
    if args.repeats < 1:
        raise CompareError(f"--repeats must be >= 1, got {args.repeats}.")
    if args.warmup < 0:
        raise CompareError(f"--warmup must be >= 0, got {args.warmup}.")
    if args.steps <= max(args.warmup, 1):
        raise CompareError(
            f"--steps {args.steps} leaves no step to measure: steps 1..{max(args.warmup, 1)} are "
            f"excluded (--warmup {args.warmup}; step 1 always). Use --steps > {max(args.warmup, 1)}."
        )
    profile_step = getattr(args, "profile_step", None)
    if profile_step is not None and not 2 <= profile_step <= args.steps:
        raise CompareError(f"--profile-step must be in 2..--steps ({args.steps}), got {profile_step}.")
    if args.a is None and args.b is None and args.a_flags is None and args.b_flags is None:
        raise CompareError(
            "nothing to compare: give a ref (--a REF / --b REF) and/or flags (--a-flags / --b-flags) "
            "for at least one side; a side without either is the working tree."
        )
    return resolve_sides(args, extra, tmpdir_holder)


def main(argv: list[str] | None = None) -> int:
    """The CLI (``scripts/compare_mfu.py``, ``graph-trainer-compare``); the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parse(argv)
    return run_cli(lambda holder: _main(args, extra, argv, holder))


def _main(args, extra, argv, holder) -> int:
    ctx = prepare(args, extra, holder)
    sides: dict[str, Side] = ctx["sides"]
    out = os.path.abspath(args.out or os.path.join(
        "outputs", "compare_" + _dt.datetime.now().strftime("%Y%m%d_%H%M%S")))

    if os.path.isdir(out) and os.listdir(out) and not args.dry_run:
        raise CompareError(f"--out {out} exists and is not empty; choose a new folder so runs do not mix.")

    print(f"compare_mfu: {args.repeats} run(s) per side, alternating A B; {args.steps} steps, "
          f"steps 1..{max(args.warmup, 1)} excluded; config {ctx['config']} ({ctx['config_source']})")
    for s in sides.values():
        if s.worktree:
            where = f"worktree of {s.ref} @ {s.commit[:8]}"
        else:
            where = f"working tree {s.root}" + (f" (HEAD {s.commit[:8]}" + (
                f" + {len(s.dirty)} uncommitted path(s))" if s.dirty else ", clean)") if s.commit else "")
        print(f"  {s.name}: {s.label}\n     {where}; flags: {shlex.join(s.flags) or '(none)'}; "
              f"config {s.config_file} ({s.config_note})")
    if extra:
        print(f"  both: {shlex.join(extra)}")
    env_shown = {k: os.environ[k] for k in ("NGPU", "CUDA_VISIBLE_DEVICES", "LOG_RANK") if k in os.environ}
    if env_shown:
        print("  env: " + " ".join(f"{k}={v}" for k, v in env_shown.items()))
    if sides["A"].root == sides["B"].root and sides["A"].flags == sides["B"].flags:
        print("  note: A and B are identical; this measures run-to-run noise.")
    print("validating both sides' flags with graph_trainer.config ...", flush=True)
    validate_sides(sides, extra, args.steps, os.path.join(out, "runs", "check"))

    runs: list[Run] = []
    order = [(rep, s) for rep in range(1, args.repeats + 1) for s in ("A", "B")]
    for i, (rep, s) in enumerate(order, 1):
        side = sides[s]
        dump = os.path.join(out, "runs", f"{s}{rep}")
        run = Run(side=s, repeat=rep, index=i, dump_folder=dump, log=dump + ".log")
        run.cmd = ["bash", os.path.join(side.root, "run_train.sh"), *side.flags, *extra,
                   *forced_flags(args.steps, dump), *profile_flags(args.profile_step)]
        runs.append(run)
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
    payload = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": ["compare_mfu.py", *argv],
        "cwd": os.getcwd(),
        "repo": ctx["repo"],
        "head": ctx["head"],
        "config_file": ctx["config"],
        "config_source": ctx["config_source"],
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
        "settings": {"repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
                     "excluded_steps": list(range(1, max(args.warmup, 1) + 1)), "extra_args": extra},
        "sides": {n: s.describe() for n, s in sides.items()},
        "runs": [],
        "table": None,
        "plot": None,
        "ok": False,
    }
    json_path = os.path.join(out, "comparison.json")
    progress = Progress()
    state: dict = {"run": None}
    interrupted = False

    def _sigterm(signum, frame):  # `timeout` / a job scheduler: report the finished runs like Ctrl-C
        raise KeyboardInterrupt

    previous_sigterm = signal.signal(signal.SIGTERM, _sigterm)
    try:
        skip: dict[str, str] = {}
        for run in runs:
            side = sides[run.side]
            prefix = f"[{run.index}/{len(runs)}] {run.side}{run.repeat} ({side.label}):"
            if run.side in skip:
                run.status, run.error = "skipped", skip[run.side]
                progress.done(f"{prefix} skipped: {run.error}")
                continue
            progress.update(f"{prefix} starting")
            state["run"] = run
            execute(run, side, args.steps, args.warmup, prefix, args.verbose, args.run_timeout, progress)
            if run.status == "ok":
                st = run.stats
                progress.done(
                    f"{prefix} ok in {run.wall_s:.0f}s — tps {fmt_value('tps', st['tps'])}, "
                    f"tflops {fmt_value('tflops', st['tflops'])}, MFU {fmt_value('mfu', st['mfu'])}, "
                    f"memory {fmt_value('memory_gib', st['memory_gib'])} "
                    f"(median of steps {st['steady_steps'][0]}..{st['steady_steps'][-1]})"
                )
            else:
                progress.done(f"{prefix} FAILED ({run.error}); last {LOG_TAIL_LINES} lines of {run.log}:")
                print(_indent(tail(run.log)), flush=True)
                if run.input_error:  # the trainer rejected its input: every repeat would fail
                    skip[run.side] = (f"{run.side}{run.repeat} failed on an input error of the trainer, "
                                      f"which would repeat")
            state["run"] = None
            payload["runs"] = [r.to_json() for r in runs if r.status != "pending"]
            write_json(json_path, payload)
    except KeyboardInterrupt:
        interrupted = True
        if state.get("run") is not None:
            state["run"].status, state["run"].error = "interrupted", "interrupted (Ctrl-C or SIGTERM)"
        progress.done("\ninterrupted; reporting the finished runs")
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)

    done = [r for r in runs if r.rows]
    results = build_results(sides, runs, args.repeats)
    payload["runs"] = [r.to_json() for r in runs]
    payload["table"] = results
    try:
        payload["plot"] = os.path.basename(plot(os.path.join(out, "tps_per_step.png"), done, sides, args.warmup))
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

    print()
    print(results["markdown"])
    print()
    print(results["summary"])
    if args.repeats == 1:
        print("spread unknown with 1 repeat per side: use --repeats 3 (or more) to tell a real "
              "change from noise.")
    else:
        print('"real": |Δ| exceeds the spread ((max - min) / median) of the repeats of either side; '
              'else "within noise".')
    if payload.get("kernels"):
        print()
        print(payload["kernels"]["markdown"])
    if payload.get("timeline_plot"):
        print(f"\nstep {args.profile_step} timeline, A above B: {os.path.join(out, payload['timeline_plot'])}")
    print(f"\nwrote {json_path}" + (f" and {os.path.join(out, payload['plot'])}" if payload["plot"] else ""))
    if failed:
        print(f"{len(failed)} run(s) failed or skipped:", file=sys.stderr)
        for r in failed:
            err = r.error if len(r.error or "") <= 200 else r.error[:197] + "..."
            print(f"  {r.side}{r.repeat}: {r.status}: {err}" + (f" (log {r.log})" if r.status == "failed" else ""),
                  file=sys.stderr)
    if interrupted:
        return 130
    return 1 if failed else 0


def _indent(text: str) -> str:
    return "\n".join("    | " + l for l in text.rstrip("\n").splitlines())


if __name__ == "__main__":
    sys.exit(main())
