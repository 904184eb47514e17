"""Scale projection: step time, tps/GPU and MFU of one rank's traced step on a layout of GPUs.

``step = compute + exposed communication``, per rank per step; the formula, its sources (FLOPs:
``torch.utils.flop_counter``'s formulas with FlashAttention-2's causal halving and 2.5x backward; ``beta``: nccl-tests'
busbw; MFU as ``graph_trainer.metrics`` reports it) and what it leaves out: docs/design.md, "Scale projection: the
cost model"."""

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import flop_registry

from graph_trainer.compiler.collectives import collective_kind, is_collective
from graph_trainer.compiler.graph_values import fused_bytes, val_bytes
from graph_trainer.compiler.node_meta import inductor_tag
from graph_trainer.compiler.ops import VIEW_OPS, aten, packet_name, returns_view
from graph_trainer.errors import UserError
from graph_trainer.projection.devices import (  # noqa: F401  (re-exported: the projection's API)
    DeviceConstants, Link, device_constants)

#: Mesh dimension names, in torchtitan's mesh order (outermost first).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
#: Flattened groups: the data-parallel ranks, one replica (the gradient norm under HSDP), every rank.
FLAT_DIMS = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_tp": ("dp_shard", "tp"), "world": MESH_DIMS}
#: HBM bytes per fp32 parameter after the graph: fused AdamW (7 x 4 B) + grad-norm clipping (3 x 4 B).
OPTIMIZER_BYTES_PER_PARAM = 40
#: Extra bytes per fp32 gradient of replicated DP's flat all-reduce: ``cat`` and copy back (2 x 8 B).
FLAT_ALL_REDUCE_BYTES_PER_PARAM = 16
#: NCCL ring traffic per byte of collective size S (nccl-tests doc/PERFORMANCE.md, busbw).
_RING_FACTOR = {**dict.fromkeys(("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                                 "reduce_scatter_tensor_coalesced", "all_to_all_single"), lambda n: (n - 1) / n),
                **dict.fromkeys(("all_reduce", "all_reduce_coalesced"), lambda n: 2 * (n - 1) / n),
                "broadcast": lambda n: 1.0}

#: The dry run's CPU flash op (:func:`graph_trainer.projection.dry_run.fused_attention_on_meta`) has
#: no formula in torch's registry: counted by the GPU flash op's.
_FLOP_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}
#: Matmuls keyed by sorted ``(M, N, K)`` (``(B, ...)`` batched), the keys of the measured rates.
_MM_KEYED = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
#: Async TP's micro-pipelined ops (graph_trainer/compiler/passes/async_tp.py) -> the collective inside.
_FUSED_TP = {"fused_all_gather_matmul": "all_gather_into_tensor",
             "fused_matmul_reduce_scatter": "reduce_scatter_tensor"}


@dataclass(frozen=True)
class Layout:
    """Degrees of the mesh ``(dp_replicate, dp_shard, tp)`` and the node size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    gpus_per_node: int = 8

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of rank 0's group of mesh (or flattened) dimension ``dim``; KeyError for any other ``dim``."""
        dims = FLAT_DIMS.get(dim, (dim,))
        if any(d not in MESH_DIMS for d in dims):
            raise KeyError(dim)
        stride = {"tp": 1, "dp_shard": self.tp, "dp_replicate": self.tp * self.dp_shard}
        ranks = [0]
        for d in dims:
            ranks = [r + i * stride[d] for r in ranks for i in range(getattr(self, d))]
        return sorted(ranks)


def link_for(ranks: Iterable[int], gpus_per_node: int, dev: DeviceConstants) -> tuple[str, Link]:
    """``("nvlink" | "network", Link)`` of a group of global ``ranks``: NVLink inside one node,
    else the network at ``min(k · β_nic, β_nvlink)`` for ``k`` GPUs of the group per node."""
    ranks = list(ranks)
    nodes = {r // gpus_per_node for r in ranks}
    if len(nodes) <= 1:
        return "nvlink", dev.nvlink
    k = max(1, len(ranks) // len(nodes))
    return "network", Link(dev.nic.alpha_s, min(k * dev.nic.busbw_Bps, dev.nvlink.busbw_Bps))


def ring_bytes_on_wire(kind: str, size_bytes: float, n: int) -> float:
    """Bytes each rank sends for one ring collective of size S on ``n`` ranks (0 for one rank): ``(n−1)/n · S``
    (all_gather: S = output, reduce_scatter: S = input), ``2(n−1)/n · S`` (all_reduce). Raises ValueError: unknown
    ``kind``."""
    if kind not in _RING_FACTOR:
        raise ValueError(f"no ring formula for collective {kind!r}")
    return 0.0 if n <= 1 else _RING_FACTOR[kind](n) * size_bytes


def collective_time(kind: str, size_bytes: float, n: int, link: Link) -> float:
    """Seconds of one collective: ``α + bytes_on_wire / busbw`` (0 for one rank)."""
    if n <= 1:
        return 0.0
    alpha, beta = link.constants(kind)
    return alpha + ring_bytes_on_wire(kind, size_bytes, n) / beta


def _args(node: torch.fx.Node) -> dict:
    names = [a.name for a in getattr(getattr(node.target, "_schema", None), "arguments", ())]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _meta(arg):
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def node_flops(node: torch.fx.Node) -> tuple[str, float, tuple] | None:
    """``(term, FLOPs, shape key)`` of a node whose op has a formula in ``torch.utils.flop_counter.flop_registry``,
    evaluated on the arguments' ``meta["val"]``; else None. ``term``: ``"attention"`` (SDPA ops, halved when
    ``is_causal``: torch counts the whole score matrix) or ``"matmul"``. Key: sorted ``(M, N, K)`` for mm / addmm,
    ``(B, *sorted(M, N, K))`` batched, ``(B, H, S_q, D)`` for attention, ``(op name, input shapes...)`` otherwise."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    packet = node.target.overloadpacket
    if (formula := flop_registry.get(_FLOP_ALIASES.get(packet, packet))) is None:
        return None
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _meta)
    out, attention = node.meta.get("val"), "attention" in packet.__name__
    a = _args(node) if attention else None
    if attention and isinstance(q := _meta(a["query"]), torch.Tensor):
        # GQA: key / value (and grads) with fewer heads cost as the query's heads; torch's formulas assume equal heads
        def heads(t):
            if (isinstance(t, torch.Tensor) and t.dim() == q.dim() == 4 and 0 < t.shape[-3] < q.shape[-3]
                    and q.shape[-3] % t.shape[-3] == 0):
                return t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3)
            return t

        args = tuple(heads(t) for t in args)
    flops = formula(*args, out_val=out, **kwargs)
    if attention:
        return "attention", flops * (0.5 if a.get("is_causal") else 1.0), tuple(_meta(a["query"]).shape)
    if packet in _MM_KEYED and isinstance(out, torch.Tensor) and out.numel():
        *b, m, n = out.shape
        return "matmul", flops, (*b, *sorted((m, n, flops // (2 * math.prod(out.shape)))))
    return "matmul", flops, (packet.__name__, *[tuple(v.shape) for v in args if isinstance(v, torch.Tensor)])


def _mm(m: int, k: int, n: int) -> tuple[int, tuple]:
    return flop_registry[aten.mm]((m, k), (k, n)), tuple(sorted((m, k, n)))


def fused_tp_work(node: torch.fx.Node) -> tuple[list[tuple[int, tuple]], int, str] | None:
    """``([(FLOPs, shape key) per matmul], S bytes, collective kind)`` of an async-TP
    ``symm_mem.fused_all_gather_matmul`` (S = the gathered A) or ``fused_matmul_reduce_scatter`` (S = the ``[M, N]``
    product), else None. ``torch.utils.flop_counter`` has no formula for the ``symm_mem`` ops: ``aten.mm``'s is used."""
    if (name := packet_name(node)) not in _FUSED_TP:
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


def memory_op_bytes(node: torch.fx.Node) -> int:
    """Bytes read + written by an "other" op (not a matmul, attention, collective or view, by its schema or the
    passes' ``VIEW_OPS``): its tensor inputs' and outputs' sizes; else 0."""
    if (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or node.target in VIEW_OPS
            or returns_view(node.target) or is_collective(node) or node_flops(node) is not None
            or fused_tp_work(node) is not None):
        return 0
    return sum(val_bytes(_meta(a)) for a in node.all_input_nodes) + val_bytes(node.meta.get("val"))


@dataclass
class CollectiveOp:
    """One collective: ``kind``, mesh ``dim``, size S in bytes, graph position ``index`` (-1:
    after the graph), ``fused``: inside an async-TP op (overlapped)."""

    kind: str
    dim: str
    size_bytes: int
    index: int = -1
    fused: bool = False


@dataclass
class GraphWork:
    """What one rank's step does: ``matmuls`` ``{shape key: FLOPs}``, ``attention``
    ``{(B, H, S, D): FLOPs}``, ``memory_bytes`` of the other ops, ``collectives`` in graph order."""

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
    """Matmul and attention FLOPs, other ops' bytes (a regional Inductor region's as one kernel's: ``fused_bytes``)
    and the collectives of ``gm`` (nodes with ``meta["val"]``); each collective is attributed to a mesh dim by its
    ``group_name`` (``group_dims``; unknown: ``"?"``), size = the larger of its input and output bytes."""
    group_dims = group_dims or {}
    mm, attn, mem, colls, regions = defaultdict(float), defaultdict(float), 0, [], defaultdict(list)
    for i, n in enumerate(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if (f := fused_tp_work(n)) is not None:
            for flops, key in f[0]:
                mm[key] += flops
            colls.append(CollectiveOp(f[2], group_dims.get(str(_args(n)["group_name"]), "?"), f[1], i, True))
        elif (kind := collective_kind(n)) is not None:
            a = _args(n)
            ins = a.get("input", a.get("inputs", a.get("tensor")))
            size = max(val_bytes([_meta(x) for x in ins] if isinstance(ins, (list, tuple)) else _meta(ins)),
                       val_bytes(n.meta.get("val")))
            colls.append(CollectiveOp(kind, group_dims.get(str(a.get("group_name")), "?"), size, i))
        elif (f := node_flops(n)) is not None:
            (attn if f[0] == "attention" else mm)[f[2]] += f[1]
        elif isinstance(tag := inductor_tag(n), dict):
            regions[tag.get("inductor_region")].append(n)
        else:
            mem += memory_op_bytes(n)
    return GraphWork(dict(mm), dict(attn), mem + sum(map(fused_bytes, regions.values())), colls)


@dataclass(frozen=True)
class Overlap:
    """Collectives of the mesh dims ``overlapped`` hide under compute (but the first all-gather
    and the last reduction of each dim); ``async_tp`` adds TP's."""

    overlapped: frozenset = frozenset({"dp_shard", "dp_replicate"})
    async_tp: bool = False

    def dims(self) -> frozenset:
        return self.overlapped | ({"tp"} if self.async_tp else set())


@dataclass
class Projection:
    """Projected per-rank step, in seconds; ``comm`` rows: ``kind``, ``dim``, ``async_tp``, ``link``,
    ``ranks``, ``ops``, ``bytes``, ``time_s`` (all ops) and ``exposed_s``."""

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
    work: GraphWork

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
        """Matmul + attention FLOPs of the graph per model token (a rank computes 1/tp of each)."""
        return (self.work.matmul_flops + self.work.attention_flops) * self.layout.tp / self.tokens_per_rank

    def to_dict(self) -> dict:
        ms, w = 1e3, self.work
        terms = (("matmul", self.matmul_s), ("attention", self.attention_s), ("memory", self.memory_s),
                 ("optimizer", self.optimizer_s))
        return {
            "device": self.device, "constants": self.source, "gpus_per_node": self.layout.gpus_per_node,
            "compute_ms": round(self.compute_s * ms, 2), "compute_ms_by_term": {k: round(v * ms, 2) for k, v in terms},
            "comm": [{**{k: v for k, v in c.items() if not k.endswith("_s")},
                      "time_ms": round(c["time_s"] * ms, 3), "exposed_ms": round(c["exposed_s"] * ms, 3)}
                     for c in self.comm],
            "exposed_comm_ms": round(self.exposed_comm_s * ms, 2), "step_ms": round(self.step_s * ms, 2),
            "tps_per_gpu": round(self.tps_per_gpu, 1), "mfu_pct": round(self.mfu, 2),
            "matmul_tflop": round(w.matmul_flops / 1e12, 3), "attention_tflop": round(w.attention_flops / 1e12, 3),
            "memory_gb": round(w.memory_bytes / 1e9, 3), "graph_flops_per_token": self.graph_flops_per_token(),
            "flops_per_token": self.flops_per_token,
        }

    def lines(self) -> list[str]:
        """The projection as log lines (ms, GiB)."""
        ms, gib, w = 1e3, 2**30, self.work
        return [
            f"projection on {self.device.upper()} ({self.source}; nodes of {self.layout.gpus_per_node} GPUs), "
            "per rank per step:",
            f"  compute {self.compute_s * ms:.1f} ms = matmul {self.matmul_s * ms:.1f} "
            f"({w.matmul_flops / 1e12:.1f} TFLOP) + attention {self.attention_s * ms:.1f} "
            f"({w.attention_flops / 1e12:.1f} TFLOP) + memory-bound {self.memory_s * ms:.1f} "
            f"({w.memory_bytes / 1e9:.0f} GB) + optimizer {self.optimizer_s * ms:.1f}",
            *(f"  {c['kind']}{' in async-TP matmuls' if c['async_tp'] else ''} over {c['dim']} ({c['ranks']} ranks, "
              f"{c['link']}): {c['ops']} ops, {c['bytes'] / gib:.3f} GiB, {c['time_s'] * ms:.1f} ms, exposed "
              f"{c['exposed_s'] * ms:.1f} ms" for c in self.comm),
            f"  step {self.step_s * ms:.1f} ms (exposed communication {self.exposed_comm_s * ms:.1f} ms) -> "
            f"{self.tps_per_gpu:,.0f} tps/GPU, MFU {self.mfu:.1f} %",
            f"  graph FLOPs per token (matmul + causal attention, recompute included) "
            f"{self.graph_flops_per_token() / 1e9:.2f} GFLOP vs torchtitan's flops_per_token "
            f"{self.flops_per_token / 1e9:.2f} GFLOP (6N + non-causal attention, its backward 2x the "
            f"forward where FlashAttention-2 counts 2.5x)",
        ]


def project(work: GraphWork, layout: Layout, dev: DeviceConstants, *, tokens_per_rank: int,
            flops_per_token: float, after_graph_bytes: int = 0,
            extra_collectives: Iterable[CollectiveOp] = (), overlap: Overlap = Overlap()) -> Projection:
    """Project one rank's step of ``work`` (:func:`graph_work`) on ``layout`` of ``dev`` GPUs.

    ``tokens_per_rank``: ``local_batch_size · seq_len``; ``flops_per_token``: torchtitan's model FLOPs (the MFU
    numerator); ``after_graph_bytes``: HBM bytes after the graph (:func:`after_graph_bytes`); ``extra_collectives``:
    collectives after the graph (exposed). Raises UserError: a collective of a group that is no mesh dimension of
    ``layout`` (``"?"``)."""
    matmul_s = sum(f / dev.matmul_by_shape.get(k, dev.matmul_flops) for k, f in work.matmuls.items())
    attention_s = sum(f / dev.attention_by_shape.get(k, dev.attention_flops) for k, f in work.attention.items())
    memory_s, optimizer_s = work.memory_bytes / dev.hbm_Bps, after_graph_bytes / dev.hbm_Bps
    compute_s = matmul_s + attention_s + memory_s + optimizer_s

    rows, links = {}, {}  # (kind, dim, fused) -> comm row; dim -> (link name, Link, ranks)
    dims, hidden, timed = overlap.dims(), [], []
    for c in [*work.collectives, *extra_collectives]:
        if c.dim not in links:
            try:
                ranks = layout.group_ranks(c.dim)
            except KeyError:
                raise UserError(f"A {c.kind} of the traced graph runs over a process group that is no mesh "
                                f"dimension of {layout}; the projection cannot place it.") from None
            links[c.dim] = (*link_for(ranks, layout.gpus_per_node, dev), len(ranks))
        name, link, n = links[c.dim]
        t = collective_time(c.kind, c.size_bytes, n, link)
        (hidden if (c.dim in dims or c.fused) and c.index >= 0 else timed).append((c, t))
        row = rows.setdefault((c.kind, c.dim, c.fused), {
            "kind": c.kind, "dim": c.dim, "async_tp": c.fused, "link": name, "ranks": n, "ops": 0, "bytes": 0,
            "time_s": 0.0, "exposed_s": 0.0})
        row["ops"] += 1
        row["bytes"] += c.size_bytes
        row["time_s"] += t

    gathers = [x for x in hidden if x[0].kind.startswith("all_gather") and not x[0].fused]
    edges = [min(gathers, key=lambda x: x[0].index)] if gathers else []
    for dim in sorted(dims):  # the last reduction of each dim: FSDP's reduce-scatter, HSDP's all-reduce
        if reductions := [x for x in hidden if x[0].dim == dim and not x[0].kind.startswith("all_gather")]:
            edges.append(max(reductions, key=lambda x: x[0].index))
    for c, t in timed + edges:  # exposed
        rows[(c.kind, c.dim, c.fused)]["exposed_s"] += t
    rest = [(c, t) for c, t in hidden if all(c is not e for e, _ in edges)]
    total_rest = sum(t for _, t in rest)
    excess = max(0.0, total_rest - compute_s)
    for c, t in rest:  # the part compute cannot hide, shared in proportion to time
        rows[(c.kind, c.dim, c.fused)]["exposed_s"] += excess * t / total_rest

    return Projection(
        device=dev.name, source=dev.source, layout=layout, matmul_s=matmul_s, attention_s=attention_s,
        memory_s=memory_s, optimizer_s=optimizer_s, comm=sorted(rows.values(), key=lambda r: (r["dim"], r["kind"])),
        tokens_per_rank=tokens_per_rank, flops_per_token=flops_per_token, peak_flops=dev.peak_bf16_flops, work=work)


def after_graph_bytes(params: int, flat_all_reduce: bool = False) -> int:
    """HBM bytes after the graph for this rank's ``params`` fp32 elements: optimizer (+ replicated DP's all-reduce)."""
    return params * (OPTIMIZER_BYTES_PER_PARAM + FLAT_ALL_REDUCE_BYTES_PER_PARAM * flat_all_reduce)


def settings(opts) -> tuple[DeviceConstants, int, Overlap]:
    """``(device constants, gpus_per_node, overlap)`` of the ``[projection]`` flags ``opts``
    (``graph_trainer.config.Projection``). Raises UserError: a bad value, naming its flag."""
    if isinstance(gpn := opts.gpus_per_node, bool) or not isinstance(gpn, int) or gpn < 1:
        raise UserError(f"--projection.gpus_per_node must be a positive integer, got {gpn!r}.")
    if not isinstance(opts.async_tp, bool):
        raise UserError(f"--projection.async_tp must be true or false, got {opts.async_tp!r}.")
    if not isinstance(opts.cost_constants, str):
        raise UserError(f"--projection.cost_constants must be a file name, got {opts.cost_constants!r}.")
    return device_constants(opts.device, opts.cost_constants), gpn, Overlap(async_tp=opts.async_tp)
