"""Probe (GPU): SiLU backward written in aten ops that Inductor lowers with eager's bits, and the
speed of a lone cast (bf16 <-> fp32) compiled by Inductor against eager's copy kernel."""
import torch
import torch._inductor.config as ic

aten = torch.ops.aten
dev = "cuda"
f32 = torch.float32
allx = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(dev)
allx = allx[torch.isfinite(allx)]
g = torch.Generator(device=dev).manual_seed(0)
dys = (torch.randn(64, device=dev, generator=g) * torch.logspace(-6, 2, 64, device=dev)).to(torch.bfloat16)
X, DY = allx.repeat(64), dys.repeat_interleave(allx.numel())
CFG = {"emulate_precision_casts": True, "eager_numerics.disable_ftz": True, "eager_numerics.division_rounding": True}


def diff(a, b):
    v = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return int(((a.view(v) != b.view(v)) & ~(a.isnan() & b.isnan())).sum())


def recip_reciprocal(d):
    return aten.reciprocal.default(d)


def recip_full_like(d):
    return aten.div.Tensor(aten.full_like.default(d, 1.0), d)


def recip_scalar_tensor(d):
    return aten.div.Tensor(aten.scalar_tensor.default(1.0, dtype=f32, device=d.device), d)


def make(recip, fma):
    def bwd(dy, x):
        xf, dyf = aten._to_copy.default(x, dtype=f32), aten._to_copy.default(dy, dtype=f32)
        s = recip(aten.add.Tensor(aten.exp.default(aten.neg.default(xf)), 1))
        one_minus = aten.rsub.Scalar(s, 1)
        if fma == "addcmul":
            t = aten.addcmul.default(aten.full_like.default(xf, 1.0), xf, one_minus)
        else:
            t = aten.add.Tensor(aten.mul.Tensor(xf, one_minus), 1)
        return aten._to_copy.default(aten.mul.Tensor(aten.mul.Tensor(dyf, s), t), dtype=x.dtype)
    return bwd


with torch.no_grad():
    for dt in (torch.bfloat16, f32):
        x, dy = (X, DY) if dt == torch.bfloat16 else (torch.randn(1 << 22, device=dev, generator=g) * 8,
                                                     torch.randn(1 << 22, device=dev, generator=g))
        ref = aten.silu_backward.default(dy, x)
        for recip in (recip_reciprocal, recip_full_like, recip_scalar_tensor):
            for fma in ("addcmul", "mul_add"):
                torch._dynamo.reset()
                try:
                    with ic.patch(CFG):
                        out = torch.compile(make(recip, fma), fullgraph=True, dynamic=False)(dy, x)
                    print(f"bwd {dt} {recip.__name__:22s} {fma:8s}: mismatches {diff(out, ref)} of {ref.numel()}")
                except Exception as e:  # noqa: BLE001
                    print(f"bwd {dt} {recip.__name__} {fma}: FAILED {type(e).__name__}: {str(e)[:200]}")


def bench(fn, *args, iters=50):
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn(*args)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


print("| shape | direction | eager ms | Inductor ms | eager GB/s | Inductor GB/s |")
print("|---|---|---:|---:|---:|---:|")
for shape in ((128256, 2048), (8192, 2048), (2048, 8192), (2048, 2048), (512, 2048), (2048,), (8192, 32, 64)):
    for src, dst in ((torch.bfloat16, f32), (f32, torch.bfloat16)):
        x = torch.randn(shape, device=dev).to(src)
        torch._dynamo.reset()
        with ic.patch(CFG):
            comp = torch.compile(lambda t: aten._to_copy.default(t, dtype=dst), fullgraph=True, dynamic=False)
            comp(x)
        eager_ms = bench(lambda t: aten._to_copy.default(t, dtype=dst), x)
        ind_ms = bench(comp, x)
        nbytes = x.numel() * (x.element_size() + torch.empty((), dtype=dst).element_size())
        print(f"| {tuple(shape)} | {src} -> {dst} | {eager_ms:.4f} | {ind_ms:.4f} | {nbytes / eager_ms / 1e6:.0f} | "
              f"{nbytes / ind_ms / 1e6:.0f} |")
