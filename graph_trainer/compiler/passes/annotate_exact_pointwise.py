"""Tag chains of exactly rounded pointwise ops as Inductor regions that keep eager's bits.

Eager runs ``mul``, ``add``, casts and the like one kernel each, each one correctly rounded operation. A fused kernel
gives the same bits if it also rounds after every op and contracts no ``a * b + c`` into an FMA: Inductor does both
under :data:`EAGER_NUMERICS`, so these regions need no ``--compile.numerics_changing_optim``. On CUDA SiLU and its
backward join too (:func:`exact_silu_backward`), and each complex64 multiply (RoPE's) becomes real arithmetic with
eager's FMAs, one region with the casts around it (:func:`exact_complex_mul`). Other transcendental ops, division
and reductions are left out.

Matches: :func:`~graph_trainer.compiler.matching.find_pointwise_regions`'s chains of at least ``min_ops``
:func:`is_exact` ops; on CUDA also each :func:`exact_complex_mul`, :func:`cast_cat_region` and :func:`is_lone_cast`.

Changes: ``compile_with_inductor = {"inductor_configs": EAGER_NUMERICS, "inductor_region":
"exact_pointwise_<phase>_<i>"}`` and ``meta["low_precision_pointwise_barrier"] = True`` (Inductor rounds after the
op, as eager does) on the chosen nodes; each tagged ``silu_backward`` becomes the ops of eager's formula. On by
default on CUDA under regional Inductor, elsewhere with ``--compile.passes exact_pointwise``."""

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch

from graph_trainer.compiler.graph_values import fused_bytes, positions, tensor_val, val_bytes
from graph_trainer.compiler.matching import find_pointwise_regions, tag_regions
from graph_trainer.compiler.node_meta import BARRIER_KEY, is_tagged_for_inductor, set_pass_summary
from graph_trainer.compiler.ops import RESHAPE_OPS, aten, packet_name
from graph_trainer.compiler.registry import GraphPass

#: aten op packets computed as one correctly rounded operation per element (or exactly).
EXACT_OPS = frozenset({"add", "sub", "mul", "neg", "abs", "_to_copy", "clone", "copy", "where",
                       "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge"})
#: aten op packets that fused Triton code computes with eager CUDA's bits under :data:`EAGER_NUMERICS`.
EXACT_CUDA_ACTIVATIONS = frozenset({"silu", "silu_backward"})
#: Inductor configs of the regions: round after every op, no FMA contraction, no flushing of denormals, IEEE division.
EAGER_NUMERICS = {"emulate_precision_casts": True, "eager_numerics.disable_ftz": True,
                  "eager_numerics.division_rounding": True}
#: Smallest output of a lone cast that gets a region of its own (a compile per shape).
LONE_CAST_BYTES = 1 << 20
_LOW = (torch.bfloat16, torch.float16)


def _on_gpu(val: Any) -> bool:
    """A tensor on CUDA or on meta (the dry run's stand-in for the GPU it projects onto)."""
    return isinstance(val, torch.Tensor) and val.device.type in ("cuda", "meta")


def is_exact(node: torch.fx.Node, activations: bool = False) -> bool:
    """Whether ``node`` is an op of :data:`EXACT_OPS` (with ``activations``, also one of
    :data:`EXACT_CUDA_ACTIVATIONS` on a CUDA tensor) that fused code computes with eager's bits. Excluded: ``add`` /
    ``sub`` with ``alpha`` other than 1, and a Python number beside a bf16 / fp16 tensor that dtype does not hold."""
    name = packet_name(node)
    if activations and name in EXACT_CUDA_ACTIVATIONS:
        return _on_gpu(node.meta.get("val"))
    if name not in EXACT_OPS or (name in ("add", "sub") and node.kwargs.get("alpha", 1) != 1):
        return False
    low = [v.dtype for u in node.all_input_nodes if (v := tensor_val(u)) is not None and v.dtype in _LOW]
    numbers = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return not any(torch.tensor(x, dtype=d).item() != x for x in numbers for d in low)


def region_traffic(region: list[torch.fx.Node]) -> tuple[int, int]:
    """``(eager, fused)``: bytes the region's ops read and write run one kernel each (every exact op's inputs and
    output), and as one fused kernel (the inputs from outside once, the outputs used outside)."""
    eager = sum(val_bytes(u.meta.get("val")) for n in region if is_exact(n, activations=True)
                for u in (n, *n.all_input_nodes))
    return eager, fused_bytes(region)


def _plain_cast(node: torch.fx.Node) -> bool:
    """An untagged ``_to_copy`` of a CUDA tensor that changes only the dtype."""
    if packet_name(node) != "_to_copy" or not set(node.kwargs) <= {"dtype", "layout", "device"} \
            or is_tagged_for_inductor(node):
        return False
    src, out = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None, node.meta.get("val")
    return isinstance(src, torch.Tensor) and _on_gpu(out) and out.device == src.device and out.layout == torch.strided


def is_lone_cast(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a :func:`_plain_cast` from bf16 / fp16 to fp32 of at least :data:`LONE_CAST_BYTES`."""
    if not _plain_cast(node):
        return False
    src, out = node.args[0].meta["val"], node.meta["val"]
    return src.dtype in _LOW and out.dtype == torch.float32 and val_bytes(out) >= LONE_CAST_BYTES


def _reshapes_and_cast(n: torch.fx.Node, members: set[torch.fx.Node], upstream: bool) -> list[torch.fx.Node]:
    """Untagged reshapes from ``n`` (included) up its inputs, each read only by ``members`` and the walk's nodes, or
    (not ``upstream``) down from ``n`` (excluded), each the only reader of the one before; then a plain cast."""
    path: list[torch.fx.Node] = []
    while upstream or len(n.users) == 1:
        n = n if upstream else next(iter(n.users))
        if n.op != "call_function" or is_tagged_for_inductor(n) or upstream and not set(n.users) <= members | {*path}:
            break
        if n.target not in RESHAPE_OPS:
            return path + [n] * _plain_cast(n)
        path.append(n)
        n = n.args[0] if upstream else n
    return path


def cast_cat_region(cat: torch.fx.Node, taken: set[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """The nodes of ``cat``'s region, each cast before its views, ``cat`` last: ``cat`` (an untagged ``aten.cat`` on
    a CUDA device) and each of its inputs that is a cast (:func:`_plain_cast`, not in ``taken``) with the reshapes
    between, each used only on that path. None when no input is such a cast."""
    if (cat.op != "call_function" or cat.target is not aten.cat.default or is_tagged_for_inductor(cat)
            or cat in taken or not _on_gpu(cat.meta.get("val"))):
        return None
    region = []
    for piece in dict.fromkeys(p for p in cat.args[0] if isinstance(p, torch.fx.Node)):
        path = _reshapes_and_cast(piece, {cat}, upstream=True)
        if path and _plain_cast(path[-1]) and path[-1] not in taken:
            region += path[::-1]
    return region + [cat] if region else None


def _op_before(new: list[torch.fx.Node], node: torch.fx.Node, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    """A new ``target(*args, **kwargs)`` node before ``node``, appended to ``new``, with a copy of ``node``'s meta
    and its own fake ``val``."""
    with node.graph.inserting_before(node):
        n = node.graph.call_function(target, args, kwargs)
    n.meta.update({k: copy.deepcopy(v) for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
    vals, kwvals = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    n.meta["val"] = target(*vals, **kwvals)
    new.append(n)
    return n


def exact_complex_mul(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """For ``node`` = ``view_as_real(mul(p, q))`` of complex64 CUDA tensors (RoPE's rotation, forward and backward):
    replace it by the real ops of eager CUDA's kernel and return the region, else None (nothing changed). With
    ``(a, b)`` and ``(c, d)`` the real and imaginary parts of ``p`` and ``q`` (selects of ``r`` where the operand is
    ``view_as_complex(r)``, else of its ``view_as_real``), eager computes ``fma(a, c, -(b * d))`` and ``fma(a, d, b *
    c)`` (nvcc contracts ``a * c - b * d`` and ``a * d + b * c`` so; measured bitwise on an H200): each an ``addcmul``
    here (an FMA in Inductor on CUDA), stacked on a last dim of 2. The region: these ops with the reshapes and a plain
    cast on either side (:func:`_reshapes_and_cast`); an operand's ``view_as_real`` stays out (no complex codegen)."""
    mul = node.args[0] if node.target is aten.view_as_real.default else None
    if not (isinstance(mul, torch.fx.Node) and mul.target is aten.mul.Tensor and len(mul.users) == 1 and all(
            isinstance(p, torch.fx.Node) and _on_gpu(v := p.meta.get("val")) and v.dtype == torch.complex64
            and not v.is_conj() for p in mul.args[:2])):
        return None
    new: list[torch.fx.Node] = []
    op = functools.partial(_op_before, new, node)
    owned = {p: p.args[0] for p in mul.args[:2] if p.target is aten.view_as_complex.default and len(p.users) == 1}
    sources = [owned[p] if p in owned else op(aten.view_as_real.default, p) for p in mul.args[:2]]
    (a, b), (c, d) = [[op(aten.select.int, src, -1, i) for i in (0, 1)] for src in sources]
    re = op(aten.addcmul.default, op(aten.neg.default, op(aten.mul.Tensor, b, d)), a, c)
    node.replace_all_uses_with(op(aten.stack.default, [re, op(aten.addcmul.default, op(aten.mul.Tensor, b, c), a, d)],
                                  -1))
    for dead in (node, mul, *owned):
        dead.graph.erase_node(dead)
    ops = [n for n in new if n.target is not aten.view_as_real.default]  # in graph order, as inserted
    up = [m for r in owned.values() for m in reversed(_reshapes_and_cast(r, set(ops), upstream=True))]
    return up + ops + _reshapes_and_cast(new[-1], set(ops), upstream=False)


def exact_silu_backward(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Replace ``aten.silu_backward(dy, x)`` by the aten ops of eager CUDA's kernel: in fp32, ``s = 1.0 / (1 +
    exp(-x))`` (IEEE division), ``dy * s * fma(x, 1 - s, 1)`` (``addcmul``: nvcc contracts eager's ``1 + x * (1 -
    s)``), cast to the output dtype. Each new node copies ``node``'s meta with its own fake ``val``. Returns the new
    nodes; ``node`` is erased."""
    dy, x = node.args
    new: list[torch.fx.Node] = []
    op = functools.partial(_op_before, new, node)
    xf, dyf = op(aten._to_copy.default, x, dtype=torch.float32), op(aten._to_copy.default, dy, dtype=torch.float32)
    den = op(aten.add.Tensor, op(aten.exp.default, op(aten.neg.default, xf)), 1)
    s = op(aten.div.Tensor, op(aten.full_like.default, den, 1.0), den)
    t = op(aten.addcmul.default, op(aten.full_like.default, xf, 1.0), xf, op(aten.rsub.Scalar, s, 1))
    out = op(aten._to_copy.default, op(aten.mul.Tensor, op(aten.mul.Tensor, dyf, s), t), dtype=node.meta["val"].dtype)
    node.replace_all_uses_with(out)
    node.graph.erase_node(node)
    return new


def annotate_exact_pointwise_pass(gm: torch.fx.GraphModule, example_inputs: Any = None, min_ops: int = 2,
                                  activations: bool = True, lone_casts: bool = True, cast_cats: bool = True,
                                  complex_mul: bool = True) -> torch.fx.GraphModule:
    """With ``complex_mul`` rewrite each complex64 CUDA multiply as :func:`exact_complex_mul` does, one region each;
    then tag each chain of :func:`is_exact` ops (at least ``min_ops``; SiLU with ``activations``), with ``cast_cats``
    each :func:`cast_cat_region` outside them, and with ``lone_casts`` each :func:`is_lone_cast` outside all these, as
    one eager-numerics region; ``ValueError`` for ``min_ops < 1``. Stats: those of ``tag_regions`` (without the
    complex multiplies), ``complex_muls``, ``cast_cats`` and ``lone_casts`` (their regions), ``eager_bytes`` /
    ``fused_bytes`` (:func:`region_traffic` of the chains)."""
    if min_ops < 1:
        raise ValueError(f"min_ops must be >= 1, got {min_ops}")
    muls = [r for n in list(gm.graph.nodes) if (r := exact_complex_mul(n))] if complex_mul else []
    tag_regions(muls, EAGER_NUMERICS, "exact_complex_mul")
    chains = find_pointwise_regions(gm.graph, min_ops, accept=lambda n: is_exact(n, activations))
    taken = {n for region in chains for n in region}
    pos = positions(gm.graph)
    cats = [sorted(r, key=pos.__getitem__) for n in gm.graph.nodes if cast_cats and (r := cast_cat_region(n, taken))]
    taken.update(n for region in cats for n in region)
    casts = [[n] for n in gm.graph.nodes if lone_casts and n not in taken and is_lone_cast(n)]
    regions = sorted(chains + cats + casts, key=lambda r: pos[r[0]])
    st = tag_regions(regions, EAGER_NUMERICS, "exact_pointwise")
    eager, fused = (sum(t) for t in zip(*map(region_traffic, chains))) if chains else (0, 0)
    for n in [n for region in regions + muls for n in region]:
        n.meta[BARRIER_KEY] = True
        if packet_name(n) == "silu_backward":
            exact_silu_backward(n)  # its new nodes copy the region tag and the mark
    set_pass_summary(
        gm, f"tagged {st['nodes']} exact pointwise node(s) into {st['regions']} eager-numerics region(s) "
        f"({st['forward_regions']} forward, {st['backward_regions']} backward; largest {st['largest']} nodes; "
        f"{len(cats)} cats of casts, {len(casts)} lone casts); the chains' ops move {fused / 2**30:.2f} GiB fused "
        f"instead of {eager / 2**30:.2f} GiB one kernel each; {len(muls)} complex multiplies as real arithmetic",
        **st, complex_muls=len(muls), cast_cats=len(cats), lone_casts=len(casts), eager_bytes=eager, fused_bytes=fused)
    return gm


@dataclass
class ExactPointwiseOptions:
    """``[compile.annotate_exact_pointwise]``: options of ``annotate_exact_pointwise``."""

    min_ops: int = 2
    """Fewest ops (views not counted) of a chain that becomes a region."""
    activations: bool = True
    """SiLU and its backward join the chains on CUDA (written as eager's kernel computes them)."""
    lone_casts: bool = True
    """A cast from bf16 / fp16 to fp32 of at least 1 MiB on a CUDA device, outside every chain, is a
    region of its own (Inductor's cast kernel against eager's unvectorized one)."""
    cast_cats: bool = True
    """A cat on a CUDA device and the casts it concatenates are one region: each cast writes into
    its slice (FSDP's buckets before the all-gather and the reduce-scatter), no copy of them all."""
    complex_mul: bool = True
    """Each complex64 multiply on a CUDA device (RoPE's rotation) becomes real arithmetic with eager's
    FMAs, one region with the reshapes and casts around it."""

    def check(self) -> None:
        if self.min_ops < 1:
            raise ValueError(f"--compile.annotate_exact_pointwise.min_ops must be >= 1, got {self.min_ops}")


PASS = GraphPass(name="annotate_exact_pointwise_for_regional_inductor", fn=annotate_exact_pointwise_pass,
                 options=ExactPointwiseOptions, requires=("regional_inductor",), aliases=("exact_pointwise",),
                 enabled=lambda ctx: ctx.device_type == "cuda" and ctx.compile_cfg.inductor_compilation == "regional")
