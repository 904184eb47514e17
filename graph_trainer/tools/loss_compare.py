"""Compare two training runs bit for bit (one per side, ``--debug.state_hashes``): every step's logged
loss and grad norm, then the sha256 of the final weights, gradients and optimizer state.

Examples::

    scripts/loss_compare.py --steps 10 --a-flags "" --b-flags "" --assert-equal        # run-to-run
    scripts/loss_compare.py --a-flags "--compile.mode eager" --b-flags "" --assert-equal
    scripts/loss_compare.py --a-flags "" --b-flags "--compile.numerics_changing_optim" --rtol 1e-4
    scripts/loss_compare.py --a main --b HEAD --assert-equal -- --training.seq_len 512

Exit codes: 0 ok (and equal, with ``--assert-equal``); 1 a difference under
``--assert-equal``, a failed run, or a tolerance exceeded with ``--rtol``; 2 bad input."""

import argparse
import math
import os
import sys

from graph_trainer.tools.runs import Progress, execute, side_run, tail
from graph_trainer.tools.sides import CompareError, pair_sides, parse_cli, run_cli, tool_parser, write_json

HASH_KEYS = ("weights", "grads", "optimizer")


def first_difference(a_rows: list[dict], b_rows: list[dict], a_hashes: dict | None,
                     b_hashes: dict | None) -> str | None:
    """A sentence naming the first difference between two runs, or None if bitwise equal:
    the logged steps, then per step the loss and the grad norm, then the final-state hashes."""
    a_steps, b_steps = [r["step"] for r in a_rows], [r["step"] for r in b_rows]
    if a_steps != b_steps:
        return f"the runs logged different steps: A {a_steps}, B {b_steps}"
    for ra, rb in zip(a_rows, b_rows):
        for key in ("loss", "grad_norm"):
            if ra.get(key) != rb.get(key):
                return f"{key} differs at step {ra['step']}: A {ra.get(key)!r}, B {rb.get(key)!r}"
    if a_hashes is None or b_hashes is None:
        return "a run recorded no final state hashes (--debug.state_hashes)"
    for k in HASH_KEYS:
        if a_hashes.get(k) != b_hashes.get(k):
            return f"final {k} differ after the last step: sha256 A {a_hashes.get(k)}, B {b_hashes.get(k)}"
    return None


def rel_diff(a: float | None, b: float | None) -> float | None:
    """``|a - b| / max(|a|, |b|)``; 0 when equal, None when either is missing."""
    if a is None or b is None:
        return None
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b), 1e-30)


def _fmt(v: float | None) -> str:
    return "–" if v is None else ("0" if v == 0 else f"{v:.3e}")


def table(a_rows: list[dict], b_rows: list[dict], a_hashes: dict | None, b_hashes: dict | None, labels: dict) -> str:
    """Markdown: step | loss A | loss B | abs diff | rel diff | grad_norm rel diff; then the hashes."""
    lines = [f"| step | loss A ({labels['A']}) | loss B ({labels['B']}) | abs diff | rel diff | grad_norm rel diff |",
             "|---:|---:|---:|---:|---:|---:|"]
    b_by_step = {r["step"]: r for r in b_rows}
    for ra in a_rows:
        rb = b_by_step.get(ra["step"], {})
        la, lb = ra.get("loss"), rb.get("loss")
        d = None if la is None or lb is None else abs(la - lb)
        gd = rel_diff(ra.get("grad_norm"), rb.get("grad_norm"))
        lines.append(f"| {ra['step']} | {la!r} | {lb!r} | {_fmt(d)} | {_fmt(rel_diff(la, lb))} | {_fmt(gd)} |")
    lines += ["", "| final state | A sha256 | B sha256 | equal |", "|---|---|---|---|"]
    for k in HASH_KEYS:
        ha, hb = (a_hashes or {}).get(k), (b_hashes or {}).get(k)
        lines.append(f"| {k} | {(ha or '–')[:16]} | {(hb or '–')[:16]} | {'yes' if ha and ha == hb else 'no'} |")
    return "\n".join(lines)


def max_rel_loss_diff(a_rows: list[dict], b_rows: list[dict]) -> float:
    """The largest :func:`rel_diff` of the loss over A's steps (inf if none compares)."""
    b_by_step = {r["step"]: r for r in b_rows}
    diffs = [rel_diff(r.get("loss"), b_by_step.get(r["step"], {}).get("loss")) for r in a_rows]
    return max((d for d in diffs if d is not None), default=math.inf)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's options (the arguments before ``--``)."""
    p = tool_parser("loss_compare.py", "Run two configurations and compare per-step loss and final "
                    "weight/grad/optimizer hashes bit for bit.", __doc__, "loss_compare")
    p.add_argument("--steps", type=int, default=5, help="--training.steps of both runs (default 5, >= 2)")
    p.add_argument("--assert-equal", action="store_true", help="exit 1 on the first bit of difference")
    p.add_argument("--rtol", type=float, default=None, help="exit 1 if a step's loss differs by more (relative)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The CLI (``scripts/loss_compare.py``, ``graph-trainer-loss-compare``); the exit code."""
    args, extra = parse_cli(build_parser(), argv)

    def body(cleanup):
        if args.steps < 2:
            raise CompareError(f"--steps must be >= 2 (step 1 traces and compiles), got {args.steps}.")
        sides, out = pair_sides(args, extra, cleanup, "loss_compare", args.steps, ["--debug.state_hashes"])
        return _run(args, extra, sides, out)

    return run_cli(body)


def _run(args, extra, sides, out) -> int:
    progress = Progress()
    runs = {}
    for name in ("A", "B"):
        run = side_run(name, sides[name], extra, ["--debug.state_hashes"], args.steps, out)
        execute(run, sides[name], args.steps, 0, f"[{name}]", args.verbose, args.run_timeout, progress)
        progress.done(f"[{name}] {run.status} in {run.wall_s:.1f}s")
        runs[name] = run
    failed = [n for n, r in runs.items() if r.status != "ok"]
    for n in failed:
        print(f"\nside {n} failed ({runs[n].error}); last lines of {runs[n].log}:\n{tail(runs[n].log)}",
              file=sys.stderr)
    a, b = runs["A"], runs["B"]
    a_h, b_h = ((r.summary or {}).get("state_hashes") for r in (a, b))
    diff = None if failed else first_difference(a.rows, b.rows, a_h, b_h)
    # with a failed run, the steps both logged are still compared (a crash after the last
    # step, or a timeout while hashing, leaves every step's loss in metrics.jsonl)
    common = sorted({r["step"] for r in a.rows} & {r["step"] for r in b.rows})
    a_common = [r for r in a.rows if r["step"] in common]
    result = {"sides": {n: sides[n].describe() for n in sides}, "steps": args.steps, "shared_flags": extra,
              "status": {n: r.status for n, r in runs.items()}, "bitwise_equal": None if failed else diff is None,
              "first_difference": diff, "compared_steps": common, "state_hashes": {"A": a_h, "B": b_h},
              "max_rel_loss_diff": max_rel_loss_diff(a_common, b.rows) if common or not failed else None,
              "losses": {n: [r.get("loss") for r in runs[n].rows] for n in runs}}
    path = os.path.join(out, "loss_compare.json")
    write_json(path, result)
    labels = {n: sides[n].label for n in sides}
    rel = result["max_rel_loss_diff"]
    if failed:
        if common:
            print(f"\npartial comparison (side {', '.join(failed)} failed): the {len(common)} step(s) both runs "
                  f"logged, max relative loss difference {rel:.3e}\n")
            print(table(a_common, b.rows, a_h, b_h, labels))
        print(f"results: {path}")
        return 1
    print(f"\n{table(a.rows, b.rows, a_h, b_h, labels)}\n")
    if diff is None:
        print(f"bitwise equal: every loss and grad norm of {len(a.rows)} steps and the final weights, grads "
              "and optimizer state")
    else:
        print(f"DIFFERENT: {diff} (max relative loss difference {rel:.3e})")
    print(f"results: {path}")
    if over := args.rtol is not None and rel > args.rtol:
        print(f"max relative loss difference {rel:.3e} > --rtol {args.rtol}")
    return 1 if over or (args.assert_equal and diff is not None) else 0
