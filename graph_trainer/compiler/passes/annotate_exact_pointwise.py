"""Tag chains of exactly rounded pointwise ops as Inductor regions that keep eager's bits.

Eager PyTorch runs ``mul``, ``add``, casts and the like one kernel each: every op reads its
inputs, computes in fp32 (bf16 / fp16 inputs upcast) and rounds its result to the output
dtype. Each such op is one correctly rounded IEEE operation, so a fused kernel gives the same
bits as long as it also rounds after every op and contracts no ``a * b + c`` into an FMA.
Inductor does both under ``emulate_precision_casts`` (Triton: ``enable_fp_fusion`` off), so
these regions save the intermediates' trips through memory and keep the numerics: no
``--compile.numerics_changing_optim``. Transcendental ops (SiLU, exp, rsqrt), division and
reductions round differently when fused and are left out.

Matches: :func:`~graph_trainer.compiler.common.find_pointwise_regions`'s
chains (one phase and module each, cut where a region would form a cycle) of the ops in
:data:`EXACT_OPS` (rules of :func:`is_exact`), at least ``min_ops`` of them.

Changes: ``compile_with_inductor = {"inductor_configs": EAGER_NUMERICS, "inductor_region":
"exact_pointwise_<phase>_<i>"}`` and ``meta["low_precision_pointwise_barrier"] = True`` (read
by Inductor's lowering: round after this op, as eager does) on the chosen nodes.

Applies: by default on CUDA under regional Inductor (``--compile.disable_passes exact_pointwise``
turns it off); elsewhere with ``--compile.passes exact_pointwise``. Not by default on the CPU:
torch 2.11's C++ backend folds the bf16 round trip away (not eager's bits there), and every
region is a C++ compile. Bitwise equality with eager: tested on the CPU with torch >= 2.13 and
with Triton on CUDA (``tests/passes/test_annotate_exact_pointwise.py``); the GPU runs and the
speed are in ``docs/perf.md``, "Eager-exact pointwise regions".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from graph_trainer.compiler.common import (BARRIER_KEY, find_pointwise_regions, packet_name, set_pass_summary,
                                           tag_regions, val_bytes)
from graph_trainer.compiler.registry import GraphPass

#: aten op packets computed as one correctly rounded operation per element (or exactly).
EXACT_OPS = frozenset({"add", "sub", "mul", "neg", "abs", "_to_copy", "clone", "copy", "where",
                       "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge"})
#: Inductor configs of the regions: round after every op, no FMA contraction, no flushing of
#: denormals (eager's CUDA kernels keep them).
EAGER_NUMERICS = {"emulate_precision_casts": True, "eager_numerics.disable_ftz": True}


def is_exact(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an op of :data:`EXACT_OPS` that fused code computes with eager's bits.
    Excluded: ``add`` / ``sub`` with ``alpha`` other than 1 (a multiply-add), and a Python number
    beside a bf16 / fp16 tensor unless that dtype holds it exactly (eager may round the number
    to the tensor's dtype first, Inductor computes with it in fp32)."""
    name = packet_name(node)
    if name not in EXACT_OPS or (name in ("add", "sub") and node.kwargs.get("alpha", 1) != 1):
        return False
    low = [v.dtype for u in node.all_input_nodes if isinstance(v := u.meta.get("val"), torch.Tensor)
           and v.dtype in (torch.bfloat16, torch.float16)]
    numbers = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return not any(torch.tensor(x, dtype=d).item() != x for x in numbers for d in low)


def region_traffic(region: list[torch.fx.Node]) -> tuple[int, int]:
    """``(eager, fused)``: bytes the region's ops read and write run one kernel each (every
    non-view op: its tensor inputs and its output), and as one fused kernel (the inputs from
    outside the region once, the outputs used outside it). Views move nothing; sizes:
    :func:`~graph_trainer.compiler.common.val_bytes` of ``meta["val"]``."""
    def nbytes(nodes):
        return sum(val_bytes(n.meta.get("val")) for n in nodes)

    members = set(region)
    eager = sum(nbytes([n, *n.all_input_nodes]) for n in region if is_exact(n))
    inputs = {u for n in region for u in n.all_input_nodes if u not in members}
    return eager, nbytes(inputs) + nbytes(n for n in region if any(u not in members for u in n.users))


def annotate_exact_pointwise_pass(gm: torch.fx.GraphModule, example_inputs: Any = None,
                                  min_ops: int = 2) -> torch.fx.GraphModule:
    """Tag each chain of :func:`is_exact` ops (at least ``min_ops``) as one eager-numerics region
    for ``regional_inductor``; ``ValueError`` for ``min_ops < 1``. Stats: those of ``tag_regions``
    (compiler/common.py), ``eager_bytes`` / ``fused_bytes`` (:func:`region_traffic`, summed: the
    memory traffic the regions save a step is their difference)."""
    if min_ops < 1:
        raise ValueError(f"min_ops must be >= 1, got {min_ops}")
    regions = find_pointwise_regions(gm.graph, min_ops, accept=is_exact)
    st = tag_regions(regions, EAGER_NUMERICS, "exact_pointwise")
    for n in (n for region in regions for n in region):
        n.meta[BARRIER_KEY] = True
    eager, fused = (sum(t) for t in zip(*map(region_traffic, regions))) if regions else (0, 0)
    set_pass_summary(
        gm, f"tagged {st['nodes']} exact pointwise node(s) into {st['regions']} eager-numerics region(s) "
        f"({st['forward_regions']} forward, {st['backward_regions']} backward; largest {st['largest']} nodes); "
        f"their ops move {fused / 2**30:.2f} GiB fused instead of {eager / 2**30:.2f} GiB one kernel each",
        **st, eager_bytes=eager, fused_bytes=fused,
    )
    return gm


PASS = GraphPass(
    name="annotate_exact_pointwise_for_regional_inductor", fn=annotate_exact_pointwise_pass,
    enabled=lambda ctx: ctx.device_type == "cuda" and ctx.compile_cfg.inductor_compilation == "regional",
    requires=("regional_inductor",), aliases=("exact_pointwise",),
)
