"""Scale projection: step time, tps/GPU and MFU of a traced step on a layout of GPUs.

A small cost model over the traced graph of one rank (the dry run's,
:mod:`graph_trainer.projection.dry_run`), per rank per training step::

    step      = compute + exposed communication
    compute   = Σ_matmul F_mm / R_mm(shape)               aten.mm / addmm / bmm / baddbmm (and
                                                          any other op with a torch FLOP formula)
              + Σ_attention F_attn / R_attn(shape)        fused SDPA ops, forward and backward
              + Σ_other (bytes read + bytes written) / B_hbm      every other op that moves data
              + optimizer bytes / B_hbm                  AdamW and grad-norm clipping, after the graph
    F_mm      = 2·M·N·K (·B batched)
    F_attn    = 4·B·H·S_q·S_k·D, ·½ when causal (forward); 2.5 × that for the backward
    t_coll    = α_link + bytes_on_wire / β_link
    bytes_on_wire = (n−1)/n · S   all_gather (S = gathered output), reduce_scatter (S = input)
                  = 2(n−1)/n · S  all_reduce (S = the buffer)
    tps/GPU   = local_batch · seq_len / (step · tp)
    MFU       = flops_per_token · tps/GPU / peak_bf16

Sources: F_mm and F_attn are ``torch.utils.flop_counter``'s per-op formulas
(``flop_registry``, :func:`node_flops`); its attention backward counts five matmuls against the
forward's two (the recomputed scores included), as FlashAttention-2 does (Dao 2023,
arXiv:2307.08691, §4.1: ``4·seqlen²·head_dim·n_heads``, backward 2.5×); the causal halving is
FlashAttention-2's, which torch's formulas leave out. ``flops_per_token`` is torchtitan's
``get_nparams_and_flops`` (6·N + 12·layers·heads·head_dim·seq: non-causal attention, no
recompute), so MFU here is the MFU ``graph_trainer.metrics`` reports; ``peak_bf16`` is its table
(:func:`graph_trainer.metrics.peak_bf16_for_name`). The collective cost is the α–β (Hockney)
model with NCCL's ring traffic: nccl-tests ``doc/PERFORMANCE.md`` defines the bus bandwidth
``busbw = algbw · (n−1)/n`` (all_gather, reduce_scatter) and ``· 2(n−1)/n`` (all_reduce), so
``β_link`` is a busbw and ``t = α + S·factor / busbw``.

Links: a group whose ranks lie on one node of ``gpus_per_node`` GPUs uses NVLink; a group that
spans nodes uses the network, one NIC per GPU: ``β = min(k · β_nic, β_nvlink)`` with ``k`` the
group's GPUs per node (the k GPUs of a node drive k NICs at once; every node runs the same
collective of its other groups on its other NICs), ``α = α_nic``. Ranks are placed in
torchtitan's mesh order ``(dp_replicate, dp_shard, tp)``, TP innermost, so
``rank = (replica · shard + shard_rank) · tp + tp_rank`` and node = rank // gpus_per_node.

Overlap (:class:`Overlap`): collectives of the mesh dimensions in ``overlapped`` (default
FSDP's ``dp_shard`` and HSDP's ``dp_replicate``) run under compute, except the first
all-gather of the step (nothing to hide behind) and the last reduction of each of those dims
(none after it: FSDP's last reduce-scatter, HSDP's last all-reduce); the others are exposed
only where together they exceed the compute time:
``exposed = first + last + max(0, Σ others − compute)``. Every other collective (TP's,
the loss's token count, those after the graph) is exposed, except the collectives inside the
async-TP pass's fused ops (``symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``: their matmul FLOPs count as matmuls, their collective as
overlapped); ``Overlap.async_tp`` (``--projection.async_tp``) overlaps every TP collective,
for a graph traced without that pass.

Left out (each makes the projection optimistic unless noted): the ring's per-hop latency
(``(n−1)`` steps; matters when ``S / n`` is small, large rings of small buckets); NCCL
kernels slowing the matmuls they overlap (docs/perf.md, "pinned full-graph Inductor");
kernel launch gaps and host overhead; fusion: every "other" op reads its inputs and writes
its output once (no fusion: pessimistic for full-graph Inductor); contention between
concurrent groups beyond the NIC rule above; SHARP / NVLS; the dry run's GQA head repeat on
the meta device (two ``[B, H, S, D]`` copies per layer that a GPU does not make, counted as
memory traffic).

Settings: the ``[projection]`` flags (``graph_trainer.config.Projection``, :func:`settings`);
constants: :mod:`graph_trainer.projection.devices`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from graph_trainer.errors import UserError
from graph_trainer.projection.devices import (  # noqa: F401  (re-exported: the projection's API)
    DEVICES, DeviceConstants, Link, apply_measurements, device_constants)

#: Mesh dimension names, in torchtitan's mesh order (outermost first).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
#: Flattened groups: the data-parallel ranks (the loss's token count, replicated DP's gradient
#: all-reduce), one replica (the gradient norm under HSDP), every rank.
FLAT_DIMS = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_tp": ("dp_shard", "tp"), "world": MESH_DIMS}
#: Bytes of HBM traffic per fp32 parameter shard after the graph: fused AdamW reads the
#: parameter, gradient and both moments and writes the parameter and moments (7 x 4 B);
#: gradient-norm clipping reads the gradient for the norm and reads + writes it to scale (3 x 4 B).
OPTIMIZER_BYTES_PER_PARAM = 40
#: Extra bytes per fp32 gradient element when replicated DP (no FSDP, no TP) all-reduces the
#: gradients after the graph: ``cat`` into one flat buffer and copy back (2 x (4 B read + 4 B written)).
FLAT_ALL_REDUCE_BYTES_PER_PARAM = 16
#: NCCL ring traffic per byte of collective size S (nccl-tests doc/PERFORMANCE.md, busbw).
_RING_FACTOR = {
    **dict.fromkeys(("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                     "reduce_scatter_tensor_coalesced", "all_to_all_single"), lambda n: (n - 1) / n),
    **dict.fromkeys(("all_reduce", "all_reduce_coalesced"), lambda n: 2 * (n - 1) / n),
    "broadcast": lambda n: 1.0,
}

aten = torch.ops.aten
#: Ops whose FLOPs torch's registry holds under another op with the same leading arguments:
#: the dry run traces the GPU's fused flash attention as the CPU flash op on the meta device
#: (:func:`graph_trainer.projection.dry_run.fused_attention_on_meta`), which has no formula there.
_FLOP_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}
#: Matmuls keyed by sorted ``(M, N, K)`` (``(B, ...)`` batched), the keys of the measured rates.
_MM_KEYED = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}


# --------------------------------------------------------------------------- layout and links


@dataclass(frozen=True)
class Layout:
    """Degrees of the mesh ``(dp_replicate, dp_shard, tp)`` and the node size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    gpus_per_node: int = 8

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    def degree(self, dim: str) -> int:
        """Ranks in the group of mesh dimension (or flattened dimension) ``dim``."""
        n = 1
        for d in FLAT_DIMS.get(dim, (dim,)):
            n *= getattr(self, d)
        return n

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of rank 0's group of ``dim`` (mesh order ``(dp_replicate, dp_shard,
        tp)``, TP innermost).

        Raises:
            KeyError: ``dim`` is no mesh or flattened dimension.
        """
        dims = FLAT_DIMS.get(dim, (dim,))
        if any(d not in MESH_DIMS for d in dims):
            raise KeyError(dim)
        stride = {"tp": 1, "dp_shard": self.tp, "dp_replicate": self.tp * self.dp_shard}
        ranks = [0]
        for d in dims:
            ranks = [r + i * stride[d] for r in ranks for i in range(getattr(self, d))]
        return sorted(ranks)


def link_for(ranks: Iterable[int], gpus_per_node: int, dev: DeviceConstants) -> tuple[str, Link]:
    """``("nvlink" | "network", Link)`` of a group of global ``ranks``: NVLink when they lie on
    one node, else the network at ``min(k · β_nic, β_nvlink)`` for ``k`` GPUs of the group per node
    (module docstring)."""
    ranks = list(ranks)
    nodes = {r // gpus_per_node for r in ranks}
    if len(nodes) <= 1:
        return "nvlink", dev.nvlink
    k = max(1, len(ranks) // len(nodes))
    return "network", Link(dev.nic.alpha_s, min(k * dev.nic.busbw_Bps, dev.nvlink.busbw_Bps))


def ring_bytes_on_wire(kind: str, size_bytes: float, n: int) -> float:
    """Bytes each rank sends for one ring collective (nccl-tests doc/PERFORMANCE.md):
    ``(n−1)/n · S`` for all_gather (S = gathered output) and reduce_scatter (S = input),
    ``2(n−1)/n · S`` for all_reduce. ``n = 1``: 0.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in _RING_FACTOR:
        raise ValueError(f"no ring formula for collective {kind!r}")
    return 0.0 if n <= 1 else _RING_FACTOR[kind](n) * size_bytes


def collective_time(kind: str, size_bytes: float, n: int, link: Link) -> float:
    """Seconds of one collective: ``α + bytes_on_wire / busbw`` (0 for one rank)."""
    if n <= 1:
        return 0.0
    alpha, beta = link.constants(kind)
    return alpha + ring_bytes_on_wire(kind, size_bytes, n) / beta


# --------------------------------------------------------------------------- the graph


def _args(node: torch.fx.Node) -> dict:
    """``node``'s arguments by schema name (positional and keyword)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return dict(node.kwargs)
    out = {a.name: v for a, v in zip(schema.arguments, node.args)}
    out.update(node.kwargs)
    return out


def _val_bytes(val) -> int:
    """Bytes of a tensor (at most its storage: an expanded view reads its storage) or of a
    list / tuple of them; 0 for anything else."""
    if isinstance(val, torch.Tensor):
        n = val.numel() * val.element_size()
        try:
            n = min(n, val.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        return n
    if isinstance(val, (list, tuple)):
        return sum(_val_bytes(v) for v in val)
    return 0


def _meta(arg):
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def node_flops(node: torch.fx.Node) -> tuple[str, float, tuple] | None:
    """``(term, FLOPs, shape key)`` of a node whose op has a formula in
    ``torch.utils.flop_counter.flop_registry`` (mm, addmm, bmm, baddbmm, ``_scaled_mm``,
    convolution, the fused SDPA ops and their backward), else None. ``term``: ``"attention"``
    for attention ops, else ``"matmul"``.

    FLOPs: torch's formula evaluated on the arguments' ``meta["val"]`` (fake / meta tensors),
    as ``FlopCounterMode`` evaluates it on the live ones: ``2·M·N·K`` per matmul (``·B``
    batched); SDPA forward ``4·B·H·S_q·S_k·D``, backward 2.5× (five matmuls, the recomputed
    scores included, as FlashAttention-2 counts them, arXiv:2307.08691 §4.1). Two things torch's
    registry cannot do here, added on top: attention is halved when ``is_causal`` (its formulas
    count the whole ``S_q × S_k`` score matrix, "not accounting for causal attention"), the
    causal count of FlashAttention-2 §4.1 and of the measured attention rates; and the dry
    run's CPU flash op is counted with the GPU flash op's formula (:data:`_FLOP_ALIASES`).

    Key: sorted ``(M, N, K)`` for mm / addmm, ``(B, *sorted(M, N, K))`` for bmm / baddbmm,
    ``(B, H, S_q, D)`` (query shape) for attention, ``(op name, input shapes...)`` otherwise.
    """
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    packet = node.target.overloadpacket
    formula = flop_registry.get(_FLOP_ALIASES.get(packet, packet))
    if formula is None:
        return None
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _meta)
    out = node.meta.get("val")
    flops = formula(*args, out_val=out, **kwargs)
    if "attention" in packet.__name__:
        a = _args(node)
        causal = 0.5 if a.get("is_causal") else 1.0
        return "attention", flops * causal, tuple(_meta(a["query"]).shape)
    if packet in _MM_KEYED and isinstance(out, torch.Tensor) and out.numel():
        *b, m, n = out.shape
        return "matmul", flops, (*b, *sorted((m, n, flops // (2 * math.prod(out.shape)))))
    shapes = [tuple(v.shape) for v in args if isinstance(v, torch.Tensor)]
    return "matmul", flops, (packet.__name__, *shapes)


#: Async TP's micro-pipelined ops (graph_trainer/compiler/passes/async_tp.py) -> the collective inside.
_FUSED_TP = {"fused_all_gather_matmul": "all_gather_into_tensor",
             "fused_matmul_reduce_scatter": "reduce_scatter_tensor"}


def _mm(m: int, k: int, n: int) -> tuple[int, tuple]:
    """``(FLOPs, sorted (M, N, K))`` of ``[M, K] @ [K, N]`` by torch's ``aten.mm`` formula."""
    return flop_registry[aten.mm]((m, k), (k, n)), tuple(sorted((m, k, n)))


def fused_tp_work(node: torch.fx.Node) -> tuple[list[tuple[int, tuple]], int, str] | None:
    """``([(FLOPs, shape key) per matmul], S bytes, collective kind)`` of an async-TP op
    (``symm_mem.fused_all_gather_matmul(A, Bs, ...)``: the gathered ``A [M, K]`` times each
    ``B [K, N_i]``, S = gathered A; ``fused_matmul_reduce_scatter(A, B, ...)``: ``A [M, K] @
    B [K, N]``, S = the ``[M, N]`` product), else None. Shapes from ``meta["val"]``.

    Own code because ``torch.utils.flop_counter`` has no formula for the ``symm_mem`` ops
    (tests/test_projection.py checks it): it maps them onto ``aten.mm``'s formula (``2·M·N·K``)
    and names the collective inside, which the projection counts as overlapped."""
    name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", None)
    if node.op != "call_function" or name not in _FUSED_TP:
        return None
    a = _args(node)
    A = _meta(a["A"])
    k = A.shape[-1]
    if name == "fused_all_gather_matmul":
        bs = [_meta(b) for b in a["Bs"]]
        m = node.meta["val"][1][0].numel() // bs[0].shape[-1]  # rows after the gather
        return [_mm(m, k, b.shape[-1]) for b in bs], m * k * A.element_size(), _FUSED_TP[name]
    m, n = A.numel() // k, _meta(a["B"]).shape[-1]
    return [_mm(m, k, n)], m * n * node.meta["val"].element_size(), _FUSED_TP[name]


def _is_view(target) -> bool:
    """An op that returns an alias of an input (no data moves): its schema says so, or it is
    one of the passes' view ops (``_unsafe_view`` declares no alias)."""
    from graph_trainer.compiler.common import VIEW_OPS

    if target in VIEW_OPS:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                      for r in schema.returns)


def memory_op_bytes(node: torch.fx.Node) -> int:
    """Bytes read + written by ``node`` when it is an "other" op (not a matmul, attention,
    collective, view or graph bookkeeping), else 0: its tensor inputs' and outputs' sizes."""
    from graph_trainer.compiler.common import is_collective

    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    if (is_collective(node) or _is_view(node.target) or node_flops(node) is not None
            or fused_tp_work(node) is not None):
        return 0
    reads = sum(_val_bytes(_meta(a)) for a in node.all_input_nodes)
    return reads + _val_bytes(node.meta.get("val"))


@dataclass
class CollectiveOp:
    """One collective of the step: ``kind``, mesh ``dim``, size ``S`` in bytes (the
    gathered output / reduced input / buffer), graph position ``index`` (-1: after the graph),
    ``fused``: inside an async-TP op, micro-pipelined with its matmul (overlapped)."""

    kind: str
    dim: str
    size_bytes: int
    index: int = -1
    fused: bool = False


def collectives_of(gm: torch.fx.GraphModule, group_dims: Mapping[str, str]) -> list[CollectiveOp]:
    """The functional collectives of ``gm`` in graph order, each attributed to a mesh dimension
    through its ``group_name`` argument (``group_dims``: group name -> dim; unknown groups:
    ``"?"``). Size = the larger of input and output bytes."""
    from graph_trainer.compiler.common import collective_kind

    out = []
    for i, n in enumerate(gm.graph.nodes):
        if (kind := collective_kind(n)) is None or fused_tp_work(n) is not None:  # (graph_work counts those)
            continue
        a = _args(n)
        ins = a.get("input", a.get("inputs", a.get("tensor")))
        size = max(_val_bytes(_meta(ins) if not isinstance(ins, (list, tuple)) else [_meta(x) for x in ins]),
                   _val_bytes(n.meta.get("val")))
        out.append(CollectiveOp(kind, group_dims.get(str(a.get("group_name")), "?"), size, i))
    return out


@dataclass
class GraphWork:
    """What one rank's traced step does, independent of the device.

    Attributes:
        matmuls: ``{shape key: FLOPs}``; attention: ``{(B, H, S, D): FLOPs}``.
        memory_bytes: bytes read + written by the other ops.
        collectives: :func:`collectives_of`.
    """

    matmuls: dict[tuple, float]
    attention: dict[tuple, float]
    memory_bytes: int
    collectives: list[CollectiveOp]

    @property
    def matmul_flops(self) -> float:
        return sum(self.matmuls.values())

    @property
    def attention_flops(self) -> float:
        return sum(self.attention.values())


def graph_work(gm: torch.fx.GraphModule, group_dims: Mapping[str, str] | None = None) -> GraphWork:
    """Count matmul and attention FLOPs (:func:`node_flops`, :func:`fused_tp_work`), other ops'
    bytes (:func:`memory_op_bytes`) and collectives (:func:`collectives_of`) of ``gm``, whose
    nodes carry ``meta["val"]`` as make_fx leaves them. FLOPs in FLOP, bytes in bytes."""
    mm: dict[tuple, float] = defaultdict(float)
    attn: dict[tuple, float] = defaultdict(float)
    mem = 0
    colls = collectives_of(gm, group_dims or {})
    for i, n in enumerate(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if (f := fused_tp_work(n)) is not None:
            for flops, key in f[0]:
                mm[key] += flops
            colls.append(CollectiveOp(f[2], (group_dims or {}).get(str(_args(n)["group_name"]), "?"), f[1], i, True))
        elif (f := node_flops(n)) is not None:
            (attn if f[0] == "attention" else mm)[f[2]] += f[1]
        else:
            mem += memory_op_bytes(n)
    return GraphWork(dict(mm), dict(attn), mem, sorted(colls, key=lambda c: c.index))


# --------------------------------------------------------------------------- the projection


@dataclass(frozen=True)
class Overlap:
    """Which collectives hide under compute (module docstring).

    Attributes:
        overlapped: mesh dims whose collectives overlap with compute (FSDP's ``dp_shard``,
            HSDP's ``dp_replicate``); the first all-gather and the last reduction of each dim
            stay exposed.
        async_tp: also overlap TP's collectives (an async-TP pass).
    """

    overlapped: frozenset = frozenset({"dp_shard", "dp_replicate"})
    async_tp: bool = False

    def dims(self) -> frozenset:
        return self.overlapped | ({"tp"} if self.async_tp else set())


@dataclass
class Projection:
    """Projected per-rank step. Times in seconds; ``comm`` rows are dicts with ``kind``,
    ``dim``, ``link``, ``ranks``, ``ops``, ``bytes``, ``time_s`` (all ops) and ``exposed_s``."""

    device: str
    source: str
    layout: Layout
    matmul_s: float
    attention_s: float
    memory_s: float
    optimizer_s: float
    comm: list[dict]
    tokens_per_rank: int
    flops_per_token: float
    peak_flops: float
    matmul_flops: float
    attention_flops: float
    memory_bytes: int

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.attention_s + self.memory_s + self.optimizer_s

    @property
    def exposed_comm_s(self) -> float:
        return sum(c["exposed_s"] for c in self.comm)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s

    @property
    def tps_per_gpu(self) -> float:
        return self.tokens_per_rank / (self.step_s * self.layout.tp)

    @property
    def mfu(self) -> float:
        """Percent of ``peak_flops`` (torchtitan's model FLOPs, as graph_trainer.metrics)."""
        return 100.0 * self.flops_per_token * self.tps_per_gpu / self.peak_flops

    def graph_flops_per_token(self) -> float:
        """Matmul + attention FLOPs of the graph per token of the model (× tp: a rank computes
        1/tp of each token), recompute included."""
        return (self.matmul_flops + self.attention_flops) * self.layout.tp / self.tokens_per_rank

    def to_dict(self) -> dict:
        ms = 1e3
        return {
            "device": self.device, "constants": self.source, "gpus_per_node": self.layout.gpus_per_node,
            "compute_ms": round(self.compute_s * ms, 2),
            "compute_ms_by_term": {k: round(v * ms, 2) for k, v in (
                ("matmul", self.matmul_s), ("attention", self.attention_s), ("memory", self.memory_s),
                ("optimizer", self.optimizer_s))},
            "comm": [{**{k: v for k, v in c.items() if not k.endswith("_s")},
                      "time_ms": round(c["time_s"] * ms, 3), "exposed_ms": round(c["exposed_s"] * ms, 3)}
                     for c in self.comm],
            "exposed_comm_ms": round(self.exposed_comm_s * ms, 2),
            "step_ms": round(self.step_s * ms, 2),
            "tps_per_gpu": round(self.tps_per_gpu, 1),
            "mfu_pct": round(self.mfu, 2),
            "matmul_tflop": round(self.matmul_flops / 1e12, 3), "attention_tflop": round(self.attention_flops / 1e12, 3),
            "memory_gb": round(self.memory_bytes / 1e9, 3),
            "graph_flops_per_token": self.graph_flops_per_token(),
            "flops_per_token": self.flops_per_token,
        }

    def lines(self) -> list[str]:
        """The projection as log lines (ms, GiB)."""
        ms, gib = 1e3, 2**30
        L = self.layout
        out = [
            f"projection on {self.device.upper()} ({self.source}; nodes of {L.gpus_per_node} GPUs), per rank per step:",
            f"  compute {self.compute_s * ms:.1f} ms = matmul {self.matmul_s * ms:.1f} "
            f"({self.matmul_flops / 1e12:.1f} TFLOP) + attention {self.attention_s * ms:.1f} "
            f"({self.attention_flops / 1e12:.1f} TFLOP) + memory-bound {self.memory_s * ms:.1f} "
            f"({self.memory_bytes / 1e9:.0f} GB) + optimizer {self.optimizer_s * ms:.1f}",
        ]
        for c in self.comm:
            kind = c["kind"] + (" in async-TP matmuls" if c["async_tp"] else "")
            out.append(f"  {kind} over {c['dim']} ({c['ranks']} ranks, {c['link']}): {c['ops']} ops, "
                       f"{c['bytes'] / gib:.3f} GiB, {c['time_s'] * ms:.1f} ms, exposed {c['exposed_s'] * ms:.1f} ms")
        out.append(f"  step {self.step_s * ms:.1f} ms (exposed communication {self.exposed_comm_s * ms:.1f} ms) -> "
                   f"{self.tps_per_gpu:,.0f} tps/GPU, MFU {self.mfu:.1f} %")
        out.append(f"  graph FLOPs per token (matmul + causal attention, recompute included) "
                   f"{self.graph_flops_per_token() / 1e9:.2f} GFLOP vs torchtitan's flops_per_token "
                   f"{self.flops_per_token / 1e9:.2f} GFLOP (6N + non-causal attention, its backward 2x the "
                   f"forward where FlashAttention-2 counts 2.5x)")
        return out


def project(work: GraphWork, layout: Layout, dev: DeviceConstants, *, tokens_per_rank: int,
            flops_per_token: float, after_graph_bytes: int = 0,
            extra_collectives: Iterable[CollectiveOp] = (), overlap: Overlap = Overlap()) -> Projection:
    """Project one rank's step of ``work`` on ``layout`` of ``dev`` GPUs (module docstring).

    Args:
        work: :func:`graph_work` of the step's graph (after the graph passes).
        layout: the mesh degrees and node size; ``work``'s collective dims are looked up in it.
        dev: :func:`device_constants`.
        tokens_per_rank: ``local_batch_size · seq_len``.
        flops_per_token: torchtitan's model FLOPs per token (the MFU numerator).
        after_graph_bytes: HBM bytes moved after the graph (:func:`after_graph_bytes`).
        extra_collectives: collectives after the graph (exposed).
        overlap: :class:`Overlap`.

    Raises:
        UserError: a collective of a dimension the layout does not have (``"?"``: an unknown
            process group).
    """
    matmul_s = sum(f / dev.matmul_by_shape.get(k, dev.matmul_flops) for k, f in work.matmuls.items())
    attention_s = sum(f / dev.attention_by_shape.get(k, dev.attention_flops) for k, f in work.attention.items())
    memory_s = work.memory_bytes / dev.hbm_Bps
    optimizer_s = after_graph_bytes / dev.hbm_Bps
    compute_s = matmul_s + attention_s + memory_s + optimizer_s

    rows: dict[tuple, dict] = {}
    links: dict[str, tuple[str, Link, int]] = {}
    timed = []
    for c in [*work.collectives, *extra_collectives]:
        if c.dim not in links:
            try:
                ranks = layout.group_ranks(c.dim)
            except KeyError:
                raise UserError(f"A {c.kind} of the traced graph runs over a process group that is no mesh "
                                f"dimension of {layout}; the projection cannot place it.") from None
            name, link = link_for(ranks, layout.gpus_per_node, dev)
            links[c.dim] = (name, link, len(ranks))
        name, link, n = links[c.dim]
        t = collective_time(c.kind, c.size_bytes, n, link)
        timed.append((c, t))
        row = rows.setdefault((c.kind, c.dim, c.fused), {
            "kind": c.kind, "dim": c.dim, "async_tp": c.fused, "link": name, "ranks": n, "ops": 0, "bytes": 0,
            "time_s": 0.0, "exposed_s": 0.0})
        row["ops"] += 1
        row["bytes"] += c.size_bytes
        row["time_s"] += t

    dims = overlap.dims()
    hidden = [(c, t) for c, t in timed if (c.dim in dims or c.fused) and c.index >= 0]
    gathers = [x for x in hidden if x[0].kind.startswith("all_gather") and not x[0].fused]
    edges = [min(gathers, key=lambda x: x[0].index)] if gathers else []
    for dim in sorted(dims):  # the last reduction of each dim: FSDP's reduce-scatter, HSDP's all-reduce
        reductions = [x for x in hidden if x[0].dim == dim and not x[0].kind.startswith("all_gather")]
        if reductions:
            edges.append(max(reductions, key=lambda x: x[0].index))
    for c, t in timed:
        if not ((c.dim in dims or c.fused) and c.index >= 0):
            rows[(c.kind, c.dim, c.fused)]["exposed_s"] += t
    for c, t in edges:
        rows[(c.kind, c.dim, c.fused)]["exposed_s"] += t
    edge_ids = {id(c) for c, _ in edges}
    rest = [(c, t) for c, t in hidden if id(c) not in edge_ids]
    total_rest = sum(t for _, t in rest)
    excess = max(0.0, total_rest - compute_s)
    for c, t in rest:  # the part compute cannot hide, shared in proportion to time
        rows[(c.kind, c.dim, c.fused)]["exposed_s"] += excess * t / total_rest

    return Projection(
        device=dev.name, source=dev.source, layout=layout, matmul_s=matmul_s, attention_s=attention_s,
        memory_s=memory_s, optimizer_s=optimizer_s,
        comm=sorted(rows.values(), key=lambda r: (r["dim"], r["kind"])),
        tokens_per_rank=tokens_per_rank, flops_per_token=flops_per_token, peak_flops=dev.peak_bf16_flops,
        matmul_flops=work.matmul_flops, attention_flops=work.attention_flops, memory_bytes=work.memory_bytes,
    )


def after_graph_bytes(params: int, flat_all_reduce: bool = False) -> int:
    """HBM bytes moved after the graph for ``params`` fp32 parameter elements on this rank:
    :data:`OPTIMIZER_BYTES_PER_PARAM` each, plus :data:`FLAT_ALL_REDUCE_BYTES_PER_PARAM` when the
    gradients are all-reduced as one flat buffer (replicated DP alone)."""
    return params * (OPTIMIZER_BYTES_PER_PARAM + FLAT_ALL_REDUCE_BYTES_PER_PARAM * flat_all_reduce)


def settings(opts) -> tuple[DeviceConstants, int, Overlap]:
    """``(device constants, gpus_per_node, overlap)`` of the ``[projection]`` flags ``opts``
    (``cfg.projection``, ``graph_trainer.config.Projection``): ``device``, ``cost_constants``
    (:func:`device_constants`), ``gpus_per_node`` and ``async_tp`` (:class:`Overlap`).

    Raises:
        UserError: a bad value, naming its flag.
    """
    gpn = opts.gpus_per_node
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise UserError(f"--projection.gpus_per_node must be a positive integer, got {gpn!r}.")
    if not isinstance(opts.async_tp, bool):
        raise UserError(f"--projection.async_tp must be true or false, got {opts.async_tp!r}.")
    if not isinstance(opts.cost_constants, str):
        raise UserError(f"--projection.cost_constants must be a file name, got {opts.cost_constants!r}.")
    return device_constants(opts.device, opts.cost_constants), gpn, Overlap(async_tp=opts.async_tp)
