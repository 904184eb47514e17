#!/usr/bin/env python3
"""Measure the constants of the scale projection's cost model on this GPU kind (graph_trainer.projection.cost_model).

Measures, in bf16 on CUDA, and writes one JSON file (``--out``) that
``graph_trainer.projection.devices.device_constants`` reads (``--projection.cost_constants FILE`` or the file at
``graph_trainer/projection/cost_constants/<h100|h200>.json``):

* matmul TFLOP/s of the Llama3 projection shapes (1B, 8B, 70B; ``--tp`` degrees): for each
  linear layer ``x[M, in] @ W[out, in]^T`` with M = 8192 tokens (seq 8192 x batch 1; the 1B
  config's 4096 x 2) and ``out`` (or ``in`` for ``wo`` / ``w2``) divided by the TP degree, the
  forward ``x @ W^T``, the input gradient ``dy @ W`` and the weight gradient ``dy^T @ x``
  (one sorted ``(M, N, K)`` key, as the projection looks shapes up; FLOPs ``2·M·N·K`` each);
  ``matmul_tflops`` is all of them together (total FLOPs / total time);
* causal SDPA forward + backward TFLOP/s with GQA (``enable_gqa=True``), cuDNN attention
  first as torchtitan does (``sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, MATH],
  set_priority=True)``), flash if cuDNN refuses the shape; FLOPs ``3.5 · 4·B·H·S²·D · ½``
  (FlashAttention-2, arXiv:2307.08691 §4.1: causal halves, the backward is 2.5x the forward);
* HBM bandwidth: a 4 GiB ``copy_``, bytes read + written per second;
* with 2 or more ranks (``torchrun --nproc_per_node N scripts/cost_constants.py``):
  NCCL ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_reduce`` time against size
  S (gathered output, scattered input, reduced buffer; bf16), the bus bandwidth of each point
  (nccl-tests doc/PERFORMANCE.md: ``busbw = S·f / t``, ``f = (n−1)/n``, ``2(n−1)/n`` for
  all_reduce) and a fit ``t = α + S·f / β`` (least squares on relative error). On one host it
  is written as the NVLink constants (``nccl``); across hosts (``torchrun --nnodes M ...``)
  as the network's (``nccl_network``, with the GPUs per host).

Prints a table per part; rank 0 writes the JSON. Needs only torch (2.11 or later) and a GPU;
about a minute per GPU kind. Run::

    python3 scripts/cost_constants.py --out graph_trainer/projection/cost_constants/h100.json
    torchrun --nproc_per_node 2 scripts/cost_constants.py --out graph_trainer/projection/cost_constants/h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

#: Llama3 shapes: dim, query heads, KV heads, FFN hidden, vocabulary, (batch, seq) of the config.
MODELS = {
    "1B": dict(dim=2048, heads=32, kv=8, ffn=8192, vocab=128256, batch=2, seq=4096),
    "8B": dict(dim=4096, heads=32, kv=8, ffn=14336, vocab=128256, batch=1, seq=8192),
    "70B": dict(dim=8192, heads=64, kv=8, ffn=28672, vocab=128256, batch=1, seq=8192),
}
KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def cuda_ms(fn, iters: int, warmup: int = 3) -> float:
    """Mean milliseconds of ``fn()`` over ``iters`` back-to-back calls (CUDA events), after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def linear_shapes(models: list[str], tps: list[int]) -> list[tuple[str, int, int, int]]:
    """``(name, M, in, out)`` of every distinct linear layer shape, TP-split as torchtitan's plan
    splits it (column-wise: wq, wk, wv, w1, w3, output; row-wise: wo, w2)."""
    out, seen = [], set()
    for m in models:
        c = MODELS[m]
        hd = c["dim"] // c["heads"]
        tokens = c["batch"] * c["seq"]
        for tp in tps:
            if c["kv"] % tp:
                continue
            for layer, i, o in (("wq", c["dim"], c["heads"] * hd // tp), ("wkv", c["dim"], c["kv"] * hd // tp),
                                ("wo", c["heads"] * hd // tp, c["dim"]), ("w1/w3", c["dim"], c["ffn"] // tp),
                                ("w2", c["ffn"] // tp, c["dim"]), ("output", c["dim"], c["vocab"] // tp)):
                key = tuple(sorted((tokens, i, o)))
                if key not in seen:
                    seen.add(key)
                    out.append((f"{m} tp{tp} {layer}", tokens, i, o))
    return out


def bench_matmuls(shapes, iters: int) -> list[dict]:
    """Forward, input-gradient and weight-gradient matmul of each shape; one row per shape."""
    rows = []
    for name, m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ms = [cuda_ms(lambda: x @ w.t(), iters), cuda_ms(lambda: dy @ w, iters), cuda_ms(lambda: dy.t() @ x, iters)]
        flops = 3 * 2 * m * n * k
        rows.append(dict(name=name, m=m, n=n, k=k, ms=sum(ms), tflops=flops / (sum(ms) * 1e-3) / 1e12,
                         tflops_fwd_dx_dw=[round(2 * m * n * k / (t * 1e-3) / 1e12, 1) for t in ms]))
        del x, w, dy
    return rows


def attention_shapes(models: list[str], tps: list[int]) -> list[tuple[str, int, int, int, int, int]]:
    """``(name, B, H, H_kv, S, D)``: each model's config shape (and the 1B at seq 8192 x 1), TP-split."""
    out = []
    for m in models:
        c = MODELS[m]
        hd = c["dim"] // c["heads"]
        seqs = [(c["batch"], c["seq"])] + ([(1, 8192)] if c["seq"] != 8192 else [])
        for tp in tps:
            if c["kv"] % tp:
                continue
            for b, s in seqs:
                out.append((f"{m} tp{tp} b{b} s{s}", b, c["heads"] // tp, c["kv"] // tp, s, hd))
    return out


def bench_attention(shapes, iters: int) -> list[dict]:
    """Causal SDPA forward + backward of each shape, cuDNN first (torchtitan's order), else flash."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for name, b, h, hkv, s, d in shapes:
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h)
            out.backward(g)

        row = dict(name=name, b=b, h=h, h_kv=hkv, s=s, d=d)
        for backend, label in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
            try:
                with sdpa_kernel([backend]):
                    ms = cuda_ms(step, iters)
            except RuntimeError as e:  # the backend refuses this shape / GQA
                row[f"{label}_error"] = str(e).splitlines()[0][:120]
                continue
            flops = 3.5 * 4 * b * h * s * s * d * 0.5
            row.update(backend=label, ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
            break
        rows.append(row)
        del q, k, v, g
    return rows


def bench_hbm(iters: int, gib: float = 4.0) -> float:
    """Device-to-device ``copy_`` of ``gib`` GiB: GB/s counting bytes read and written."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    b = torch.empty_like(a)
    ms = cuda_ms(lambda: b.copy_(a), iters)
    return 2 * a.numel() * 2 / (ms * 1e-3) / 1e9


def ring_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw factor: ``2(n−1)/n`` for all_reduce, ``(n−1)/n`` for the others."""
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Fit ``t = α + w/β`` to ``(w bytes on the wire, t seconds)`` minimizing the relative error
    ``Σ ((α + w/β − t) / t)²``; returns ``(α seconds, β bytes/s)``."""
    # weighted least squares with weights 1/t²: normal equations of [1, w] -> t
    s0 = s1 = s2 = sy = swy = 0.0
    for w, t in points:
        q = 1.0 / (t * t)
        s0, s1, s2, sy, swy = s0 + q, s1 + q * w, s2 + q * w * w, sy + q * t, swy + q * w * t
    det = s0 * s2 - s1 * s1
    alpha = (sy * s2 - s1 * swy) / det
    slope = (s0 * swy - s1 * sy) / det
    return max(alpha, 0.0), 1.0 / slope


def bench_nccl(iters: int, max_mib: int) -> dict:
    """Each collective of :data:`KINDS` over the world at sizes 64 KiB .. ``max_mib`` MiB (bf16)."""
    world, out = dist.get_world_size(), {}
    sizes = [2**p for p in range(16, 31) if 2**p <= max_mib * 2**20]
    for kind in KINDS:
        pts = []
        for size in sizes:
            n = size // 2 // world * world  # bf16 elements of S, a multiple of the world
            big = torch.ones(n, device="cuda", dtype=torch.bfloat16)
            small = torch.ones(n // world, device="cuda", dtype=torch.bfloat16)
            fn = {"all_gather_into_tensor": lambda: dist.all_gather_into_tensor(big, small),
                  "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(small, big),
                  "all_reduce": lambda: dist.all_reduce(big)}[kind]
            t = cuda_ms(fn, iters) * 1e-3
            pts.append((2 * n, t))
            del big, small
        wire = [(s * ring_factor(kind, world), t) for s, t in pts]
        alpha, beta = fit_alpha_beta(wire)
        out[kind] = dict(world=world, alpha_us=alpha * 1e6, busbw_gbps=beta / 1e9,
                         points=[dict(bytes=s, us=round(t * 1e6, 2), busbw_gbps=round(w / t / 1e9, 2))
                                 for (s, t), (w, _) in zip(pts, wire)])
    return out


def table(rows: list[dict], cols: list[str]) -> str:
    """A markdown table of ``rows`` with ``cols``."""
    def fmt(v):
        return f"{v:,.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    p.add_argument("--models", default="1B,8B,70B", help="comma list of " + ", ".join(MODELS))
    p.add_argument("--tp", default="1,2,8", help="TP degrees whose split shapes are measured")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--nccl-max-mib", type=int, default=1024, help="largest collective size S, MiB")
    a = p.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not torch.cuda.is_available():
        print(f"error: {'--models ' + ','.join(bad) + ' unknown' if bad else 'no CUDA device'}", file=sys.stderr)
        return 2
    tps = [int(t) for t in a.tp.split(",")]

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank() if ranks > 1 else 0
    say = print if rank == 0 else (lambda *_, **__: None)
    say(f"{torch.cuda.get_device_name()} x {ranks}, torch {torch.__version__}")

    cuda_ms(lambda: torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) @ torch.randn(
        8192, 8192, device="cuda", dtype=torch.bfloat16), 50)  # clocks up
    mm = bench_matmuls(linear_shapes(models, tps), a.iters)
    say("\nbf16 matmuls (fwd + dX + dW):\n" + table(mm, ["name", "m", "n", "k", "ms", "tflops", "tflops_fwd_dx_dw"]))
    attn = bench_attention(attention_shapes(models, tps), a.iters)
    say("\ncausal SDPA fwd + bwd:\n" + table(attn, ["name", "b", "h", "h_kv", "s", "d", "backend", "ms", "tflops"]))
    hbm = bench_hbm(a.iters * 2)
    say(f"\nHBM copy: {hbm:,.0f} GB/s (read + write)")
    ok = [r for r in attn if "tflops" in r]
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": ranks, "measured_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "matmul": mm,
        "matmul_tflops": sum(6 * r["m"] * r["n"] * r["k"] for r in mm) / sum(r["ms"] * 1e-3 for r in mm) / 1e12,
        "attention": attn,
        "attention_tflops": (sum(r["tflops"] * r["ms"] for r in ok) / sum(r["ms"] for r in ok)) if ok else None,
        "hbm_gbps": hbm,
    }
    if ranks > 1:
        nccl = bench_nccl(a.iters, a.nccl_max_mib)
        for kind, r in nccl.items():
            say(f"\n{kind} over {ranks} ranks: alpha {r['alpha_us']:.1f} us, busbw {r['busbw_gbps']:.1f} GB/s (fit)\n"
                + table(r["points"], ["bytes", "us", "busbw_gbps"]))
        # one host: the NVLink constants; several (torchrun --nnodes): the network's, with the
        # GPUs per host, whose NICs the ring uses together
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(ranks)))
        result["nccl" if local == ranks else "nccl_network"] = {
            k: {"alpha_us": v["alpha_us"], "busbw_gbps": v["busbw_gbps"], "world": v["world"],
                "gpus_per_node": local, "points": v["points"]} for k, v in nccl.items()}
    say(f"\nmatmul {result['matmul_tflops']:.0f} TFLOP/s, attention "
        f"{result['attention_tflops'] or float('nan'):.0f} TFLOP/s, HBM {hbm:,.0f} GB/s (aggregates)")
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.out}")
    if ranks > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
