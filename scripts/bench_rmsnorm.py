#!/usr/bin/env python3
"""RMSNorm forward + backward microbenchmark at Llama shapes.

Every variant computes, for ``x: [M, N]``, ``w: [N]`` and ``dy: [M, N]``::

    y = F.rms_norm(x, (N,), w, eps)
    dx, dw = torch.autograd.grad(y, (x, w), dy)

With ``--residual``, the residual add + RMSNorm of a transformer block (the kernel of
``--compile.passes residual_rmsnorm``), for the residual ``r`` and the residual stream's
gradient ``dh``, both ``[M, N]``::

    h = x + r
    y = F.rms_norm(h, (N,), w, eps)
    dx, dw = torch.autograd.grad((y, h), (x, w), (dy, dh))     # dr = dx

Variants
--------
``eager``          F.rms_norm + autograd (on CUDA: the fused ATen kernels).
``make_fx``        the same function traced by ``make_fx`` into one fwd+bwd
                   GraphModule, run uncompiled (what the traced train step does
                   without passes).
``regional``       the make_fx graph after
                   ``graph_trainer.compiler.passes.annotate_rmsnorm_for_regional_inductor_pass``
                   and ``regional_inductor_pass``: the forward norm and the
                   backward norm each compiled by Inductor as one region. One
                   variant per ``--inductor-configs`` entry (``regional[NAME]``;
                   the entry named ``default`` is plain ``regional``). With
                   ``--residual`` also ``annotate_residual_rmsnorm``: the add and
                   the gradient sum join the norms' regions.
``torch.compile``  ``torch.compile`` of the norm (static shapes); AOTAutograd
                   compiles the forward and the backward.
``liger``          ``liger_kernel`` RMSNorm (Triton), when importable.
``quack``          ``quack`` RMSNorm (CuTe DSL), when importable.

``liger`` and ``quack`` are optional: reported as ``unavailable`` when they
cannot be imported or run here (and with ``--residual``, which they do not
implement); all other variants must run and match eager.

Metrics
-------
* ``ms``: median time of one fwd+bwd. CUDA: ``triton.testing.do_bench``
  (CUDA events, L2 flushed before each iteration, median), or with
  ``--timer events`` (also the fallback without triton) a CUDA-event loop of
  ``--iters`` iterations with the same L2 flush; CPU: ``time.perf_counter``,
  median of ``--iters``.
* ``GB/s``: ``5 * M * N * itemsize`` bytes (x read, y written, dy read, x read
  again, dx written; the [N] weight is ignored) / time. 10*M*N bytes in bf16.
  ``--residual``: ``8 * M * N * itemsize`` (x, r read, h, y written; dy, dh,
  h read, dx written).
* ``% copy``: that bandwidth relative to a device-to-device ``dst.copy_(src)``
  of a large bf16 buffer measured in the same run (counted as 2 x its size).
* ``% same-bytes copy``: relative to a copy that moves the variant's bytes (a
  buffer of half of them), timed the same way: what one kernel moving that much
  reaches at this size (launch and tail included), the row ``copy (same bytes)``.
* ``max |diff|``: max abs difference of y, dx, dw against eager; ``rel`` is the
  largest of them divided by the max abs value of the eager output; ``ok`` is
  ``rel <= tolerance`` (bf16 2e-2, fp16 1e-2, fp32 1e-4).

Examples
--------
::

    python scripts/bench_rmsnorm.py --json rmsnorm.json
    python scripts/bench_rmsnorm.py --variants eager,regional \\
        --inductor-configs default='{}' \\
        --inductor-configs cdt='{"coordinate_descent_tuning": true}' \\
        --inductor-configs nomix='{"triton.mix_order_reduction": false}'
    python scripts/bench_rmsnorm.py --tiny --json /tmp/tiny.json   # CPU, seconds

Exit status is 1 when a required (non-optional) variant failed or did not match
eager, so CI can run ``--tiny``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # allow running without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

LLAMA_SHAPES = [(32768, 4096), (16384, 8192), (65536, 2048)]
TINY_SHAPES = [(256, 128)]
ALL_VARIANTS = ["eager", "make_fx", "regional", "torch.compile", "liger", "quack"]
OPTIONAL_VARIANTS = {"liger", "quack"}
SAME_BYTES_COPY = "copy (same bytes)"  # a reference row per shape, not a variant
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (y, dx, dw)


class Unavailable(Exception):
    """The variant cannot run in this environment (missing package / device)."""


@dataclass
class Problem:
    """Inputs of one shape. ``x`` and ``w`` are leaves that require grad;
    ``xd`` / ``wd`` are detached views for graph variants."""

    m: int
    n: int
    dtype: torch.dtype
    device: torch.device
    eps: float
    residual: bool = False
    x: torch.Tensor = field(init=False)
    w: torch.Tensor = field(init=False)
    dy: torch.Tensor = field(init=False)

    def __post_init__(self):
        g = torch.Generator(device=self.device).manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g, device=self.device)  # noqa: E731
        self.x = mk(self.m, self.n).to(self.dtype).requires_grad_(True)
        self.w = (1.0 + 0.1 * mk(self.n)).to(self.dtype).requires_grad_(True)
        self.dy = mk(self.m, self.n).to(self.dtype)
        self.xd, self.wd = self.x.detach(), self.w.detach()
        self.r = self.dh = None
        if self.residual:
            self.r = mk(self.m, self.n).to(self.dtype).requires_grad_(True)
            self.dh = mk(self.m, self.n).to(self.dtype)

    def args(self, detached: bool = False) -> tuple:
        """The arguments of :func:`eager_fwd_bwd` (detached leaves for graph variants)."""
        x, w = (self.xd, self.wd) if detached else (self.x, self.w)
        extra = () if not self.residual else (self.r.detach() if detached else self.r, self.dh)
        return (x, w, self.dy, *extra)

    @property
    def bytes_moved(self) -> int:
        return (8 if self.residual else 5) * self.m * self.n * self.x.element_size()


@dataclass
class Result:
    variant: str
    shape: list[int]
    status: str  # "ok" | "unavailable" | "failed"
    reason: str | None = None
    ms: float | None = None
    GBps: float | None = None
    pct_of_copy_bw: float | None = None
    pct_of_same_bytes_copy: float | None = None
    speedup_vs_eager: float | None = None
    max_abs_diff: dict[str, float] | None = None
    rel_err: float | None = None
    ok: bool | None = None
    setup_s: float | None = None
    inductor_configs: dict[str, Any] | None = None
    pass_stats: dict[str, Any] | None = None


# --------------------------------------------------------------------------- variants


def eager_fwd_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float,
                  r: torch.Tensor | None = None, dh: torch.Tensor | None = None) -> Outputs:
    if r is None:
        y = F.rms_norm(x, (x.shape[-1],), w, eps)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        return y, dx, dw
    h = x + r
    y = F.rms_norm(h, (h.shape[-1],), w, eps)
    dx, dw = torch.autograd.grad((y, h), (x, w), (dy, dh))
    return y, dx, dw


def trace_fwd_bwd(p: Problem) -> torch.fx.GraphModule:
    """make_fx (fake tensors) of ``eager_fwd_bwd`` with the node metadata that
    graph_trainer's tracer writes (``phase`` and ``module_fqn``), so the
    RMSNorm annotation pass recognises both the fused (CUDA) and the decomposed
    (CPU) form."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer import MODULE_FQN_KEY, PHASE_KEY

    def body(x, w, dy, r, dh):
        h = x
        if r is not None:  # the block's residual add, outside the norm module
            with fx_traceback.annotate({PHASE_KEY: "forward", MODULE_FQN_KEY: "block"}):
                h = x + r
        with fx_traceback.annotate({PHASE_KEY: "forward", MODULE_FQN_KEY: "norm"}):
            y = F.rms_norm(h, (h.shape[-1],), w, p.eps)
        with fx_traceback.annotate({PHASE_KEY: "backward", MODULE_FQN_KEY: "norm"}):
            if r is None:
                dx, dw = torch.autograd.grad(y, (x, w), dy)
            else:
                dx, dw = torch.autograd.grad((y, h), (x, w), (dy, dh))
        return y, dx, dw

    def fwd_bwd(x, w, dy):  # make_fx traces every parameter of the function: one per arity
        return body(x, w, dy, None, None)

    def fwd_bwd_residual(x, w, dy, r, dh):
        return body(x, w, dy, r, dh)

    with fx_traceback.preserve_node_meta():
        return make_fx(fwd_bwd_residual if p.residual else fwd_bwd, tracing_mode="fake")(*p.args())


def build_eager(p: Problem) -> Callable[[], Outputs]:
    x, w, dy, *extra = p.args()
    return lambda: eager_fwd_bwd(x, w, dy, p.eps, *extra)


def build_make_fx(p: Problem) -> Callable[[], Outputs]:
    gm = trace_fwd_bwd(p)
    return lambda: gm(*p.args(detached=True))


def build_regional(p: Problem, inductor_configs: dict[str, Any] | None, result: Result) -> Callable[[], Outputs]:
    """``inductor_configs=None``: the guarded tuning of ``--compile.rmsnorm.tune``
    (Inductor defaults and DEFAULT_RMSNORM_CANDIDATE_CONFIGS compiled and timed per
    region, fastest kept); ``result.setup_s`` holds the compile cost."""
    try:
        from graph_trainer.compiler.passes.annotate_rmsnorm import DEFAULT_RMSNORM_CANDIDATE_CONFIGS, annotate_rmsnorm_for_regional_inductor_pass
        from graph_trainer.compiler.passes.regional_inductor import regional_inductor_pass
    except ImportError as e:
        raise Unavailable(f"graph_trainer.compiler.passes does not export the regional passes yet: {e}") from e
    gm = trace_fwd_bwd(p)
    example_inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    tune = inductor_configs is None
    gm = annotate_rmsnorm_for_regional_inductor_pass(
        gm, example_inputs, {} if tune else inductor_configs, DEFAULT_RMSNORM_CANDIDATE_CONFIGS if tune else None
    )
    annotate_stats = dict(getattr(gm, "meta", {}).get("graph_trainer_pass_stats", {}))
    if p.residual:
        from graph_trainer.compiler.passes.annotate_residual_rmsnorm import (
            annotate_residual_rmsnorm_for_regional_inductor_pass)

        gm = annotate_residual_rmsnorm_for_regional_inductor_pass(gm, example_inputs)
        residual_stats = dict(getattr(gm, "meta", {}).get("graph_trainer_pass_stats", {}))
    gm = regional_inductor_pass(gm, example_inputs)
    compile_stats = dict(getattr(gm, "meta", {}).get("graph_trainer_pass_stats", {}))
    result.pass_stats = {
        "regions": compile_stats.get("regions"),
        "tagged_nodes": compile_stats.get("tagged_nodes"),
        "compile_s": compile_stats.get("compile_s"),
        "norms_forward": annotate_stats.get("forward"),
        "norms_backward": annotate_stats.get("backward"),
        **({"residual_adds": residual_stats} if p.residual else {}),
        "selections": [
            {"inputs": x["inputs"], "ms": [round(t, 4) for t in x["ms"]], "chosen": x["configs"][x["chosen"]]}
            for x in compile_stats.get("selections", [])
        ],
    }
    if not compile_stats.get("regions"):
        raise RuntimeError(f"regional_inductor_pass compiled no region (annotation stats: {annotate_stats})")
    args = p.args(detached=True)
    return lambda: gm(*args)


def build_torch_compile(p: Problem) -> Callable[[], Outputs]:
    n, eps = p.n, p.eps
    if p.residual:
        add_norm = torch.compile(lambda x, r, w: ((h := x + r), F.rms_norm(h, (n,), w, eps)), dynamic=False)

        def step():
            h, y = add_norm(p.x, p.r, p.w)
            dx, dw = torch.autograd.grad((y, h), (p.x, p.w), (p.dy, p.dh))
            return y, dx, dw

        return step
    norm = torch.compile(lambda x, w: F.rms_norm(x, (n,), w, eps), dynamic=False)

    def step():
        y = norm(p.x, p.w)
        dx, dw = torch.autograd.grad(y, (p.x, p.w), p.dy)
        return y, dx, dw

    return step


def build_liger(p: Problem) -> Callable[[], Outputs]:
    if p.residual:
        raise Unavailable("no residual-add variant")
    if p.device.type != "cuda":
        raise Unavailable("liger needs CUDA")
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as e:
        raise Unavailable(f"liger_kernel not importable: {e}") from e

    def step():
        # (x, w, eps, offset, casting_mode, in_place): in_place=False keeps dy intact.
        y = LigerRMSNormFunction.apply(p.x, p.w, p.eps, 0.0, "llama", False)
        dx, dw = torch.autograd.grad(y, (p.x, p.w), p.dy)
        return y, dx, dw

    return step


def build_quack(p: Problem) -> Callable[[], Outputs]:
    if p.residual:
        raise Unavailable("no residual-add variant")
    if p.device.type != "cuda":
        raise Unavailable("quack needs CUDA")
    try:
        from quack.rmsnorm import rmsnorm
    except Exception as e:  # ImportError, or cutlass/cuda bindings failing to load
        raise Unavailable(f"quack not importable: {type(e).__name__}: {e}") from e

    def step():
        y = rmsnorm(p.x, p.w, eps=p.eps)
        dx, dw = torch.autograd.grad(y, (p.x, p.w), p.dy)
        return y, dx, dw

    try:
        step()
    except Exception as e:  # e.g. unsupported GPU architecture / API change
        raise Unavailable(f"quack failed to run: {type(e).__name__}: {e}") from e
    return step


# --------------------------------------------------------------------------- timing


def make_timer(device: torch.device, args) -> tuple[Callable[[Callable[[], Any]], float], str]:
    """Return ``(bench(fn) -> median ms, description)``."""
    if device.type == "cuda" and args.timer == "do_bench":
        try:
            from triton.testing import do_bench

            def bench(fn):
                return float(do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))

            return bench, f"triton.testing.do_bench(warmup={args.warmup_ms}ms, rep={args.rep_ms}ms, median, L2 flushed)"
        except ImportError:
            pass
    if device.type == "cuda":
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)

        def bench(fn):
            for _ in range(args.warmup):
                fn()
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            for s, e in zip(starts, ends):
                flush.zero_()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize(device)
            return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

        return bench, f"CUDA events, {args.warmup} warmup + median of {args.iters} (L2 flushed)"

    def bench(fn):
        for _ in range(args.warmup):
            fn()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return bench, f"time.perf_counter, {args.warmup} warmup + median of {args.iters}"


def copy_bandwidth(device: torch.device, mib: float, bench) -> dict[str, float]:
    """Device-to-device copy bandwidth of a ``mib`` MiB bf16 buffer (read + write)."""
    numel = int(mib * 2**20) // 2
    src = torch.randn(numel, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    nbytes = 2 * numel * 2
    return {"buffer_MiB": mib, "bytes": nbytes, "ms": ms, "GBps": nbytes / (ms * 1e-3) / 1e9}


# --------------------------------------------------------------------------- driver


def compare(out: Outputs, ref: Outputs) -> tuple[dict[str, float], float]:
    diffs, rel = {}, 0.0
    for name, a, b in zip(("y", "dx", "dw"), out, ref):
        a, b = a.detach().float(), b.detach().float()
        if a.shape != b.shape:
            raise RuntimeError(f"{name}: shape {tuple(a.shape)} != eager {tuple(b.shape)}")
        d = (a - b).abs().max().item()
        diffs[name] = d
        scale = b.abs().max().item()
        rel = max(rel, d / scale if scale > 0 else d)
    return diffs, rel


def parse_inductor_configs(values: list[str] | None) -> dict[str, dict[str, Any]]:
    """``NAME=JSON``, ``JSON`` or ``guarded`` entries -> ordered ``{name: config}``.

    ``guarded`` (config ``None``) is ``--compile.rmsnorm.tune``: Inductor's defaults
    plus the candidate configs, timed per region, fastest kept. Nothing given:
    ``{"default": {}, "guarded": None}``."""
    if not values:
        return {"default": {}, "guarded": None}
    configs: dict[str, dict[str, Any]] = {}
    for i, raw in enumerate(values):
        raw = raw.strip()
        if raw == "guarded":
            configs["guarded"] = None
            continue
        if raw.startswith("{"):
            text = raw
            name = "default" if json.loads(raw) == {} else f"cfg{i}"
        else:
            name, sep, text = raw.partition("=")
            if not sep:
                raise SystemExit(f"--inductor-configs: expected NAME=JSON or JSON, got {raw!r}")
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--inductor-configs {name}: invalid JSON {text!r}: {e}") from e
        if not isinstance(cfg, dict):
            raise SystemExit(f"--inductor-configs {name}: expected a JSON object, got {text!r}")
        if name in configs:
            raise SystemExit(f"--inductor-configs: duplicate name {name!r}")
        configs[name] = cfg
    return configs


def regional_name(config_name: str) -> str:
    return "regional" if config_name == "default" else f"regional[{config_name}]"


SIMPLE_BUILDERS = {
    "eager": build_eager,
    "make_fx": build_make_fx,
    "torch.compile": build_torch_compile,
    "liger": build_liger,
    "quack": build_quack,
}


def variant_builders(variants: list[str], configs: dict[str, dict[str, Any]], p: Problem):
    """``(name, builder(result) -> step)`` for every requested variant, in order;
    ``regional`` expands to one entry per Inductor config."""
    for v in variants:
        if v != "regional":
            yield v, (lambda res, b=SIMPLE_BUILDERS[v]: b(p))
            continue
        for cname, cfg in configs.items():

            def build(res: Result, cfg=cfg):
                res.inductor_configs = cfg
                return build_regional(p, cfg, res)

            yield regional_name(cname), build


def run_variant(name, builder, p: Problem, ref: Outputs | None, bench, copy_gbps, tol) -> Result:
    res = Result(variant=name, shape=[p.m, p.n], status="ok")
    try:
        t0 = time.perf_counter()
        step = builder(res)
        out = step()  # first call (compiles for torch.compile)
        if p.device.type == "cuda":
            torch.cuda.synchronize(p.device)
        res.setup_s = round(time.perf_counter() - t0, 3)
        if ref is not None:
            res.max_abs_diff, res.rel_err = compare(out, ref)
            res.ok = bool(res.rel_err <= tol)
        del out
        res.ms = bench(step)
        res.GBps = p.bytes_moved / (res.ms * 1e-3) / 1e9
        res.pct_of_copy_bw = 100.0 * res.GBps / copy_gbps
    except Unavailable as e:
        res.status, res.reason = "unavailable", str(e)
    except Exception as e:  # keep going: one broken variant must not hide the others
        res.status, res.reason = "failed", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return res


def run(args) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    tol = args.tolerance if args.tolerance is not None else TOLERANCE[dtype]
    configs = parse_inductor_configs(args.inductor_configs)
    bench, timer = make_timer(device, args)

    copy = copy_bandwidth(device, args.copy_mib, bench)
    print(f"copy bandwidth ({copy['buffer_MiB']} MiB bf16): {copy['GBps']:.1f} GB/s", file=sys.stderr)

    results: list[Result] = []
    for m, n in args.shapes:
        torch._dynamo.reset()
        p = Problem(m, n, dtype, device, args.eps, args.residual)
        ref = tuple(t.detach() for t in build_eager(p)())
        same = copy_bandwidth(device, p.bytes_moved / 2 / 2**20, bench)  # reads + writes p.bytes_moved
        shape_results = [Result(variant=SAME_BYTES_COPY, shape=[m, n], status="ok", ms=same["ms"],
                                GBps=same["GBps"], pct_of_copy_bw=100.0 * same["GBps"] / copy["GBps"])]
        for name, builder in variant_builders(args.variants, configs, p):
            print(f"[{m}x{n}] {name} ...", file=sys.stderr, flush=True)
            r = run_variant(name, builder, p, ref, bench, copy["GBps"], tol)
            shape_results.append(r)
            if r.ms:  # one line per variant as it lands, so a run cut short still says something
                print(f"[{m}x{n}] {name}: {r.ms:.3f} ms, {r.GBps:.0f} GB/s, rel {r.rel_err or 0:.1e}, setup {r.setup_s or 0:.1f} s", file=sys.stderr, flush=True)
        eager_ms = next((r.ms for r in shape_results if r.variant == "eager" and r.ms), None)
        for r in shape_results:
            if eager_ms and r.ms and r.variant != SAME_BYTES_COPY:
                r.speedup_vs_eager = eager_ms / r.ms
            if r.GBps:
                r.pct_of_same_bytes_copy = 100.0 * (r.GBps / same["GBps"])  # exactly 100 for the copy itself
        results.extend(shape_results)
        del p, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "dtype": str(dtype).replace("torch.", ""),
        "eps": args.eps,
        "timer": timer,
        "residual": args.residual,
        "bytes_formula": ("8*M*N*itemsize (x, r read, h, y write; dy, dh, h read, dx write)" if args.residual else
                          "5*M*N*itemsize (x read, y write, dy read, x read again, dx write)"),
        "tolerance": tol,
        "copy": copy,
        "shapes": [list(s) for s in args.shapes],
        "variants": args.variants,
        "optional_variants": sorted(OPTIONAL_VARIANTS),
        "inductor_configs": configs,
        "results": [asdict(r) for r in results],
    }


def markdown_table(report: dict[str, Any]) -> str:
    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    lines = [
        f"{'residual add + ' if report.get('residual') else ''}RMSNorm fwd+bwd, {report['dtype']}, "
        f"eps={report['eps']}, on {report['device']} "
        f"(torch {report['torch']}); copy bandwidth {report['copy']['GBps']:.0f} GB/s; {report['timer']}",
        "",
        "| shape (M x N) | variant | ms | GB/s | % copy BW | % same-bytes copy | vs eager | max abs diff y / dx / dw "
        "| rel | ok |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in report["results"]:
        shape = f"{r['shape'][0]} x {r['shape'][1]}"
        if r["status"] != "ok":
            lines.append(f"| {shape} | {r['variant']} | {r['status']}: {r['reason'][:120]} | | | | | | | |")
            continue
        d = r["max_abs_diff"] or {}
        diffs = " / ".join(f"{d.get(k, float('nan')):.2e}" for k in ("y", "dx", "dw")) if d else ""
        lines.append(
            f"| {shape} | {r['variant']} | {f(r['ms'], '.3f')} | {f(r['GBps'], '.0f')} | "
            f"{f(r['pct_of_copy_bw'], '.1f')} | {f(r['pct_of_same_bytes_copy'], '.1f')} | "
            f"{f(r['speedup_vs_eager'], '.2f')}{'x' if r['speedup_vs_eager'] else ''} | {diffs} | "
            f"{f(r['rel_err'], '.1e')} | {'' if r['ok'] is None else 'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        m, _, n = item.strip().lower().partition("x")
        shapes.append((int(m), int(n)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the variants and metrics.")  # fmt: skip
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    ap.add_argument("--tiny", action="store_true", help="CI mode: CPU, fp32, 256x128, 3 iterations, 1 thread")
    ap.add_argument("--shapes", type=parse_shapes, default=None,
                    help="comma-separated MxN (default: 32768x4096,16384x8192,65536x2048)")  # fmt: skip
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (fp32 with --tiny)")
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--residual", action="store_true",
                    help="the residual add + RMSNorm of a block (module docstring); regional adds "
                         "annotate_residual_rmsnorm")  # fmt: skip
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS),
                    help=f"comma-separated subset of {ALL_VARIANTS}")  # fmt: skip
    ap.add_argument("--inductor-configs", action="append", metavar="[NAME=]JSON",
                    help="Inductor config dict for the regional variant (repeatable: one regional "
                         "variant per entry; NAME 'default' or a bare '{}' is plain 'regional')")  # fmt: skip
    ap.add_argument("--iters", type=int, default=None, help="timed iterations (CPU, --timer events; default 20, 3 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup iterations (CPU, --timer events; default 3, 1 with --tiny)")
    ap.add_argument("--timer", choices=["do_bench", "events"], default="do_bench",
                    help="CUDA timing: triton.testing.do_bench (falls back to 'events' without triton) or "
                         "a CUDA-event loop of --warmup + --iters iterations; both flush L2 and take the median")  # fmt: skip
    ap.add_argument("--rep-ms", type=float, default=200.0, help="do_bench measuring time per variant (CUDA)")
    ap.add_argument("--warmup-ms", type=float, default=50.0, help="do_bench warmup time per variant (CUDA)")
    ap.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth buffer size (default 1024 MiB CUDA, 16 MiB CPU)")
    ap.add_argument("--tolerance", type=float, default=None, help="max rel error vs eager (default by dtype)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads (default: torch's; 1 with --tiny, robust on a busy CI box)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="write the full report here")
    args = ap.parse_args(argv)

    if args.device is None:
        args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    args.shapes = args.shapes or (TINY_SHAPES if args.tiny else LLAMA_SHAPES)
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    args.iters = args.iters or (3 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.copy_mib = args.copy_mib or (1024 if args.device == "cuda" else 16)
    if args.threads or (args.tiny and args.device == "cpu"):
        torch.set_num_threads(args.threads or 1)  # before any compile: Inductor's C++ kernels bake it in
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in ALL_VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {ALL_VARIANTS}")

    report = run(args)
    print(markdown_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}", file=sys.stderr)

    bad = [
        f"{r['variant']} {r['shape']}: {r['status']}{'' if r['ok'] in (None, True) else ' (mismatch)'}"
        for r in report["results"]
        if r["variant"] not in (*OPTIONAL_VARIANTS, SAME_BYTES_COPY)
        and (r["status"] != "ok" or not r["ok"] or not math.isfinite(r["ms"]))
    ]
    if bad:
        print("required variants failed: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
