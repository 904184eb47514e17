"""annotate_exact_pointwise: which ops join, and fused regions that keep eager's bits in bf16."""

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graph_trainer import MODULE_FQN_KEY, PHASE_KEY
from graph_trainer.compiler.node_meta import tag_for_inductor
from graph_trainer.compiler.passes.annotate_exact_pointwise import annotate_exact_pointwise_pass
from graph_trainer.compiler.pipeline import run_pipeline
from graph_trainer.compiler.registry import PassContext, resolve
from graph_trainer.config import Compile

from .conftest import (aten, assert_bitwise, assert_close, by_region, call, call_targets, fake_prop, fx_graph,
                       inductor_tag, module, stats, tagged_nodes)

OLD_CPU = pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                             reason="torch < 2.13's C++ backend drops emulate_precision_casts' rounding")
F32 = torch.float32
SHAPES = ((1024, 1024, torch.bfloat16), (8, 8, torch.bfloat16), (1024, 1024, F32))
BLOCK = {PHASE_KEY: "forward", MODULE_FQN_KEY: "block"}  # each node's custom meta


def _graph():
    """bf16 exact pointwise chain (tagged) beside a SiLU, an alpha add, a div and an inexact product (not)."""
    g, (a, b, c) = fx_graph("a", "b", "c")
    op = functools.partial(call, g, custom=BLOCK)
    s = op(aten.add.Tensor, op(aten.mul.Tensor, a, b), c)  # an FMA candidate in bf16
    f = op(aten._to_copy.default, s, dtype=torch.float32)
    f = op(aten.add.Tensor, op(aten.mul.Tensor, f, 0.1234567), f)  # and in fp32
    o = op(aten.sub.Tensor, op(aten._to_copy.default, f, dtype=torch.bfloat16), a)
    out = op(aten.mul.Tensor, o, o)
    half = op(aten.mul.Tensor, out, 0.5)
    other = op(aten.div.Tensor, op(aten.add.Tensor, op(aten.silu.default, out), c, alpha=2), b)
    return module(g, half, f, other, op(aten.mul.Tensor, out, 0.1234567))


def test_only_exact_ops_join():
    fake_prop(gm := _graph(), [torch.empty(8, 8, dtype=torch.bfloat16)] * 3)
    annotate_exact_pointwise_pass(gm)
    names = [n.target._opname for n in tagged_nodes(gm)]
    assert names == ["mul", "add", "_to_copy", "mul", "add", "_to_copy", "sub", "mul", "mul"]
    assert len(by_region(gm)) == 1
    assert all(inductor_tag(n)["inductor_configs"]["emulate_precision_casts"] for n in tagged_nodes(gm))
    # one kernel per op, in 8x8 bf16 tensors of 128 B (fp32: 2): mul 2+1, add 2+1, to fp32 1+2, mul
    # 2+2, add 4+2, to bf16 2+1, sub 2+1, o * o 1+1, * 0.5 1+1; fused: a, b, c in, out, half, f out
    assert (stats(gm)["nodes"], stats(gm)["eager_bytes"], stats(gm)["fused_bytes"]) == (
        9, 128 * (3 + 3 + 3 + 4 + 6 + 3 + 3 + 2 + 2), 128 * (3 + 2 + 2))
    with pytest.raises(ValueError, match="min_ops"):
        annotate_exact_pointwise_pass(_graph(), None, min_ops=0)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=OLD_CPU), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_region_is_bitwise_eager_in_bf16_and_plain_inductor_is_not(device):
    torch.manual_seed(0)
    xs = [torch.randn(256, 256, device=device).to(torch.bfloat16) for _ in range(3)]
    ref = _graph()(*xs)

    def compiled(tag):
        fakes = fake_prop(gm := _graph(), xs)
        tag(gm)
        return run_pipeline(gm, fakes, ["regional_inductor"])(*xs)

    assert_bitwise(compiled(annotate_exact_pointwise_pass), ref)

    def plain(gm):  # the same nodes, Inductor's default numerics: the test can tell them apart
        annotate_exact_pointwise_pass(gm)
        for n in tagged_nodes(gm):
            tag_for_inductor(n, {}, "plain")
            n.meta.pop("low_precision_pointwise_barrier")

    assert not all(torch.equal(x, y) for x, y in zip(compiled(plain), ref))


@OLD_CPU
def test_mixed_precision_fsdp_step_is_bitwise_with_the_regions(fsdp_trace):
    """A traced FSDP step gathering bf16 parameters: the exact regions give the uncompiled step's bits."""
    traced, inputs, _ = fsdp_trace(param_dtype=torch.bfloat16)
    ref = traced.gm(*inputs)
    gm = annotate_exact_pointwise_pass(traced.gm, traced.example_inputs)
    assert stats(gm)["forward_regions"] > 0 and stats(gm)["backward_regions"] > 0
    assert_bitwise(run_pipeline(gm, traced.example_inputs, ["regional_inductor"])(*inputs), ref)


def test_default_on_cuda_under_regional_inductor_only():
    name = "annotate_exact_pointwise_for_regional_inductor"
    on = {(dev, mode): name in resolve(PassContext(Compile(inductor_compilation=mode), device_type=dev))
          for dev in ("cuda", "cpu", None) for mode in ("regional", "full")}
    assert on == {key: key == ("cuda", "regional") for key in on} and len(on) == 6
    assert name not in resolve(PassContext(Compile(disable_passes="exact_pointwise"), device_type="cuda"))
    assert name in resolve(PassContext(Compile(passes="exact_pointwise"), device_type="cpu"))


def _silu(device):
    """``silu(x) * x``, ``silu_backward(x * x, x)`` and lone casts of bf16 x, y and fp32 z: ``(gm, inputs)``."""
    g, (x, y, z) = fx_graph("x", "y", "z")
    op = functools.partial(call, g, custom=BLOCK)
    gm = module(g, op(aten.mul.Tensor, op(aten.silu.default, x), x),
                op(aten.silu_backward.default, op(aten.mul.Tensor, x, x), x),
                op(aten._to_copy.default, x, dtype=F32, layout=torch.strided, device=device),
                *(op(aten._to_copy.default, t, dtype=d) for t, d in ((y, F32), (z, torch.bfloat16))))
    return gm, [(torch.randn(a, b, device=device) * 4).to(d) for a, b, d in SHAPES]


def _bucket(device):
    """FSDP's bucketed reduce-scatter input (a cat of casts and views) and an all-gather input cat: ``(gm, inputs)``."""
    g, (a, b, c) = fx_graph("a", "b", "c")
    op = functools.partial(call, g, custom=BLOCK)
    fa, fb = (op(aten._to_copy.default, t, dtype=F32, layout=torch.strided, device=device) for t in (a, b))
    bucket = op(aten.cat.default, [op(aten.view.default, t, [4, -1]) for t in (fa, fb, c)], 1)
    gathered = op(aten.cat.default, [op(aten._to_copy.default, op(aten._to_copy.default, a, dtype=F32),
                                        dtype=torch.bfloat16), op(aten._to_copy.default, c, dtype=torch.bfloat16)])
    xa, xb, xc = (torch.randn(n, device=device) for n in (4096, 512, 64))  # bf16 a and b; c: fp32 that bf16 must round
    return module(g, bucket, op(aten.add.Tensor, fb, 1.0), gathered), [xa.bfloat16(), xb.bfloat16(), xc * 1e3]


def _rope(device):
    """RoPE's rotation as traced: bf16 ``x`` * complex ``f``, ``g`` * ``conj(f)``, through fp32: ``(gm, inputs)``."""
    b, s, h, d = 1, 64, 4, 32  # batch, sequence, heads, head dim
    g, (x, grad, f) = fx_graph("x", "g", "f")
    op = functools.partial(call, g, custom=BLOCK)

    def rotate(t, q):
        t = op(aten.view_as_complex.default, op(aten.view.default, op(aten._to_copy.default, t, dtype=F32),
                                                [b, s, h, d // 2, 2]))
        t = op(aten.view.default, op(aten.view_as_real.default, op(aten.mul.Tensor, t, q)), [b, s, h, d])
        return op(aten._to_copy.default, t, dtype=torch.bfloat16)

    gm = module(g, rotate(x, f), rotate(grad, op(aten.clone.default, op(aten._conj.default, f))))
    xs = [torch.randn(b, s, h, d, device=device).to(torch.bfloat16) for _ in range(2)]
    angles = torch.randn(b, s, 1, d // 2, device=device) * 3
    return gm, [*xs, torch.polar(torch.ones_like(angles), angles)]


GRAPHS = {"silu": _silu, "bucket": _bucket, "rope": _rope}
SILU = [["_to_copy"], ["mul", "_to_copy", "_to_copy", "neg", "exp", "add", "full_like", "div", "full_like", "rsub",
                       "addcmul", "mul", "mul", "_to_copy"], ["silu", "mul"]]  # silu_backward: eager's formula, in fp32
CHAINS = [["_to_copy", "_to_copy"], ["_to_copy", "view", "add"]]  # the bucket graph's casts with other readers
ROTATION = ["_to_copy", "view", "select", "select", "select", "select", "mul", "neg", "addcmul", "mul", "addcmul",
            "stack", "view", "_to_copy"]  # real arithmetic with eager's FMAs, between the casts


@pytest.mark.parametrize("graph, device, options, regions", [
    ("silu", "cuda", {}, SILU), ("silu", "meta", {}, SILU),  # meta: the dry run's GPU
    ("silu", "cpu", {}, []),  # eager CPU's SiLU is another approximation; CPU casts stay eager
    ("silu", "cuda", {"activations": False, "lone_casts": False}, []),
    ("bucket", "cuda", {}, sorted(CHAINS + [["_to_copy", "cat"], ["_to_copy", "view", "cat"]])),
    ("bucket", "cuda", {"cast_cats": False}, CHAINS), ("bucket", "cpu", {}, CHAINS),  # CPU casts and cats stay eager
    ("rope", "cuda", {}, [ROTATION, ROTATION]), ("rope", "cpu", {}, []), ("rope", "meta", {}, [ROTATION, ROTATION]),
    ("rope", "cuda", {"complex_mul": False}, []),
])
def test_regions_join_on_cuda_only(graph, device, options, regions):
    """SiLU, a large widening cast alone; a cast feeding only a cat joins it (others stay in a chain); RoPE's mul."""
    with FakeTensorMode():  # no GPU needed
        gm, fakes = GRAPHS[graph](torch.device(device))
    FakeTensorProp(gm).propagate(*fakes)
    annotate_exact_pointwise_pass(gm, **options)
    FakeTensorProp(gm).propagate(*fakes)  # the rewritten graph runs too
    assert sorted([n.target._opname for n in nodes] for nodes in by_region(gm).values()) == regions
    assert (stats(gm)["cast_cats"], stats(gm)["complex_muls"]) == (sum("cat" in r for r in regions),
                                                                   regions.count(ROTATION))
    if graph == "rope" and regions:  # complex values left: f, and conj(f) materialized (through view_as_real)
        left = [n.op if n.op == "placeholder" else n.target._opname for n in gm.graph.nodes
                if isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_complex()]
        assert left == ["placeholder", "_conj", "clone"] and call_targets(gm).count(aten.view_as_real.default) == 2
        ref, xs = _rope(torch.device("cpu"))  # the rewritten graph computes the same rotation (CPU: not bitwise)
        assert_close(gm(*xs), ref(*xs), rtol=0, atol=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", GRAPHS)
def test_cuda_regions_are_bitwise_eager(graph):
    """The SiLU regions and lone casts, a cat of casts (of fp32 values that bf16 must round) and RoPE's rotation."""
    torch.manual_seed(0)
    gm, xs = GRAPHS[graph](torch.device("cuda:0"))
    ref = gm(*xs)
    fakes = fake_prop(gm, xs)
    st = stats(annotate_exact_pointwise_pass(gm))
    assert (st["cast_cats"], st["complex_muls"]) == (2 * (graph == "bucket"), 2 * (graph == "rope"))
    assert_bitwise(run_pipeline(gm, fakes, ["regional_inductor"])(*xs), ref)
