"""Scale projection: step time, tps/GPU and MFU of a traced step on a layout of GPUs.

A small cost model over the traced graph of one rank (the dry run's,
:mod:`graph_trainer.dry_run`), per rank per training step::

    step      = compute + exposed communication
    compute   = Σ_matmul 2·M·N·K / R_mm(shape)          aten.mm / addmm (bmm / baddbmm: ·B)
              + Σ_attention F / R_attn(shape)           fused SDPA ops, forward and backward
              + Σ_other (bytes read + bytes written) / B_hbm      every other op that moves data
              + optimizer bytes / B_hbm                  AdamW and grad-norm clipping, after the graph
    F_attn    = 4·B·H·S_q·S_k·D, ·½ when causal (forward); 2.5 × that for the backward
    t_coll    = α_link + bytes_on_wire / β_link
    bytes_on_wire = (n−1)/n · S   all_gather (S = gathered output), reduce_scatter (S = input)
                  = 2(n−1)/n · S  all_reduce (S = the buffer)
    tps/GPU   = local_batch · seq_len / (step · tp)
    MFU       = flops_per_token · tps/GPU / peak_bf16

Sources: matmul FLOPs 2·M·N·K; attention FLOPs as FlashAttention-2 counts them (Dao 2023,
arXiv:2307.08691, §4.1: ``4·seqlen²·head_dim·n_heads``, halved when causal, backward 2.5×
the forward: 5 matmuls against 2); ``flops_per_token`` is torchtitan's
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
overlapped); ``Overlap.async_tp`` (``PROJECTION_ASYNC_TP=1``) overlaps every TP collective,
for a graph traced without that pass.

Left out (each makes the projection optimistic unless noted): the ring's per-hop latency
(``(n−1)`` steps; matters when ``S / n`` is small, large rings of small buckets); NCCL
kernels slowing the matmuls they overlap (measured +11 % on the 8B, docs/perf.md, "pinned
full-graph Inductor"); kernel launch gaps and host overhead; fusion: every "other" op reads
its inputs and writes its output once (no fusion: pessimistic for full-graph Inductor);
contention between concurrent groups beyond the NIC rule above; SHARP / NVLS; the dry run's
GQA head repeat on the meta device (two ``[B, H, S, D]`` copies per layer that a GPU does
not make, counted as memory traffic).

Constants (:class:`DeviceConstants`): vendor datasheet values until
``scripts/cost_constants.py`` has measured them on the GPU and written a JSON file; a file
``graph_trainer/cost_constants/<device>.json`` or ``$COST_CONSTANTS`` replaces the defaults
field by field, and the projection says which fields were measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.fx

from graph_trainer.errors import UserError

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
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_gather_into_tensor_coalesced": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_tensor_coalesced": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_reduce_coalesced": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
}

aten = torch.ops.aten
_MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
#: Fused attention ops (GPU: cuDNN / flash / memory-efficient; meta: the dry run's CPU flash op).
_ATTENTION_FWD = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"}
_ATTENTION_BWD = {f"{name}_backward" for name in _ATTENTION_FWD}


# --------------------------------------------------------------------------- device constants


@dataclass(frozen=True)
class Link:
    """One link type's α–β constants.

    Attributes:
        alpha_s: latency per collective, seconds.
        busbw_Bps: bus bandwidth, bytes/s (nccl-tests' busbw: one direction, per GPU).
        by_kind: ``{collective kind: (alpha_s, busbw_Bps)}`` measured per kind; kinds not
            in it use ``alpha_s`` / ``busbw_Bps``.
    """

    alpha_s: float
    busbw_Bps: float
    by_kind: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def constants(self, kind: str) -> tuple[float, float]:
        """``(alpha_s, busbw_Bps)`` for collective ``kind``."""
        return tuple(self.by_kind.get(kind, (self.alpha_s, self.busbw_Bps)))


@dataclass(frozen=True)
class DeviceConstants:
    """Throughputs of one GPU kind. Rates in FLOP/s and bytes/s, sizes in GiB.

    Attributes:
        name: ``"h100"`` / ``"h200"``.
        peak_bf16_flops: dense bf16 peak, the MFU denominator (``graph_trainer.metrics``).
        matmul_flops: bf16 matmul rate for shapes not in ``matmul_by_shape``.
        attention_flops: causal SDPA forward + backward rate (FLOPs counted as in the
            module docstring) for shapes not in ``attention_by_shape``.
        hbm_Bps: memory bandwidth, bytes read + written per second.
        nvlink: the link inside a node.
        nic: one GPU's network link (the NIC of a GPU, rail-optimized).
        memory_gib: device memory the dry run's memory policy plans for.
        matmul_by_shape: ``{sorted (M, N, K): FLOP/s}`` measured.
        attention_by_shape: ``{(B, H, S, D): FLOP/s}`` measured (H: query heads).
        measured: the fields a measurement file set.
        source: where the values came from (printed with the projection).
    """

    name: str
    peak_bf16_flops: float
    matmul_flops: float
    attention_flops: float
    hbm_Bps: float
    nvlink: Link
    nic: Link
    memory_gib: float
    matmul_by_shape: Mapping[tuple, float] = field(default_factory=dict)
    attention_by_shape: Mapping[tuple, float] = field(default_factory=dict)
    measured: tuple[str, ...] = ()
    source: str = "datasheet defaults"


def _defaults(name: str, gpu: str, hbm_Bps: float, memory_gib: float) -> DeviceConstants:
    """Vendor datasheet values (NVIDIA H100 / H200 SXM data sheets): dense bf16 peak for the
    matmul and attention rates (no efficiency applied), HBM bandwidth, NVLink 4 at 900 GB/s
    bidirectional = 450 GB/s per direction, ConnectX-7 400 Gb/s = 50 GB/s per GPU. The α
    values are assumptions (no datasheet gives them): 10 µs inside a node, 20 µs across."""
    from graph_trainer.metrics import peak_bf16_for_name

    peak = peak_bf16_for_name(gpu)
    return DeviceConstants(name=name, peak_bf16_flops=peak, matmul_flops=peak, attention_flops=peak,
                           hbm_Bps=hbm_Bps, nvlink=Link(10e-6, 450e9), nic=Link(20e-6, 50e9), memory_gib=memory_gib)


def _default_devices() -> dict[str, DeviceConstants]:
    from graph_trainer.passes.memory_policy import DRY_RUN_DEVICES_GIB

    return {
        "h100": _defaults("h100", "H100", 3.35e12, DRY_RUN_DEVICES_GIB[0]),
        "h200": _defaults("h200", "H200", 4.8e12, DRY_RUN_DEVICES_GIB[1]),
    }


#: The device kinds ``PROJECTION_DEVICE`` accepts.
DEVICES = ("h100", "h200")
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cost_constants")


def device_constants(name: str, path: str | None = None) -> DeviceConstants:
    """The constants of device kind ``name``: datasheet defaults, with every field that the
    measurement file sets replaced.

    Args:
        name: ``"h100"`` or ``"h200"`` (case-insensitive; ``PROJECTION_DEVICE``).
        path: a JSON file written by ``scripts/cost_constants.py``; ``None``: ``$COST_CONSTANTS``
            if set, else ``graph_trainer/cost_constants/<name>.json`` if it exists, else none.

    Raises:
        UserError: unknown ``name``; the file is missing, not JSON, or measured another GPU.
    """
    key = name.strip().lower()
    if key not in DEVICES:
        raise UserError(f"PROJECTION_DEVICE={name!r} is not known; use one of {', '.join(DEVICES)}.")
    dev = _default_devices()[key]
    if path is None:
        path = os.environ.get("COST_CONSTANTS") or os.path.join(_HERE, f"{key}.json")
        if not os.environ.get("COST_CONSTANTS") and not os.path.exists(path):
            return dev
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"COST_CONSTANTS={path}: cannot read a JSON file ({e}).") from None
    return apply_measurements(dev, data, path)


def apply_measurements(dev: DeviceConstants, data: dict, path: str = "<dict>") -> DeviceConstants:
    """``dev`` with the fields measured in ``data`` (the JSON of ``scripts/cost_constants.py``:
    ``device``, ``matmul`` rows ``{m, n, k, tflops}``, ``matmul_tflops``, ``attention`` rows
    ``{b, h, s, d, tflops}``, ``attention_tflops``, ``hbm_gbps``, ``nccl``
    ``{kind: {alpha_us, busbw_gbps}}`` measured inside one node, ``nccl_network`` the same
    measured across nodes with ``gpus_per_node`` each).

    Raises:
        UserError: ``data["device"]`` names another GPU than ``dev``.
    """
    gpu = str(data.get("device", ""))
    if gpu and dev.name.upper() not in gpu.upper():
        raise UserError(f"COST_CONSTANTS={path} was measured on {gpu!r}, not an {dev.name.upper()}.")
    upd, measured = {}, []
    if data.get("matmul_tflops"):
        upd["matmul_flops"] = data["matmul_tflops"] * 1e12
        upd["matmul_by_shape"] = {tuple(sorted((r["m"], r["n"], r["k"]))): r["tflops"] * 1e12
                                  for r in data.get("matmul", [])}
        measured.append("matmul")
    if data.get("attention_tflops"):
        upd["attention_flops"] = data["attention_tflops"] * 1e12
        upd["attention_by_shape"] = {(r["b"], r["h"], r["s"], r["d"]): r["tflops"] * 1e12
                                     for r in data.get("attention", [])}
        measured.append("attention")
    if data.get("hbm_gbps"):
        upd["hbm_Bps"] = data["hbm_gbps"] * 1e9
        measured.append("hbm")
    nccl = {k: (v["alpha_us"] * 1e-6, v["busbw_gbps"] * 1e9) for k, v in (data.get("nccl") or {}).items()}
    if nccl:
        # the NVLink default for kinds not measured: the mean of the measured ones
        alpha = sum(a for a, _ in nccl.values()) / len(nccl)
        beta = sum(b for _, b in nccl.values()) / len(nccl)
        upd["nvlink"] = Link(alpha, beta, nccl)
        measured.append("nvlink")
    net = data.get("nccl_network") or {}
    if net:  # measured across hosts with k GPUs each: k NICs at once (module docstring), per NIC / k
        alpha = sum(v["alpha_us"] * 1e-6 for v in net.values()) / len(net)
        beta = sum(v["busbw_gbps"] * 1e9 / v.get("gpus_per_node", 1) for v in net.values()) / len(net)
        upd["nic"] = Link(alpha, beta)
        measured.append("nic")
    if not measured:
        return dev
    return dataclasses.replace(dev, **upd, measured=tuple(measured),
                               source=f"measured ({', '.join(measured)}) in {os.path.basename(path)}, "
                                      "the rest datasheet defaults")


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


def matmul_flops(node: torch.fx.Node) -> tuple[int, tuple] | None:
    """``(FLOPs, shape key)`` of an ``aten.mm / addmm / bmm / baddbmm`` node, else None:
    ``2·M·N·K`` (·B for the batched ones); key = sorted ``(M, N, K)`` (``(B, ...)`` batched).
    Uses the input shapes of the nodes' ``meta["val"]``."""
    if node.target not in _MATMUL_OPS:
        return None
    a = _args(node)
    x, w = _meta(a.get("mat1", a.get("self"))), _meta(a.get("mat2"))
    if node.target in (aten.bmm.default, aten.baddbmm.default):
        x, w = _meta(a.get("batch1", a.get("self"))), _meta(a.get("batch2", a.get("mat2")))
        b, m, k = x.shape
        n = w.shape[-1]
        return 2 * b * m * n * k, (b, *sorted((m, n, k)))
    m, k = x.shape
    n = w.shape[-1]
    return 2 * m * n * k, tuple(sorted((m, n, k)))


def attention_flops(node: torch.fx.Node) -> tuple[float, tuple] | None:
    """``(FLOPs, (B, H, S_q, D))`` of a fused SDPA forward or backward node, else None.
    Forward ``4·B·H·S_q·S_k·D``, halved when ``is_causal``; backward 2.5× (FlashAttention-2,
    §4.1). Shapes from the ``query`` / ``key`` arguments ``[B, H, S, D]``."""
    name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", None)
    if name not in _ATTENTION_FWD and name not in _ATTENTION_BWD:
        return None
    a = _args(node)
    q, k = _meta(a["query"]), _meta(a["key"])
    b, h, s_q, d = q.shape
    flops = 4.0 * b * h * s_q * k.shape[-2] * d * (0.5 if a.get("is_causal") else 1.0)
    return flops * (2.5 if name in _ATTENTION_BWD else 1.0), (b, h, s_q, d)


#: Async TP's micro-pipelined ops (graph_trainer/passes/async_tp.py) -> the collective inside.
_FUSED_TP = {"fused_all_gather_matmul": "all_gather_into_tensor",
             "fused_matmul_reduce_scatter": "reduce_scatter_tensor"}


def fused_tp_work(node: torch.fx.Node) -> tuple[list[tuple[int, tuple]], int, str] | None:
    """``([(FLOPs, shape key) per matmul], S bytes, collective kind)`` of an async-TP op
    (``symm_mem.fused_all_gather_matmul(A, Bs, ...)``: the gathered ``A [M, K]`` times each
    ``B [K, N_i]``, S = gathered A; ``fused_matmul_reduce_scatter(A, B, ...)``: ``A [M, K] @
    B [K, N]``, S = the ``[M, N]`` product), else None. Shapes from ``meta["val"]``."""
    name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", None)
    if node.op != "call_function" or name not in _FUSED_TP:
        return None
    a = _args(node)
    A = _meta(a["A"])
    k = A.shape[-1]
    if name == "fused_all_gather_matmul":
        bs = [_meta(b) for b in a["Bs"]]
        m = node.meta["val"][1][0].numel() // bs[0].shape[-1]  # rows after the gather
        mms = [(2 * m * k * b.shape[-1], tuple(sorted((m, k, b.shape[-1])))) for b in bs]
        return mms, m * k * A.element_size(), _FUSED_TP[name]
    m, n = A.numel() // k, _meta(a["B"]).shape[-1]
    return [(2 * m * k * n, tuple(sorted((m, k, n))))], m * n * node.meta["val"].element_size(), _FUSED_TP[name]


def _is_view(target) -> bool:
    """An op that returns an alias of an input (no data moves): its schema says so, or it is
    one of the passes' view ops (``_unsafe_view`` declares no alias)."""
    from graph_trainer.passes.common import VIEW_OPS

    if target in VIEW_OPS:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                      for r in schema.returns)


def memory_op_bytes(node: torch.fx.Node) -> int:
    """Bytes read + written by ``node`` when it is an "other" op (not a matmul, attention,
    collective, view or graph bookkeeping), else 0: its tensor inputs' and outputs' sizes."""
    from graph_trainer.passes.common import is_collective

    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    if (node.target in _MATMUL_OPS or is_collective(node) or _is_view(node.target)
            or attention_flops(node) is not None or fused_tp_work(node) is not None):
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
    from graph_trainer.passes.common import collective_kind

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
    """Count matmul and attention FLOPs, other ops' bytes and collectives of ``gm`` (whose
    nodes carry ``meta["val"]``, as make_fx leaves them)."""
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
        elif (m := matmul_flops(n)) is not None:
            mm[m[1]] += m[0]
        elif (a := attention_flops(n)) is not None:
            attn[a[1]] += a[0]
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


def env_settings() -> tuple[DeviceConstants, int, Overlap]:
    """``(device constants, gpus_per_node, overlap)`` from the environment:
    ``PROJECTION_DEVICE`` (h100 | h200, default h100), ``GPUS_PER_NODE`` (default 8),
    ``PROJECTION_ASYNC_TP`` (1: TP collectives overlap), ``COST_CONSTANTS`` (a JSON file).

    Raises:
        UserError: a bad value, naming the variable.
    """
    dev = device_constants(os.environ.get("PROJECTION_DEVICE", "h100"))
    raw = os.environ.get("GPUS_PER_NODE", "8").strip()
    if not (raw.isascii() and raw.isdigit() and int(raw) > 0):
        raise UserError(f"GPUS_PER_NODE={raw!r} must be a positive integer.")
    async_tp = os.environ.get("PROJECTION_ASYNC_TP", "0").strip()
    if async_tp not in ("0", "1"):
        raise UserError(f"PROJECTION_ASYNC_TP={async_tp!r} must be 0 or 1.")
    return dev, int(raw), Overlap(async_tp=async_tp == "1")
