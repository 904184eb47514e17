#!/usr/bin/env python3
"""Ablate three Inductor knobs on two benchmarks: speedup over eager per setting.

Benchmarks
----------
``train_step``  the traced Llama3 training step of ``--config-file`` (built and traced
                as in ``scripts/fusion_report.py``: bf16 params on CUDA, fp32 on CPU),
                compiled with ``graph_trainer.compiler.passes.full_inductor_pass``; eager = the
                traced graph run uncompiled.
``rmsnorm``     the RMSNorm fwd+bwd microbenchmark of ``scripts/bench_rmsnorm.py``
                (its ``Problem``, ``trace_fwd_bwd``, ``eager_fwd_bwd``, ``make_timer``,
                imported from its path): the make_fx fwd+bwd graph compiled with
                ``full_inductor_pass``; eager = ``F.rms_norm`` + autograd.

Settings (``torch._inductor.config.patch``)
-------------------------------------------
``inductor``                           Inductor's defaults
``inductor_no_all``                    the three knobs below off
``inductor_no_divisible_by_16``        ``triton.divisible_by_16=False``
``inductor_no_persistent_reductions``  ``triton.persistent_reductions=False``
``inductor_no_split_reductions``       ``split_reductions=False``

A knob the installed torch lacks (``hasattr`` on the config module / sub-config) makes
its row "knob missing"; it is reported, not skipped, and not counted as a failure.
Every (setting, benchmark) recompiles: ``torch._dynamo.reset()``, Inductor's FX graph,
AOTAutograd and autotune caches off, and with ``--kernel-cache fresh`` (default) a
fresh ``TORCHINDUCTOR_CACHE_DIR`` plus ``force_disable_caches`` (where it exists).
``--kernel-cache shared`` (default with ``--tiny``, to stay fast on 2 CPU cores)
keeps one cache dir, so Inductor still lowers and generates every kernel anew but
reuses the compiled binary of byte-identical kernel source (code caches are keyed
by the source hash: a knob that changes the code always compiles anew). The report
records ``kernels_generated`` (Inductor's codegen counter) per compile as proof.
The compile and the first call run under the setting.

Metrics: ``ms`` = median time of one call (bench_rmsnorm's ``make_timer``: CUDA
``triton.testing.do_bench`` with L2 flushed, CPU ``time.perf_counter`` median of
``--iters``); speedup = eager ms / compiled ms; ``geomean`` = geometric mean of a
setting's speedups over the benchmarks (only when all ran). The compiled outputs
must match eager (train step: loss + grads, rel <= 1e-3 fp32 / 5e-2 bf16; rmsnorm:
bench_rmsnorm's tolerance). Note: on CPU Inductor's C++ backend ignores the
``triton.*`` knobs. Exit status 1 when a setting whose knobs exist failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # allow running without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

SETTINGS: dict[str, dict[str, Any]] = {
    "inductor": {},
    "inductor_no_all": {"triton.divisible_by_16": False, "triton.persistent_reductions": False, "split_reductions": False},
    "inductor_no_divisible_by_16": {"triton.divisible_by_16": False},
    "inductor_no_persistent_reductions": {"triton.persistent_reductions": False},
    "inductor_no_split_reductions": {"split_reductions": False},
}  # fmt: skip
BENCHMARKS = ["train_step", "rmsnorm"]


def load_script(name: str):
    """Import ``scripts/<name>.py`` by path (registered in ``sys.modules`` for dataclasses)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def missing_knobs(patch: dict[str, Any], config=None) -> list[str]:
    """Keys of ``patch`` (dotted, e.g. ``triton.divisible_by_16``) that ``config``
    (default ``torch._inductor.config``) does not have."""
    if config is None:
        import torch._inductor.config as config
    missing = []
    for key in patch:
        *parents, leaf = key.split(".")
        obj = config
        for part in parents:
            obj = getattr(obj, part, None)
        if obj is None or not hasattr(obj, leaf):
            missing.append(key)
    return missing


def geomean(values: list[float]) -> float:
    """Geometric mean of positive numbers."""
    return math.exp(statistics.fmean(math.log(v) for v in values))


# --------------------------------------------------------------------------- benchmarks


def train_step_benchmark(args) -> dict[str, Any]:
    """``{"eager", "build", "check", "shape"}`` for the traced train step; ``build()``
    compiles a fresh copy and returns the step callable; ``check(out) -> rel err``."""
    fr = load_script("fusion_report")
    from graph_trainer.compiler.passes.full_inductor import full_inductor_pass

    built = fr.build_traced_step(args, args.extra)
    traced, inputs = built["traced"], built["inputs"]
    eager_gm = fr.copy_graph_module(traced.gm)

    def call(gm):
        def step():
            with torch.no_grad():
                return gm(*inputs)

        return step

    ref = call(eager_gm)()
    tol = 5e-2 if built["param_dtype"] == torch.bfloat16 else 1e-3
    return {
        "eager": call(eager_gm),
        "build": lambda: call(full_inductor_pass(fr.copy_graph_module(traced.gm), traced.example_inputs)),
        "check": lambda out: fr.compare_outputs(out, ref)["rel"],
        "tolerance": tol,
        "shape": f"{built['model_args'].n_layers} layers, seq {built['cfg'].training.seq_len} x batch "
        f"{built['cfg'].training.local_batch_size}, {str(built['param_dtype']).replace('torch.', '')}",
    }


def rmsnorm_benchmark(args) -> dict[str, Any]:
    """Same interface as :func:`train_step_benchmark` for bench_rmsnorm's problem."""
    bn = load_script("bench_rmsnorm")
    from graph_trainer.compiler.passes.full_inductor import full_inductor_pass

    m, n = args.norm_shape
    p = bn.Problem(m, n, bn.DTYPES[args.norm_dtype], torch.device(args.device), 1e-5)
    ref = tuple(t.detach() for t in bn.eager_fwd_bwd(p.x, p.w, p.dy, p.eps))

    def build():
        gm = bn.trace_fwd_bwd(p)
        gm = full_inductor_pass(gm, [nd.meta.get("val") for nd in gm.graph.nodes if nd.op == "placeholder"])
        return lambda: gm(p.xd, p.wd, p.dy)

    return {
        "eager": lambda: bn.eager_fwd_bwd(p.x, p.w, p.dy, p.eps),
        "build": build,
        "check": lambda out: bn.compare(out, ref)[1],
        "tolerance": bn.TOLERANCE[p.dtype],
        "shape": f"{m}x{n} {args.norm_dtype}",
    }


def run(args) -> dict[str, Any]:
    """Eager once per benchmark, then every setting x benchmark; returns the report."""
    bn, fr = load_script("bench_rmsnorm"), load_script("fusion_report")
    timer_args = SimpleNamespace(timer="do_bench", warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                                 warmup=args.warmup, iters=args.iters)  # fmt: skip
    bench, timer = bn.make_timer(torch.device(args.device), timer_args)
    builders = {"train_step": train_step_benchmark, "rmsnorm": rmsnorm_benchmark}
    benches, eager_ms = {}, {}
    for name in args.benchmarks:
        print(f"[ablate] {name}: eager ...", file=sys.stderr, flush=True)
        benches[name] = builders[name](args)
        eager_ms[name] = bench(benches[name]["eager"])
    root = Path(tempfile.mkdtemp(prefix="ablate_inductor_"))
    rows = []
    for s_i, setting in enumerate(args.settings):
        patch = SETTINGS[setting]
        row: dict[str, Any] = {"setting": setting, "patch": patch, "missing": missing_knobs(patch), "results": {}}
        if row["missing"]:
            row.update(status="knob missing", geomean=None)
            rows.append(row)
            continue
        for name, b in benches.items():
            print(f"[ablate] {setting} / {name} ...", file=sys.stderr, flush=True)
            res: dict[str, Any] = {"status": "ok"}
            try:
                t0 = time.perf_counter()
                cache = root if args.kernel_cache == "shared" else root / f"{s_i}_{name}"
                with fr.capture_generated_code(cache, patch, force_disable=args.kernel_cache == "fresh") as info:
                    step = b["build"]()
                    out = step()  # first call (lazy compile / autotune) under the setting
                res["compile_s"] = round(time.perf_counter() - t0, 2)
                res["kernels_generated"] = info["kernels_generated"]
                res["rel_err"] = float(b["check"](out))
                res["ms"] = bench(step)
                res["speedup"] = eager_ms[name] / res["ms"]
                if not res["rel_err"] <= b["tolerance"]:
                    res.update(status="mismatch", reason=f"rel err {res['rel_err']:.2e} > {b['tolerance']}")
            except Exception as e:  # keep going: one broken setting must not hide the others
                res.update(status="failed", reason=f"{type(e).__name__}: {e}")
                traceback.print_exc()
            row["results"][name] = res
        ok = all(r["status"] == "ok" and r["speedup"] > 0 and math.isfinite(r["speedup"]) for r in row["results"].values())
        row["status"] = "ok" if ok else "failed"
        row["geomean"] = geomean([r["speedup"] for r in row["results"].values()]) if ok else None
        rows.append(row)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or "cpu"),
        "device_type": args.device, "torch": torch.__version__, "timer": timer, "cpu_threads": torch.get_num_threads(),
        "kernel_cache": args.kernel_cache,
        "benchmarks": args.benchmarks, "shapes": {n: b["shape"] for n, b in benches.items()},
        "eager_ms": eager_ms, "tolerance": {n: b["tolerance"] for n, b in benches.items()}, "rows": rows,
    }  # fmt: skip


def markdown_table(report: dict[str, Any]) -> str:
    """One row per setting: speedup over eager per benchmark and their geomean."""
    names = report["benchmarks"]
    shapes = ", ".join(f"{n} {report['shapes'][n]} eager {report['eager_ms'][n]:.3f} ms" for n in names)
    lines = [
        f"Inductor knob ablation on {report['device']} (torch {report['torch']}): speedup over eager; {shapes}; {report['timer']}",
        "",
        "| setting | " + " | ".join(names) + " | geomean |",
        "|---|" + "---:|" * (len(names) + 1),
    ]
    for row in report["rows"]:
        if row["status"] == "knob missing":
            cell = f"knob missing ({', '.join(row['missing'])})"
            lines.append(f"| {row['setting']} | " + " | ".join([cell] * len(names)) + f" | {cell} |")
            continue
        cells = []
        for n in names:
            r = row["results"][n]
            cells.append(f"{r['speedup']:.2f}x" if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')[:80]}")
        gm = f"{row['geomean']:.2f}x" if row["geomean"] is not None else "n/a"
        lines.append(f"| {row['setting']} | " + " | ".join(cells) + f" | {gm} |")
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int]:
    m, _, n = text.lower().partition("x")
    return int(m), int(n)


def _names(valid: list[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        unknown = [s for s in names if s not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown or [text]}; choose from {', '.join(valid)}")
        return names

    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1] + "\nOther --section.key value flags go to graph_trainer.config.parse_args.")  # fmt: skip
    ap.add_argument("--settings", type=_names(list(SETTINGS), "setting"), default=list(SETTINGS),
                    help=f"comma-separated subset of {', '.join(SETTINGS)}")  # fmt: skip
    ap.add_argument("--benchmarks", type=_names(BENCHMARKS, "benchmark"), default=BENCHMARKS, help=f"subset of {BENCHMARKS}")
    fr = load_script("fusion_report")
    fr.add_step_args(ap, "CI mode: CPU, fp32, 1-layer debug model seq 32, norm 256x128, 3 iters")
    ap.add_argument("--norm-shape", type=_shape, default=None, help="RMSNorm MxN (default 32768x4096; 256x128 --tiny)")
    ap.add_argument("--norm-dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 CUDA, fp32 CPU")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (CPU / no triton; default 20, 3 --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup iterations (CPU; default 3, 1 --tiny)")
    ap.add_argument("--rep-ms", type=float, default=200.0, help="do_bench measuring time (CUDA)")
    ap.add_argument("--warmup-ms", type=float, default=50.0, help="do_bench warmup time (CUDA)")
    ap.add_argument("--kernel-cache", choices=["fresh", "shared"], default=None,
                    help="fresh: new Inductor cache dir + force_disable_caches per compile (default); shared: one "
                         "dir, FX-graph/AOT/autotune caches off, compiled binaries of identical kernel source "
                         "reused (default with --tiny)")  # fmt: skip
    args, extra = ap.parse_known_args(argv)
    args.extra = extra  # --section.key value overrides for graph_trainer.config.parse_args
    fr.resolve_step_args(ap, args)
    args.norm_shape = args.norm_shape or ((256, 128) if args.tiny else (32768, 4096))
    args.norm_dtype = args.norm_dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.kernel_cache = args.kernel_cache or ("shared" if args.tiny else "fresh")
    args.iters = args.iters or (3 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)

    report = fr.run_and_print(lambda: run(args), markdown_table, args.json)
    if isinstance(report, int):
        return report
    failed = [r["setting"] for r in report["rows"] if r["status"] == "failed"]
    if failed:
        print(f"failed settings: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
