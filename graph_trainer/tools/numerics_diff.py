"""Find the first op whose output differs between two training runs (step 1, per rank).

Runs step 1 per side with ``--debug.record_numerics`` (:mod:`graph_trainer.numerics`), matches the ops
of A and B by key and prints per rank the first op in A's order whose output differs -- bitwise, or
beyond ``--rtol`` / ``--atol`` -- then the next few.

Examples::

    scripts/numerics_diff.py --a-flags "" --b-flags "--compile.numerics_changing_optim"
    scripts/numerics_diff.py --a-flags "--compile.mode eager" --b-flags ""          # trace vs eager
    scripts/numerics_diff.py --a main --b HEAD -- --training.seq_len 512
    scripts/numerics_diff.py --records outA/numerics outB/numerics                   # no runs

Exit codes: 0 nothing differs; 1 something differs (or a run failed); 2 bad input."""

import argparse
import math
import os
import pathlib
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from graph_trainer.numerics import key_text, load
from graph_trainer.tools.runs import Progress, execute, side_run, tail
from graph_trainer.tools.sides import CompareError, pair_sides, parse_cli, run_cli, tool_parser, write_json


@dataclass
class Divergence:
    """One op whose output differs: max abs / rel difference (``max_rel`` None for integers), ``sampled``."""

    key: Any
    shape: tuple
    dtype: str
    max_abs: float | None
    max_rel: float | None
    sampled: bool


@dataclass
class Comparison:
    """One rank: ``matched`` ops compared, the ``divergent`` ones in A's order, keys on one side only, and
    ``reshaped`` keys (another shape or dtype; not compared)."""

    matched: int
    divergent: list[Divergence] = field(default_factory=list)
    reshaped: list = field(default_factory=list)
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)


def _diff(ra, rb) -> tuple[float | None, float | None]:
    floating = ra.values.is_floating_point() or ra.values.is_complex()
    a, b = ra.values.double(), rb.values.double()
    d = (a - b).abs()
    d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(d), d)
    if not d.numel():
        return 0.0, 0.0 if floating else None
    rel = torch.where(d == 0, torch.zeros_like(d), d / b.abs().clamp_min(torch.finfo(torch.float64).tiny))
    return float(d.max()), float(rel.max()) if floating else None


def compare(a: dict, b: dict, rtol: float | None = None, atol: float | None = None) -> Comparison:
    """Compare two runs' records (``{key: Record}`` in execution order), ops whose key is on both sides with the same
    shape and dtype: one differs bitwise (``rtol`` and ``atol`` None) when its fingerprint does, else when an element
    has ``|a - b| > atol + rtol * |b|`` (NaN equals NaN; missing tolerance 0)."""
    out = Comparison(matched=0, only_a=[k for k in a if k not in b], only_b=[k for k in b if k not in a])
    for key, ra in ((k, v) for k, v in a.items() if k in b):
        rb = b[key]
        if ra.shape != rb.shape or ra.dtype != rb.dtype:
            out.reshaped.append(key)
            continue
        out.matched += 1
        if ra.fingerprint == rb.fingerprint:
            continue
        if (rtol is not None or atol is not None) and torch.isclose(
                ra.values.double(), rb.values.double(), rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=True).all():
            continue
        out.divergent.append(Divergence(key, ra.shape, ra.dtype, *_diff(ra, rb), ra.sampled or rb.sampled))
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else ("0" if x == 0 else f"{x:.3e}")


def describe(div: Divergence) -> str:
    """One line: the op's key, shape, dtype and its max abs / rel difference."""
    extra = ("" if not div.sampled else
             " (bits differ outside the sampled elements)" if div.max_abs == 0 else " (sampled)")
    return (f"{key_text(div.key)}: {list(div.shape)} {div.dtype}, max abs {_fmt(div.max_abs)}, "
            f"max rel {_fmt(div.max_rel)}{extra}")


def report(cmp: Comparison, rank: int, next_n: int) -> str:
    """The text printed for one rank."""
    lines = [f"rank {rank}: {cmp.matched} ops compared ({len(cmp.only_a)} only in A, {len(cmp.only_b)} only in B, "
             f"{len(cmp.reshaped)} with the same key but another shape or dtype)"]
    if not cmp.divergent:
        return "\n".join(lines + ["  no difference"])
    lines.append(f"  first difference: {describe(cmp.divergent[0])}")
    lines += [f"  then:             {describe(d)}" for d in cmp.divergent[1:1 + next_n]]
    lines.append(f"  {len(cmp.divergent)} of {cmp.matched} compared ops differ")
    return "\n".join(lines)


def compare_folders(dir_a: str, dir_b: str, rtol: float | None, atol: float | None) -> dict[int, Comparison]:
    """Compare ``rank<r>.pt`` of two record folders, rank by rank (CompareError: no records, other ranks,
    an unreadable file)."""
    ranks = {}
    for d in (dir_a, dir_b):
        ranks[d] = {int(p.stem[4:]) for p in pathlib.Path(d).glob("rank*.pt") if p.stem[4:].isdigit()}
        if not ranks[d]:
            raise CompareError(f"{d}: no rank<r>.pt record files (written by --debug.record_numerics).")
    if ranks[dir_a] != ranks[dir_b]:
        raise CompareError(f"{dir_a} has ranks {sorted(ranks[dir_a])}, {dir_b} has {sorted(ranks[dir_b])}.")
    out = {}
    for r in sorted(ranks[dir_a]):
        try:
            a, _ = load(os.path.join(dir_a, f"rank{r}.pt"))
            b, _ = load(os.path.join(dir_b, f"rank{r}.pt"))
        except ValueError as e:
            raise CompareError(str(e)) from None
        out[r] = compare(a, b, rtol, atol)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The CLI's options (the arguments before ``--`` go here, the rest to run_train.sh)."""
    p = tool_parser("numerics_diff.py", "Run step 1 of two configurations, record every op's output, and name "
                    "the first op whose output differs (per rank).", __doc__, "numerics_diff")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: bitwise)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: bitwise)")
    p.add_argument("--next", type=int, default=5, metavar="N", help="also print the next N divergent ops (default 5)")
    p.add_argument("--records", nargs=2, metavar=("DIR_A", "DIR_B"),
                   help="compare two existing record folders (rank<r>.pt) instead of running")
    return p


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code (0 no difference, 1 a difference or a failed run, 2 bad input)."""
    args, extra = parse_cli(build_parser(), argv)

    def body(cleanup):
        for name in ("rtol", "atol"):
            v = getattr(args, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise CompareError(f"--{name} must be a finite number >= 0, got {v}.")
        if args.next < 0:
            raise CompareError(f"--next must be >= 0, got {args.next}.")
        if args.records:
            if any(x is not None for x in (args.a, args.b, args.a_flags, args.b_flags)) or extra:
                raise CompareError("--records compares existing folders; it takes no --a/--b/--a-flags/--b-flags "
                                   "or run flags.")
            return _print(compare_folders(*args.records, args.rtol, args.atol), args, None)
        sides, out = pair_sides(args, extra, cleanup, "numerics_diff", 1, ["--debug.record_numerics", "numerics"])
        return _run(args, extra, sides, out)

    return run_cli(body)


def _run(args, extra, sides, out) -> int:
    progress = Progress()
    dirs = {}
    for name in ("A", "B"):
        dirs[name] = os.path.join(out, name.lower(), "numerics")
        run = side_run(name, sides[name], extra, ["--debug.record_numerics", dirs[name]], 1, out)
        execute(run, sides[name], 1, 0, f"[{name}]", args.verbose, args.run_timeout, progress)
        ok = run.returncode == 0 and "timed out" not in (run.error or "")  # one step: no tps statistics to check
        progress.done(f"[{name}] {'ok' if ok else 'failed'} in {run.wall_s:.1f}s")
        if not ok:
            print(f"\nside {name} failed ({run.error}); last lines of {run.log}:\n{tail(run.log)}", file=sys.stderr)
            return 1
    try:
        result = compare_folders(dirs["A"], dirs["B"], args.rtol, args.atol)
    except CompareError as e:  # a run that recorded nothing
        print(f"\n{e}", file=sys.stderr)
        return 1
    return _print(result, args, out, {n: sides[n].label for n in sides})


def _print(result: dict, args, out: str | None, labels: dict | None = None) -> int:
    if labels:
        print(f"\nA = {labels['A']}\nB = {labels['B']}")
    mode = "bitwise" if args.rtol is None and args.atol is None else f"rtol {args.rtol or 0:g}, atol {args.atol or 0:g}"
    print(f"comparison: {mode}\n")
    for r, cmp in result.items():
        print(report(cmp, r, args.next))
    if out:
        payload = {str(r): {"matched": c.matched, "only_a": len(c.only_a), "only_b": len(c.only_b),
                            "reshaped": len(c.reshaped),
                            "divergent": [{**vars(d), "key": key_text(d.key)} for d in c.divergent]}
                   for r, c in result.items()}
        path = os.path.join(out, "numerics_diff.json")
        write_json(path, {"labels": labels, "comparison": mode, "ranks": payload})
        print(f"\nresults: {path}")
    return 1 if any(c.divergent for c in result.values()) else 0
