"""Find the first op whose output differs between two training runs (step 1, per rank).

``scripts/numerics_diff.py`` (console entry point ``graph-trainer-numerics-diff``) runs
``run_train.sh`` for 1 step once per side -- sides as in :mod:`graph_trainer.tools.loss_compare`
(a git ref, extra flags, or both; ``--compile.mode eager`` is a side too) -- with
``--debug.record_numerics``, so every op's output of step 1 is recorded on every rank
(:mod:`graph_trainer.numerics`), on the same parameters (same seed) and data. It then matches
the ops of A and B by their key (phase, module FQN, op, occurrence; the rule and where it
cannot match: :mod:`graph_trainer.numerics`) and prints, per rank, the first op in A's
execution order whose output differs -- bitwise by default, or beyond ``--rtol`` / ``--atol``
-- with its FQN, phase, op, shapes and max abs / rel difference, then the next few.

Tensors up to 2**20 elements are compared whole; larger ones bitwise by a fingerprint of
all their bits, and their differences are measured on 65,536 evenly strided elements
(marked ``sampled``).

Examples::

    scripts/numerics_diff.py --a-flags "" --b-flags "--compile.numerics_changing_optim"
    scripts/numerics_diff.py --a-flags "--compile.mode eager" --b-flags ""          # trace vs eager
    scripts/numerics_diff.py --a main --b HEAD -- --training.seq_len 512
    scripts/numerics_diff.py --records outA/numerics outB/numerics                   # no runs

Exit codes: 0 nothing differs; 1 something differs (or a run failed); 2 bad input.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

from graph_trainer.tools.runs import Progress, Run, execute, tail
from graph_trainer.tools.sides import (
    CompareError,
    add_side_arguments,
    forced_flags,
    parse_cli,
    resolve_sides,
    run_cli,
    validate_sides,
)


@dataclass
class Divergence:
    """One op whose output differs. ``max_abs`` / ``max_rel``: over the compared elements
    (``max_rel`` None for integer outputs); ``sampled``: measured on a strided sample."""

    key: Any
    shape_a: tuple
    shape_b: tuple
    dtype_a: str
    dtype_b: str
    max_abs: float | None
    max_rel: float | None
    sampled: bool


@dataclass
class Comparison:
    """The result for one rank: ``divergent`` in A's execution order, ``matched`` ops
    compared, the keys found on one side only, and ``reshaped``: keys on both sides whose
    outputs differ in shape or dtype (a matching failure, e.g. FSDP's own parameter views in
    eager against the traced shards; not compared)."""

    matched: int
    divergent: list[Divergence] = field(default_factory=list)
    reshaped: list = field(default_factory=list)
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)


def _diff(ra, rb) -> tuple[float | None, float | None]:
    import torch

    if ra.values.shape != rb.values.shape or not (ra.values.is_floating_point() or ra.values.is_complex()):
        if ra.values.shape == rb.values.shape:
            d = (ra.values.double() - rb.values.double()).abs()
            return float(d.max()) if d.numel() else 0.0, None
        return None, None
    a, b = ra.values.double(), rb.values.double()
    d = (a - b).abs()
    d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(d), d)
    if not d.numel():
        return 0.0, 0.0
    rel = d / b.abs().clamp_min(torch.finfo(torch.float64).tiny)
    rel = torch.where(d == 0, torch.zeros_like(rel), rel)
    return float(d.max()), float(rel.max())


def compare(a: dict, b: dict, rtol: float | None = None, atol: float | None = None) -> Comparison:
    """Compare two runs' records (``{key: graph_trainer.numerics.Record}`` in execution order).

    Ops are compared when their key is on both sides with the same shape and dtype. One
    differs -- bitwise (``rtol`` and ``atol`` None) -- when its fingerprint differs, or --
    with a tolerance -- when some compared element has ``|a - b| > atol + rtol * |b|``
    (NaN equal to NaN; a missing one of the two is taken as 0).
    """
    out = Comparison(matched=0)
    tolerant = rtol is not None or atol is not None
    rt, at = rtol or 0.0, atol or 0.0
    for key, ra in a.items():
        rb = b.get(key)
        if rb is None:
            out.only_a.append(key)
            continue
        if ra.shape != rb.shape or ra.dtype != rb.dtype:
            out.reshaped.append(key)
            continue
        out.matched += 1
        if ra.fingerprint == rb.fingerprint:
            continue
        max_abs, max_rel = _diff(ra, rb)
        if tolerant:
            import torch

            x, y = ra.values.double(), rb.values.double()
            close = torch.isclose(x, y, rtol=rt, atol=at, equal_nan=True) if x.is_floating_point() else x == y
            if bool(close.all()):
                continue
        out.divergent.append(Divergence(key, ra.shape, rb.shape, ra.dtype, rb.dtype, max_abs, max_rel,
                                        ra.sampled or rb.sampled))
    out.only_b = [k for k in b if k not in a]
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else ("0" if x == 0 else f"{x:.3e}")


def describe(div: Divergence) -> str:
    """One line: the op's key, shapes and its max abs / rel difference."""
    from graph_trainer.numerics import key_text

    shapes = f"{list(div.shape_a)} {div.dtype_a}"
    extra = ""
    if div.sampled:
        extra = " (bits differ outside the sampled elements)" if div.max_abs == 0 else " (sampled)"
    return f"{key_text(div.key)}: {shapes}, max abs {_fmt(div.max_abs)}, max rel {_fmt(div.max_rel)}{extra}"


def report(cmp: Comparison, rank: int, next_n: int) -> str:
    """The text printed for one rank."""
    lines = [f"rank {rank}: {cmp.matched} ops compared ({len(cmp.only_a)} only in A, {len(cmp.only_b)} only in B, "
             f"{len(cmp.reshaped)} with the same key but another shape or dtype)"]
    if not cmp.divergent:
        lines.append("  no difference")
        return "\n".join(lines)
    lines.append(f"  first difference: {describe(cmp.divergent[0])}")
    for d in cmp.divergent[1 : 1 + next_n]:
        lines.append(f"  then:             {describe(d)}")
    lines.append(f"  {len(cmp.divergent)} of {cmp.matched} compared ops differ")
    return "\n".join(lines)


def compare_folders(dir_a: str, dir_b: str, rtol: float | None, atol: float | None) -> dict[int, Comparison]:
    """Compare ``rank<r>.pt`` of two record folders, rank by rank.

    Raises:
        CompareError: a folder without record files, different rank sets, an unreadable file.
    """
    from graph_trainer.numerics import load

    ranks = {}
    for d in (dir_a, dir_b):
        found = {int(m.group(1)) for p in glob.glob(os.path.join(d, "rank*.pt"))
                 if (m := re.fullmatch(r"rank(\d+)\.pt", os.path.basename(p)))}
        if not found:
            raise CompareError(f"{d}: no rank<r>.pt record files (written by --debug.record_numerics).")
        ranks[d] = found
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
    p = argparse.ArgumentParser(
        prog="numerics_diff.py",
        description="Run step 1 of two configurations, record every op's output, and name the first op "
                    "whose output differs (per rank).",
        epilog=__doc__.split("Examples::")[1] if "Examples::" in __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_side_arguments(p)
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: bitwise)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: bitwise)")
    p.add_argument("--next", type=int, default=5, metavar="N", help="also print the next N divergent ops (default 5)")
    p.add_argument("--records", nargs=2, metavar=("DIR_A", "DIR_B"),
                   help="compare two existing record folders (rank<r>.pt) instead of running")
    p.add_argument("--out", help="output folder (default ./outputs/numerics_diff_<timestamp>)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code (0 no difference, 1 a difference or a failed run, 2 bad input)."""
    args, extra = parse_cli(build_parser(), argv)

    def body(holder):
        for name in ("rtol", "atol"):
            v = getattr(args, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise CompareError(f"--{name} must be a finite number >= 0, got {v}.")
        if args.next < 0:
            raise CompareError(f"--next must be >= 0, got {args.next}.")
        if args.records:
            if any(x is not None for x in (args.a, args.b, args.a_flags, args.b_flags)) or extra:
                raise CompareError("--records compares existing folders; it takes no --a/--b/--a-flags/--b-flags or run flags.")
            return _print(compare_folders(*args.records, args.rtol, args.atol), args, None)
        ns = argparse.Namespace(**vars(args))
        if args.a is None and args.b is None and args.a_flags is None and args.b_flags is None:
            ns.a_flags = ns.b_flags = ""  # run-to-run
        sides = resolve_sides(ns, extra, holder)["sides"]
        out = os.path.abspath(args.out or os.path.join(
            "outputs", "numerics_diff_" + _dt.datetime.now().strftime("%Y%m%d_%H%M%S")))
        os.makedirs(out, exist_ok=True)
        check = os.path.join(out, "check")
        validate_sides(sides, extra + ["--debug.record_numerics", check], 1, check)
        return _run(args, extra, sides, out)

    return run_cli(body)


def _run(args, extra, sides, out) -> int:
    progress = Progress()
    dirs = {}
    for i, name in enumerate(("A", "B")):
        side = sides[name]
        dump = os.path.join(out, name.lower())
        dirs[name] = os.path.join(dump, "numerics")
        cmd = ["./run_train.sh", *side.flags, *extra, "--debug.record_numerics", dirs[name], *forced_flags(1, dump)]
        run = Run(side=name, repeat=1, index=i, dump_folder=dump, log=os.path.join(out, f"{name.lower()}.log"), cmd=cmd)
        print(f"side {name} ({side.label}): {shlex.join(cmd)}", flush=True)
        execute(run, side, 1, 0, f"[{name}]", args.verbose, args.run_timeout, progress)
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
    from graph_trainer.numerics import key_text

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
        with open(path, "w") as f:
            json.dump({"labels": labels, "comparison": mode, "ranks": payload}, f, indent=1)
        print(f"\nresults: {path}")
    return 1 if any(c.divergent for c in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
