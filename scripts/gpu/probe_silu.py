"""Probe (GPU): which Inductor formulations of SiLU forward / backward give eager CUDA's bits.

Every bf16 value of x (exhaustive) for the forward; every bf16 x against 64 dy values for the
backward. Prints one line per candidate: mismatching elements, and the torch features used.
"""
import inspect
import sys

import torch
import torch._inductor.config as ic
import torch.nn.functional as F

print("torch", torch.__version__, "device", torch.cuda.get_device_name())
en = getattr(ic, "eager_numerics", None)
print("eager_numerics:", {k: getattr(en, k) for k in dir(en) if not k.startswith("_")} if en else None,
      "use_fast_math", getattr(ic, "use_fast_math", None))
from torch._inductor.codegen.triton import TritonOverrides as T  # noqa: E402

print("exp:", inspect.getsource(T.exp).strip().splitlines()[-3:])
print("T.fma", hasattr(T, "fma"), "T.div_rn", hasattr(T, "div_rn"), "T.mul_rn", hasattr(T, "mul_rn"))
import torch._inductor.lowering as L  # noqa: E402

src = inspect.getsource(L)
print("lowering uses ops.fma:", "ops.fma" in src, " addcmul lowering:", "def addcmul" in src)

dev = "cuda"
allx = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(dev)
allx = allx[torch.isfinite(allx)]
g = torch.Generator(device=dev).manual_seed(0)
dys = (torch.randn(64, device=dev, generator=g) * torch.logspace(-6, 2, 64, device=dev)).to(torch.bfloat16)
X = allx.repeat(64)
DY = dys.repeat_interleave(allx.numel())
x1 = allx[torch.randperm(allx.numel(), device=dev, generator=g)]
x3 = (torch.randn(allx.numel(), device=dev, generator=g) * 4).to(torch.bfloat16)


def diff(a, b):
    ai, bi = a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32), b.view(
        torch.int16 if b.dtype == torch.bfloat16 else torch.int32)
    both_nan = a.isnan() & b.isnan()
    return int(((ai != bi) & ~both_nan).sum())


BASE = {"emulate_precision_casts": True, "eager_numerics.disable_ftz": True}
DIV = {"eager_numerics.division_rounding": True} if en is not None and hasattr(en, "division_rounding") else {}


def fwd_aten(x):
    return torch.ops.aten.silu.default(x)


def fwd_formula(x):
    xf = x.float()
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


def fwd_formula_mul(x, y):
    xf = x.float()
    return (xf / (1 + torch.exp(-xf))).to(x.dtype) * y


def bwd_aten(dy, x):
    return torch.ops.aten.silu_backward.default(dy, x)


def bwd_formula(dy, x):
    xf, dyf = x.float(), dy.float()
    s = 1 / (1 + torch.exp(-xf))
    return (dyf * s * (1 + xf * (1 - s))).to(x.dtype)


def bwd_addcmul(dy, x):
    xf, dyf = x.float(), dy.float()
    s = 1 / (1 + torch.exp(-xf))
    return (dyf * s * torch.addcmul(torch.ones_like(xf), xf, 1 - s)).to(x.dtype)


def bwd_addcmul2(dy, x):
    xf, dyf = x.float(), dy.float()
    s = 1 / (1 + torch.exp(-xf))
    return (dyf * s * torch.addcmul(torch.ones((), device=x.device), xf, 1 - s)).to(x.dtype)


def run(name, fn, ref, args, cfg, show_code=False):
    torch._dynamo.reset()
    try:
        with ic.patch(cfg):
            c = torch.compile(fn, fullgraph=True, dynamic=False)
            if show_code:
                from torch._inductor.utils import run_and_get_code
                out, code = run_and_get_code(c, *args)
                body = [ln for ln in code[0].splitlines() if "tmp" in ln and "=" in ln]
                print("   code:", *body[:30], sep="\n      ")
            else:
                out = c(*args)
        torch.cuda.synchronize()
        print(f"{name:55s} cfg={sorted(cfg)}: mismatches {diff(out, ref)} of {ref.numel()}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:55s} FAILED {type(e).__name__}: {str(e)[:200]}")


with torch.no_grad():
    for dt in (torch.bfloat16, torch.float32):
        x = allx.to(dt) if dt == torch.bfloat16 else torch.randn(1 << 22, device=dev, generator=g) * 8
        ref = F.silu(x)
        print(f"-- forward {dt}: eager formula in torch ops (uncompiled) mismatches {diff(fwd_formula(x), ref)}")
        run(f"fwd aten.silu {dt}", fwd_aten, ref, (x,), BASE)
        run(f"fwd aten.silu {dt} +div", fwd_aten, ref, (x,), {**BASE, **DIV})
        run(f"fwd formula {dt} +div", fwd_formula, ref, (x,), {**BASE, **DIV}, show_code=dt == torch.bfloat16)
        run(f"fwd formula {dt} no-div", fwd_formula, ref, (x,), BASE)
        run(f"fwd formula {dt} +div no-emulate", fwd_formula, ref, (x,), {"eager_numerics.disable_ftz": True, **DIV})
    ref = F.silu(x1) * x3
    run("fwd formula * y bf16 +div", fwd_formula_mul, ref, (x1, x3), {**BASE, **DIV})
    run("fwd aten.silu * y bf16 +div", lambda a, b: torch.ops.aten.silu.default(a) * b, ref, (x1, x3), {**BASE, **DIV})
    for dt in (torch.bfloat16, torch.float32):
        x, dy = (X, DY) if dt == torch.bfloat16 else (torch.randn(1 << 22, device=dev, generator=g) * 8,
                                                     torch.randn(1 << 22, device=dev, generator=g))
        ref = bwd_aten(dy, x)
        print(f"-- backward {dt}: uncompiled formula mismatches {diff(bwd_formula(dy, x), ref)}")
        run(f"bwd aten.silu_backward {dt} +div", bwd_aten, ref, (dy, x), {**BASE, **DIV})
        run(f"bwd formula {dt} +div emulate", bwd_formula, ref, (dy, x), {**BASE, **DIV})
        run(f"bwd formula {dt} +div no-emulate (fp fusion)", bwd_formula, ref, (dy, x),
            {"eager_numerics.disable_ftz": True, **DIV})
        run(f"bwd addcmul {dt} +div emulate", bwd_addcmul, ref, (dy, x), {**BASE, **DIV},
            show_code=dt == torch.bfloat16)
        run(f"bwd addcmul(scalar 1) {dt} +div emulate", bwd_addcmul2, ref, (dy, x), {**BASE, **DIV})
sys.exit(0)
