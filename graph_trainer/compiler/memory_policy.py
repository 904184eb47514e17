"""The memory policy: from the traced graph and a memory budget, pick the options the config leaves on ``auto``
(``--compile.sac.save``, ``--compile.fsdp.keep_last_blocks`` / ``bucket_blocks``, and the ``cudagraph`` pass where no
flag names it) by the ladder of :func:`choose_levers` (docs/design.md, "The memory policy"). None changes numerics."""

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

GiB = 2**30
#: ``--compile.sac.save`` values, leanest first (the policy takes ``all`` only under full Inductor).
SAVE_LEVELS = ("recompute", "matmuls", "all_but_cheap", "all")
#: Blocks per FSDP bucket when ``--compile.fsdp.bucket_blocks`` is ``auto``.
BUCKET_BLOCKS = 2
#: Share of a CUDA device's memory the default budget leaves free (NCCL, CUDA context, workspaces).
HEADROOM = 0.10
#: Budget without a CUDA device (CPU runs), GiB.
CPU_BUDGET_GIB = 16.0
#: Device sizes the dry run plans for when no budget is given, GiB (80 GB and 141 GB parts).
DRY_RUN_DEVICES_GIB = (79.1, 139.8)
#: Lever -> the pass whose arguments it sets (the registry's name).
LEVER_PASSES = {"save": "sac_recompute", "keep_last_blocks": "reshard_after_forward",
                "bucket_blocks": "bucket_collectives"}
#: What replaying the step as a CUDA graph adds to the peak, GiB: the warmup call's cached blocks and the graph's
#: private pool (docs/perf_archive.md, "Memory prediction").
CUDAGRAPH_GIB = 1.0


@dataclass
class SACOptions:
    """``[compile.sac]``: what op-level selective AC keeps (``sac_recompute``'s lever)."""

    save: Literal["auto", "recompute", "matmuls", "all_but_cheap", "all"] = "auto"
    """What op-level selective AC keeps from the forward for the backward. recompute: torchtitan's policy (every
    other matmul and the cheap ops recomputed); matmuls: every matmul output kept, the cheap ops recomputed;
    all_but_cheap: all kept but the pointwise ops, casts and RMSNorms computable from kept values (SwiGLU's silu and
    mul) and TP's all-gathered activations (gathered again in the backward); all: nothing recomputed;
    auto: the memory policy picks within --compile.memory_budget_gib. Numerics unchanged in every case."""


@dataclass
class FSDPOptions:
    """``[compile.fsdp]``: the traced FSDP levers (``reshard_after_forward``, ``bucket_collectives``)."""

    bucket_blocks: int = -1
    """> 0: the bucket_collectives pass merges the FSDP all-gathers / reduce-scatters of up
    to N consecutive transformer blocks into one collective each. 0: one collective per
    parameter. -1: the memory policy picks (2 when it fits). Numerics unchanged."""

    keep_last_blocks: int = -1
    """The last K transformer blocks keep their all-gathered parameters from the forward for the backward instead of
    gathering them again (more memory, fewer all-gathers). 0: every block is resharded after the forward. -1: the
    memory policy picks as many as fit. Numerics unchanged."""

    reduce_scatter_in_flight: int = 1
    """With bucketing: > 0 waits each gradient reduce-scatter bucket just before the issue of the N-th next one (or its
    first reader), so it overlaps up to N buckets of the backward. 0: at its last member's wait (overlap_collectives
    counts its bound in parameters). Later waits keep the buckets' buffers longer. Numerics unchanged."""


#: ``scale`` of ``peak reserved ~= state + scale * graph estimate`` per ``(--compile.inductor_compilation,
#: sac.save)`` (docs/perf_archive.md, "Memory prediction"): the allocator's caching, and under ``full`` Inductor's
#: own buffers and recomputation, which the fused estimate leaves out.
CALIBRATION: dict[tuple[str, str], float] = {
    ("regional", "recompute"): 1.10, ("regional", "matmuls"): 1.10, ("regional", "all_but_cheap"): 1.13,
    ("regional", "all"): 1.10,
    ("full", "recompute"): 1.46, ("full", "matmuls"): 1.42, ("full", "all_but_cheap"): 1.15, ("full", "all"): 1.15,
}
#: The scales measured with NCCL among several processes (the levels the policy picks for the 8B on H200s; the mean
#: over FSDP2, TP2 and FSDP2xTP2: docs/perf_archive.md, "The predicted peak with NCCL"): less of the allocator's slack
#: than one process whose collectives are local copies on a side stream. Other levels: CALIBRATION's.
CALIBRATION_PEERS: dict[tuple[str, str], float] = {("regional", "all_but_cheap"): 1.045, ("full", "all"): 1.06}


def calibration(inductor: str, save: str, peers: bool = False) -> float:
    """The :data:`CALIBRATION` scale (``none`` uses ``regional``'s: both run the ops one by one); ``peers``: the
    collectives run among several processes (:data:`CALIBRATION_PEERS` where measured)."""
    key = ("full" if inductor == "full" else "regional", save)
    return CALIBRATION_PEERS.get(key, CALIBRATION[key]) if peers else CALIBRATION[key]


@dataclass(frozen=True)
class Levers:
    """The three pass options the policy sets (module docstring)."""

    save: str = "recompute"
    keep_last_blocks: int = 0
    bucket_blocks: int = 0
    cudagraph: bool = False
    """The ``cudagraph`` pass runs (the policy's choice only where nobody named the pass)."""

    def flags(self) -> str:
        """The command-line flags that pin this choice."""
        return (f"--compile.sac.save {self.save} --compile.fsdp.keep_last_blocks {self.keep_last_blocks} "
                f"--compile.fsdp.bucket_blocks {self.bucket_blocks}"
                + (" --compile.passes cudagraph" if self.cudagraph else ""))


@dataclass
class MemoryPolicy:
    """A choice of :class:`Levers` with its prediction (bytes per rank) and reasons."""

    levers: Levers
    budget_bytes: int
    predicted_peak_bytes: int
    state_bytes: int
    fits: bool
    reasons: list[str] = field(default_factory=list)
    graph_peak_bytes: int = 0
    """The uncalibrated graph estimate of the choice (kept blocks and buckets included)."""

    def describe(self) -> str:
        """One line: the choice, the predicted peak against the budget, and why."""
        graph = ", cudagraph" if self.levers.cudagraph else ""
        return (f"memory policy: sac.save={self.levers.save}, fsdp.keep_last_blocks={self.levers.keep_last_blocks}, "
                f"fsdp.bucket_blocks={self.levers.bucket_blocks}{graph}; predicted peak "
                f"{self.predicted_peak_bytes / GiB:.1f} GiB of a {self.budget_bytes / GiB:.1f} GiB budget "
                f"({'; '.join(self.reasons)})")


def predict_peak(state_bytes: int, graph_peak_bytes: int, inductor: str, save: str, cudagraph: bool = False,
                 peers: bool = False) -> int:
    """Predicted peak reserved bytes per rank: ``state_bytes`` (:func:`state_bytes`) + :func:`calibration` x
    ``graph_peak_bytes`` (+ :data:`CUDAGRAPH_GIB` with ``cudagraph``)."""
    return int(state_bytes + calibration(inductor, save, peers) * graph_peak_bytes + cudagraph * CUDAGRAPH_GIB * GiB)


def state_bytes(params: Iterable[torch.Tensor], optimizer_states: int = 2) -> int:
    """Bytes per rank of the fp32 parameter shards (DTensor: local) and ``optimizer_states`` tensors of that size."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in params) * (1 + optimizer_states)


def default_budget_bytes(device: torch.device | None) -> tuple[int, str]:
    """``(bytes, how it was found)``: a CUDA device's memory less :data:`HEADROOM`, else :data:`CPU_BUDGET_GIB`."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * (1 - HEADROOM)), f"{total / GiB:.1f} GiB on {device} less {HEADROOM:.0%}"
    return int(CPU_BUDGET_GIB * GiB), f"{CPU_BUDGET_GIB:g} GiB without a CUDA device"


def choose_levers(estimate: Callable[[str], int], *, n_blocks: int, block_bytes: int, state: int, budget: int,
                  inductor: str, fixed: Levers | None = None, fixed_fields: Iterable[str] = (), has_fsdp: bool = True,
                  has_sac: bool = True, cudagraph: bool = False, peers: bool = False) -> MemoryPolicy:
    """Pick the levers, a pure function of its arguments: the highest rung of the ladder recompute -> matmuls with
    0 .. n kept blocks -> all_but_cheap likewise (-> all, full Inductor only), each with buckets of
    :data:`BUCKET_BLOCKS`, whose :func:`predict_peak` fits; none fitting, the buckets go too; CUDA graphs first, gone
    only when even the leanest rung would not fit with them. Levers named in ``fixed_fields`` keep ``fixed``'s value.
    ``estimate(save)``: graph peak bytes with no kept block and no buckets (called once per level); a kept block and
    each block of a bucket add ``block_bytes``. ``state``: :func:`state_bytes`; ``budget``: bytes per rank;
    ``inductor`` selects the calibration. Without FSDP keep / bucket stay 0; without SAC tags ``save`` is ``all``.
    ``cudagraph``: the step may replay as a CUDA graph; ``peers``: real collectives among several processes.
    Returns a :class:`MemoryPolicy` (``fits`` False when even the leanest choice exceeds the budget)."""
    fixed = fixed or Levers()
    fixed_fields = set(fixed_fields)
    bucket = fixed.bucket_blocks if "bucket_blocks" in fixed_fields else (BUCKET_BLOCKS if has_fsdp else 0)
    levels = [s for s in SAVE_LEVELS if s != "all" or inductor == "full"]
    saves = [fixed.save] if "save" in fixed_fields else (levels if has_sac else ["all"])
    keeps = [fixed.keep_last_blocks] if "keep_last_blocks" in fixed_fields else (
        list(range(n_blocks + 1)) if has_fsdp else [0])
    graphs = [fixed.cudagraph] if "cudagraph" in fixed_fields else ([True, False] if cudagraph else [False])
    estimate = functools.cache(estimate)  # once per level

    def graph_peak(save: str, keep: int, bucket: int) -> int:
        return estimate(save) + (keep + (bucket if bucket > 1 else 0)) * block_bytes

    def policy(save: str, keep: int, bucket: int, cg: bool, reasons: list[str]) -> MemoryPolicy:
        peak = predict_peak(state, graph_peak(save, keep, bucket), inductor, save, cg, peers)
        if cg and "cudagraph" not in fixed_fields:
            reasons = [f"CUDA graphs fit (+{CUDAGRAPH_GIB:g} GiB)", *reasons]
        elif cudagraph and "cudagraph" not in fixed_fields:
            reasons = ["no CUDA graphs: even the leanest setting with them exceeds the budget", *reasons]
        return MemoryPolicy(Levers(save, keep, bucket, cg), budget, peak, state, peak <= budget, reasons,
                            graph_peak(save, keep, bucket))

    ladder: list[tuple[str, int]] = []
    for i, s in enumerate(saves):
        if len(saves) == 1 or s in ("matmuls", "all_but_cheap"):
            ladder += [(s, k) for k in keeps]
        else:
            ladder.append((s, keeps[0] if i == 0 else keeps[-1]))
    for cg in graphs:
        for i in range(len(ladder) - 1, -1, -1):
            reason = "everything fits" if i == len(ladder) - 1 else (
                "sac.save={} with {} kept blocks would not fit".format(*ladder[i + 1]))
            chosen = policy(*ladder[i], bucket, cg, [reason])
            if chosen.fits:
                return chosen
    reasons = []
    if "bucket_blocks" not in fixed_fields and bucket:
        bucket = 0
        reasons.append("no buckets")
    chosen = policy(*ladder[0], bucket, graphs[-1], reasons)
    chosen.reasons.append("the leanest setting " + ("fits" if chosen.fits else "exceeds the budget"))
    return chosen
