#!/usr/bin/env python3
"""The matmuls of one Llama3 training step, each timed with its inputs in L2 and with L2 flushed.

For every linear of a transformer block (``wq wk wv wo w1 w3 w2``) and the output projection,
with ``X: [T, in]``, ``W: [out, in]`` and ``dY: [T, out]`` (``T = --tokens``), the three
matmuls of its forward and backward, as the traced step calls them::

    fwd  Y  = X  @ W.t()      dX = dY @ W      dW = dY.t() @ X

``--tp N`` splits the block's linears as tensor parallelism does (``wq wk wv w1 w3``: ``out / N``;
``wo w2``: ``in / N``); the output projection is column-parallel (``out / N``).

Columns: ``calls`` per step (``n_layers`` for a block's linear, 1 for the output projection);
``ms warm``: the median of back-to-back calls with the same inputs (as much of them in L2 as
fits, as when a matmul runs right after the kernel that wrote its input); ``ms cold``: the
median with L2 flushed before each call (a write of ``--flush-mib``); ``cold / warm``; on
CUDA ``ms idle``: the median with a spin kernel of :data:`IDLE_CYCLES` before each call, which
leaves L2 as it is but lets the GPU's power draw fall, as memory-bound work between matmuls does;
``TFLOP/s`` at ``ms cold`` (``2 * M * N * K`` per call); on CUDA the kernel that ran (cuBLAS
names its tile shape and the operands' transposes). Timing: CUDA events around each call, all
calls queued before one synchronize (CUDA); ``time.perf_counter`` (CPU). What the table is for: docs/perf_archive.md, "Kernel by kernel".

Example::

    python3 scripts/bench_matmuls.py --flavor 1B --tokens 8192
    python3 scripts/bench_matmuls.py --flavor 8B --tokens 8192 --tp 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # without `pip install -e .`

from graph_trainer.errors import UserError  # noqa: E402
from graph_trainer.model import build_model, flavors, model_args  # noqa: E402

#: GPU clock cycles of the spin kernel before each call of ``ms idle`` (≈ 0.1 ms at 2 GHz).
IDLE_CYCLES = 200_000

#: (name, column-parallel under TP): a block's linears in torchtitan's Llama3.
BLOCK_LINEARS = (("wq", True), ("wk", True), ("wv", True), ("wo", False), ("w1", True), ("w3", True), ("w2", False))


def linear_shapes(flavor: str, tp: int = 1) -> list[tuple[str, int, int, int]]:
    """``(name, in, out, calls per step)`` of ``flavor``'s linears on one TP rank of ``tp``, read from
    the weights of torchtitan's model built on the meta device.

    Raises:
        UserError: unknown flavor; ``tp`` does not divide a split dimension.
    """
    args = model_args(flavor)
    model = build_model(args, "meta")
    weights = {name.rsplit(".", 1)[-1]: m.weight for name, m in model.layers["0"].named_modules()
               if isinstance(m, torch.nn.Linear)}  # wq, wk, ..., w3
    weights["output"] = model.output.weight
    out = []
    for name, column in BLOCK_LINEARS + (("output", True),):
        o, i = weights[name].shape  # nn.Linear: [out, in]
        split = o if column else i
        if split % tp:
            raise UserError(f"--tp {tp} does not divide {name}'s {'out' if column else 'in'} dimension ({split}).")
        out.append((name, i if column else i // tp, o // tp if column else o, 1 if name == "output" else args.n_layers))
    return out


def _timed(fn, iters: int, device: torch.device, flush=None) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, ``flush()`` (untimed) before each.

    On CUDA every call is queued behind the previous one (events around each, one synchronize at
    the end), so the GPU is never idle while the host launches: the events time the kernel only,
    not a launch from an idle GPU."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            if flush is not None:
                flush()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _kernel(fn) -> str:
    """The name of the longest CUDA kernel ``fn()`` launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return max(rows, key=lambda e: e.self_device_time_total).key if rows else "?"


def bench(flavor: str, tokens: int, tp: int = 1, dtype: torch.dtype = torch.bfloat16, iters: int = 20,
          device: str | None = None, flush_mib: int = 512) -> list[dict]:
    """One row per matmul (see the module docstring): ``{"linear", "op", "m", "n", "k", "calls",
    "ms_warm", "ms_cold", "ms_idle" (None on CPU), "tflops", "kernel"}``; times in ms per call,
    ``tflops`` at ``ms_cold``.

    Raises:
        UserError: as :func:`linear_shapes`.
    """
    shapes = linear_shapes(flavor, tp)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scratch = torch.empty(flush_mib * 2**20 // 4, dtype=torch.float32, device=dev)
    rows = []
    for name, i, o, calls in shapes:
        x, w, dy = (torch.randn(*s, dtype=dtype, device=dev) for s in ((tokens, i), (o, i), (tokens, o)))
        for op, fn, (m, n, k) in (("fwd Y = X @ W.t()", lambda: x @ w.t(), (tokens, o, i)),
                                  ("dX = dY @ W", lambda: dy @ w, (tokens, i, o)),
                                  ("dW = dY.t() @ X", lambda: dy.t() @ x, (o, i, tokens))):
            fn()  # cuBLAS's heuristics and workspace, once
            warm = _timed(fn, iters, dev)
            cold = _timed(fn, iters, dev, flush=scratch.zero_)
            idle = _timed(fn, iters, dev, flush=lambda: torch.cuda._sleep(IDLE_CYCLES)) if dev.type == "cuda" else None
            rows.append({"linear": name, "op": op, "m": m, "n": n, "k": k, "calls": calls, "ms_warm": warm,
                         "ms_cold": cold, "ms_idle": idle, "tflops": 2 * m * n * k / cold / 1e9,
                         "kernel": _kernel(fn) if dev.type == "cuda" else "-"})
        del x, w, dy
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows of :func:`bench` as a markdown table, and the step's sums (ms per step)."""
    lines = ["| linear | matmul | M × N × K | calls | ms warm | ms cold | cold / warm | ms idle | TFLOP/s (cold) "
             "| kernel |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        idle = "-" if r["ms_idle"] is None else f"{r['ms_idle']:.3f}"
        lines.append(f"| {r['linear']} | {r['op']} | {r['m']} × {r['n']} × {r['k']} | {r['calls']} | "
                     f"{r['ms_warm']:.3f} | {r['ms_cold']:.3f} | {r['ms_cold'] / r['ms_warm']:.2f} | {idle} | "
                     f"{r['tflops']:.0f} | `{r['kernel']}` |")
    warm, cold = (sum(r[k] * r["calls"] for r in rows) for k in ("ms_warm", "ms_cold"))
    line = f"per step (calls × ms): warm {warm:.2f} ms, cold {cold:.2f} ms ({cold / warm:.3f}×)"
    if rows and rows[0]["ms_idle"] is not None:
        idle = sum(r["ms_idle"] * r["calls"] for r in rows)
        line += f", idle {idle:.2f} ms ({idle / warm:.3f}×)"
    lines += ["", line]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="1B", help="a Llama3 flavor of graph_trainer.llama3 (default 1B)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step on the rank: batch × seq (default 8192)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--iters", type=int, default=20, help="timed calls per matmul and condition (default 20)")
    p.add_argument("--flush-mib", type=int, default=512, help="MiB written to flush L2 (default 512)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when there")
    args = p.parse_args(argv)
    if args.flavor not in flavors():
        p.error(f"--flavor {args.flavor}: not one of {', '.join(sorted(flavors()))}")
    if min(args.tokens, args.tp, args.iters, args.flush_mib) < 1:
        p.error("--tokens, --tp, --iters and --flush-mib must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    try:
        rows = bench(args.flavor, args.tokens, args.tp, getattr(torch, args.dtype), args.iters, args.device,
                     args.flush_mib)
    except UserError as e:
        print(f"bench_matmuls.py: error: {e}", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name() if rows and torch.cuda.is_available() and args.device != "cpu" else "CPU"
    print(f"{args.flavor}, {args.tokens} tokens, TP{args.tp}, {args.dtype}, {dev}, torch {torch.__version__}\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
