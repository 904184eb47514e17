"""The memory policy: from the traced graph and a memory budget, pick what the step keeps.

Not a pipeline pass: it reads the traced graph (and transforms copies of it) to choose
the options of three memory-policy passes that the config leaves on ``auto``:

* ``--compile.sac.save`` (``sac_recompute``): what op-level selective AC keeps from the
  forward for the backward: ``recompute`` (torchtitan's op-SAC policy: every other matmul
  and the cheap ops are recomputed), ``matmuls`` (every matmul output kept, only the
  cheap ops recomputed) or ``all`` (nothing recomputed);
* ``--compile.fsdp.keep_last_blocks`` (``reshard_after_forward``): how many of the last
  transformer blocks keep their all-gathered weights from the forward for the backward;
* ``--compile.fsdp.bucket_blocks`` (``bucket_collectives``): transformer blocks per FSDP
  all-gather / reduce-scatter bucket.

Every choice keeps the numerics (recompute and re-gather produce the same bits; buckets
move the same bytes), so the policy never changes a loss.

Rule (:func:`choose_levers`, a pure function of the estimates and the budget): the
settings form a ladder from the leanest (``recompute``, no kept block) to the fattest,
in the order of the levers' measured gain per GiB (docs/perf.md, sections on SAC, kept
blocks and buckets): matmul outputs first, then kept blocks one by one, then the rest of
the activations once every block is kept; every rung has buckets of
:data:`BUCKET_BLOCKS` blocks. The policy takes the highest rung whose predicted peak fits
the budget. When even the leanest does not fit, it also drops the buckets and says that
the budget is exceeded.

Prediction (:func:`predict_peak`): peak reserved memory per rank =
``state + scale * graph peak + overhead``, where ``state`` is the fp32 parameter shards
plus the optimizer state (AdamW: two fp32 moments; the gradients of the previous step
are freed before the step runs), ``graph peak`` the static estimate of the step's
intermediates (:func:`graph_trainer.compiler.memory_estimate.estimate_peak_memory`,
gradients included: they are graph outputs) and ``scale`` / ``overhead`` the calibration
of :data:`CALIBRATION`, fitted per Inductor mode against measured peaks (docs/perf.md,
"Fast by default").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

GiB = 2**30
#: ``--compile.sac.save`` values the policy chooses from, leanest first.
SAVE_LEVELS = ("recompute", "matmuls", "all")
#: Blocks per FSDP bucket when ``--compile.fsdp.bucket_blocks`` is ``auto``.
BUCKET_BLOCKS = 2
#: Share of a CUDA device's memory the default budget leaves free (NCCL buffers, the
#: CUDA context and cuBLAS / cuDNN workspaces live outside PyTorch's allocator).
HEADROOM = 0.10
#: Budget without a CUDA device (CPU runs), GiB.
CPU_BUDGET_GIB = 16.0
#: Device sizes the dry run plans for when no budget is given, GiB (80 GB and 141 GB parts).
DRY_RUN_DEVICES_GIB = (79.1, 139.8)


#: Lever -> the pass whose arguments it sets (the registry's name).
LEVER_PASSES = {"save": "sac_recompute", "keep_last_blocks": "reshard_after_forward", "bucket_blocks": "bucket_collectives"}


@dataclass
class SACOptions:
    """``[compile.sac]``: what op-level selective AC keeps (``sac_recompute``'s lever)."""

    save: Literal["auto", "recompute", "matmuls", "all"] = "auto"
    """What op-level selective AC keeps from the forward for the backward. recompute:
    torchtitan's policy (every other matmul and the cheap ops are recomputed); matmuls:
    every matmul output is kept, only the cheap ops are recomputed; all: nothing is
    recomputed; auto: the memory policy picks within --compile.memory_budget_gib
    (graph_trainer/compiler/memory_policy.py). Numerics unchanged in every case."""


@dataclass
class FSDPOptions:
    """``[compile.fsdp]``: the traced FSDP levers (``reshard_after_forward``, ``bucket_collectives``)."""

    bucket_blocks: int = -1
    """> 0: the bucket_collectives pass merges the FSDP all-gathers / reduce-scatters of up
    to N consecutive transformer blocks into one collective each. 0: one collective per
    parameter. -1: the memory policy picks (2 when it fits). Numerics unchanged."""

    keep_last_blocks: int = -1
    """The last K transformer blocks (in forward order) keep their all-gathered parameters
    from the forward for the backward instead of gathering them again (more memory, fewer
    all-gathers). 0: every block is resharded after the forward. -1: the memory policy
    picks as many as fit. Numerics unchanged."""


@dataclass(frozen=True)
class Calibration:
    """``measured peak reserved ~= state + scale * graph estimate + overhead_gib``."""

    scale: float
    overhead_gib: float


#: Per ``(--compile.inductor_compilation, sac.save)``; fitted against measured peaks with the
#: estimate of the GPU-traced graph (docs/perf.md, "Fast by default"). Running the graph's
#: ops one by one, the allocator's caching adds a share of the activations (scale > 1).
#: Full-graph Inductor fuses pointwise chains and recomputes cheap values inside its
#: kernels instead of keeping them, so it needs less than the graph estimate (scale < 1).
CALIBRATION: dict[tuple[str, str], Calibration] = {
    ("regional", "recompute"): Calibration(1.10, 0.0),
    ("regional", "matmuls"): Calibration(1.10, 0.0),
    ("regional", "all"): Calibration(1.10, 0.0),
    ("full", "recompute"): Calibration(0.68, 0.0),
    ("full", "matmuls"): Calibration(0.76, 0.0),
    ("full", "all"): Calibration(0.65, 0.0),
}


def calibration(inductor: str, save: str) -> Calibration:
    """The :data:`CALIBRATION` entry (``none`` uses ``regional``'s: both run the graph's
    ops one by one)."""
    return CALIBRATION[("full" if inductor == "full" else "regional", save)]


@dataclass(frozen=True)
class Levers:
    """The three pass options the policy sets (see the module docstring)."""

    save: str = "recompute"
    keep_last_blocks: int = 0
    bucket_blocks: int = 0

    def flags(self) -> str:
        """The command-line flags that pin this choice."""
        return (
            f"--compile.sac.save {self.save} --compile.fsdp.keep_last_blocks {self.keep_last_blocks} "
            f"--compile.fsdp.bucket_blocks {self.bucket_blocks}"
        )


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
        return (
            f"memory policy: sac.save={self.levers.save}, fsdp.keep_last_blocks={self.levers.keep_last_blocks}, "
            f"fsdp.bucket_blocks={self.levers.bucket_blocks}; predicted peak {self.predicted_peak_bytes / GiB:.1f} GiB "
            f"of a {self.budget_bytes / GiB:.1f} GiB budget ({'; '.join(self.reasons)})"
        )


def predict_peak(state_bytes: int, graph_peak_bytes: int, inductor: str, save: str) -> int:
    """Predicted peak reserved bytes per rank (formula in the module docstring).

    Args:
        state_bytes: fp32 parameter shards + optimizer state, bytes per rank.
        graph_peak_bytes: :func:`~graph_trainer.compiler.memory_estimate.estimate_peak_memory`.
        inductor: ``--compile.inductor_compilation`` (``regional`` / ``full`` / ``none``).
        save: the ``sac.save`` level of the graph (selects the calibration).
    """
    cal = calibration(inductor, save)
    return int(state_bytes + cal.scale * graph_peak_bytes + cal.overhead_gib * GiB)


def state_bytes(params: Iterable[torch.Tensor], optimizer_states: int = 2) -> int:
    """Bytes per rank of the fp32 parameter shards and ``optimizer_states`` fp32 tensors of
    the same size each (AdamW: ``exp_avg``, ``exp_avg_sq``). DTensors count their local shard."""
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * 4
    return total * (1 + optimizer_states)


def default_budget_bytes(device: torch.device | None) -> tuple[int, str]:
    """``(bytes, how it was found)``: a CUDA device's total memory less :data:`HEADROOM`,
    else :data:`CPU_BUDGET_GIB`."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * (1 - HEADROOM)), f"{total / GiB:.1f} GiB on {device} less {HEADROOM:.0%}"
    return int(CPU_BUDGET_GIB * GiB), f"{CPU_BUDGET_GIB:g} GiB without a CUDA device"


#: ``estimate(save) -> graph peak bytes`` with no kept block and no buckets.
Estimator = Callable[[str], int]


def choose_levers(
    estimate: Estimator,
    *,
    n_blocks: int,
    block_bytes: int,
    state: int,
    budget: int,
    inductor: str,
    fixed: Levers | None = None,
    fixed_fields: Iterable[str] = (),
    has_fsdp: bool = True,
    has_sac: bool = True,
) -> MemoryPolicy:
    """Pick the levers (rule in the module docstring); a pure function of its arguments.

    The candidates form a ladder, leanest first: ``recompute``; ``matmuls`` with 0 .. n kept
    blocks; ``all`` with n kept blocks (levers the user set stay fixed). The policy takes
    the highest rung whose predicted peak fits, searching from the top.

    Args:
        estimate: graph peak bytes of a save level with no kept block and no buckets;
            called lazily, once per save level looked at. A kept block and each block of a
            bucket add ``block_bytes``.
        n_blocks: transformer blocks.
        block_bytes: one block's gathered weights, bytes per rank.
        state: :func:`state_bytes`.
        budget: bytes per rank the predicted peak may reach.
        inductor: ``--compile.inductor_compilation`` (selects the calibration).
        fixed: values of the levers the user set; ``fixed_fields`` names which.
        has_fsdp: the graph has FSDP collectives (else keep / bucket stay 0).
        has_sac: the graph has op-SAC recompute tags (else ``save`` is irrelevant: ``all``).

    Returns:
        :class:`MemoryPolicy` (``fits`` False when even the leanest choice exceeds the budget).
    """
    fixed = fixed or Levers()
    fixed_fields = set(fixed_fields)
    bucket = fixed.bucket_blocks if "bucket_blocks" in fixed_fields else (BUCKET_BLOCKS if has_fsdp else 0)
    saves = [fixed.save] if "save" in fixed_fields else (list(SAVE_LEVELS) if has_sac else ["all"])
    if "keep_last_blocks" in fixed_fields:
        keeps = [fixed.keep_last_blocks]
    else:
        keeps = list(range(n_blocks + 1)) if has_fsdp else [0]
    cache: dict[str, int] = {}

    def graph_peak(save: str, keep: int, bucket: int) -> int:
        if save not in cache:
            cache[save] = estimate(save)
        return cache[save] + (keep + (bucket if bucket > 1 else 0)) * block_bytes

    def predicted(save: str, keep: int, bucket: int) -> int:
        return predict_peak(state, graph_peak(save, keep, bucket), inductor, save)

    ladder: list[tuple[str, int]] = []
    for i, s in enumerate(saves):
        if len(saves) == 1 or s == "matmuls":
            ladder += [(s, k) for k in keeps]
        else:
            ladder.append((s, keeps[0] if i == 0 else keeps[-1]))
    for i in range(len(ladder) - 1, -1, -1):
        peak = predicted(*ladder[i], bucket)
        if peak <= budget:
            reason = "everything fits" if i == len(ladder) - 1 else (
                "sac.save={} with {} kept blocks would not fit".format(*ladder[i + 1]))
            return MemoryPolicy(Levers(*ladder[i], bucket), budget, peak, state, True, [reason],
                                graph_peak(*ladder[i], bucket))
    reasons = []
    if "bucket_blocks" not in fixed_fields and bucket:
        bucket = 0
        reasons.append("no buckets")
    peak = predicted(*ladder[0], bucket)
    fits = peak <= budget
    reasons.append("the leanest setting " + ("fits" if fits else "exceeds the budget"))
    return MemoryPolicy(Levers(*ladder[0], bucket), budget, peak, state, fits, reasons, graph_peak(*ladder[0], bucket))
