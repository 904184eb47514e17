"""Metrics: tps, TFLOPS, MFU, memory — console (torchtitan's format), TensorBoard, JSONL.

Definitions (torchtitan's, ``torchtitan/components/metrics.py``):

* ``tps``: tokens per second per GPU = tokens this rank processed since the last log
  / (seconds since the last log * non-data-parallel size (TP degree)).
* ``tflops`` = ``flops_per_token * tps / 1e12``, where ``flops_per_token`` is
  torchtitan's ``model_args.get_nparams_and_flops(model, seq_len)``: 6·N (N =
  parameters without the embedding) + attention ``12·layers·heads·head_dim·seq_len``.
* ``mfu`` (%) = ``100 * tflops * 1e12 / peak``; ``peak`` is the device's dense bf16
  peak (:func:`peak_bf16_flops`); unknown devices and CPU report ``None`` (n/a).
* ``memory_gib``: CUDA max reserved GiB (``torch.cuda.max_memory_reserved``) and % of
  the device; CPU: peak RSS of this process (``ru_maxrss``).

``metrics.jsonl`` (rank 0): one JSON object per logged step (:class:`StepMetrics`),
then ``{"summary": {...}}`` (:meth:`MetricsLogger.summary`); :func:`read_metrics` reads
it back. torch is imported inside the functions that use it, so that the comparison
tools (:mod:`graph_trainer.tools`), which read ``metrics.jsonl``, stay torch-free.

No record is lost (rank 0; nothing changes on disk before a run logs its first step):

* a resumed run (from a checkpoint at step ``K > 0``) appends to ``metrics.jsonl``. Rows
  the earlier run logged stay, also those of steps after ``K`` that the resumed run
  measures again; readers take the last row written for each step (:func:`read_metrics`)
  and the last summary;
* a fresh run (``K == 0``) into a folder that holds ``metrics.jsonl`` or a TensorBoard
  folder first moves them aside with :func:`keep_previous` (``metrics.jsonl`` ->
  ``metrics.<N>.jsonl``, ``tb`` -> ``tb.<N>``, ``N`` one above the highest already
  used, so a larger ``N`` is always a later record) and logs where they went. A resumed
  run adds its TensorBoard event file beside the earlier ones.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("graph_trainer")

# Dense bf16 tensor-core peaks in FLOP/s (NVIDIA data sheets; the same numbers as
# torchtitan.tools.utils.get_peak_flops). Checked in order: first match wins.
_PEAK_BF16 = (
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("B200", 2.25e15),
)


def peak_bf16_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of ``device``; ``None`` for CPU and unknown GPUs."""
    if device.type != "cuda":
        return None
    import torch

    return peak_bf16_for_name(torch.cuda.get_device_name(device))


def peak_bf16_for_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU named ``name`` (e.g. ``"NVIDIA H100 80GB HBM3"``,
    ``"H200"``); ``None`` when the table does not know it."""
    for key, flops in _PEAK_BF16:
        if key in name:
            return flops
    return None


def keep_previous(path: str) -> str | None:
    """Move an existing file or folder ``path`` aside, so that a new record can be written
    there without replacing it.

    The new name is ``<stem>.<N><suffix>`` beside it: for a file, ``suffix`` is its
    extension (``metrics.jsonl`` -> ``metrics.1.jsonl``); for a folder it is empty
    (``graphs`` -> ``graphs.1``). ``N`` is one above the highest ``N`` already used there
    (1 if none), so existing names are never overwritten and a larger ``N`` is a later one.

    Returns:
        The new path, or ``None`` when nothing exists at ``path`` (then nothing is done).

    Raises:
        OSError: the folder holding ``path`` cannot be listed or the rename fails.
    """
    if not os.path.lexists(path):
        return None
    parent, name = os.path.split(os.path.normpath(path))
    stem, suffix = os.path.splitext(name) if not os.path.isdir(path) else (name, "")
    pattern = re.compile(re.escape(stem) + r"\.(\d+)" + re.escape(suffix))
    used = [int(m.group(1)) for n in os.listdir(parent or ".") if (m := pattern.fullmatch(n))]
    n = max(used, default=0) + 1
    while os.path.lexists(new := os.path.join(parent, f"{stem}.{n}{suffix}")):
        n += 1
    os.rename(path, new)
    return new


def memory_stats(device: torch.device) -> tuple[float, float | None]:
    """``(GiB, % of device or None)``: CUDA max reserved, or CPU peak RSS."""
    if device.type == "cuda":
        import torch

        reserved = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return reserved / 2**30, 100.0 * reserved / total
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None  # KiB on Linux


@dataclass
class StepMetrics:
    """One logged step. Times in seconds, memory in GiB, tps per GPU; ``None`` = n/a."""

    step: int
    loss: float
    grad_norm: float
    tps: float
    tflops: float
    mfu: float | None
    memory_gib: float
    memory_pct: float | None
    step_time_s: float
    data_time_s: float
    lr: float | None = None


class MetricsLogger:
    """Turns per-step timings into :class:`StepMetrics`; writes console, TB, JSONL.

    Args:
        device: the training device.
        flops_per_token: model FLOPs per token (see module docstring).
        non_dp_size: TP degree (ranks that see the same tokens), for ``tps``.
        dump_folder: ``metrics.jsonl`` goes here (rank 0 only).
        enable_tensorboard: also write TensorBoard scalars under ``dump_folder/tb_folder``.
        tb_folder: TensorBoard folder inside ``dump_folder``.
        rank: global rank; only rank 0 writes files.
        resume_step: the checkpoint step this run resumed from (0: a fresh run). Files are
            opened at the first write: appended to when resuming, else earlier records are
            moved aside first (see the module docstring).

    Raises (at the first write):
        UserError: an earlier record cannot be moved aside or ``metrics.jsonl`` cannot be
            opened (names the file).
    """

    def __init__(
        self,
        device: torch.device,
        flops_per_token: int,
        non_dp_size: int = 1,
        dump_folder: str = "./outputs",
        enable_tensorboard: bool = False,
        tb_folder: str = "tb",
        rank: int = 0,
        resume_step: int = 0,
    ):
        self.device = device
        self.flops_per_token = flops_per_token
        self.non_dp_size = non_dp_size
        self.peak = peak_bf16_flops(device)
        self.rank = rank
        self.rows: list[StepMetrics] = []
        self.jsonl = None
        self.tb = None
        self.dump_folder = dump_folder
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self.tb_path = os.path.join(dump_folder, tb_folder) if enable_tensorboard else None
        self.resume_step = resume_step
        self._opened = rank != 0  # only rank 0 writes files
        self._reset_window()

    def _open(self) -> None:
        """Open the record files at the first write (see the module docstring)."""
        from graph_trainer.errors import UserError

        self._opened = True
        for path in (self.jsonl_path, self.tb_path):
            if path is None or self.resume_step:
                continue
            try:
                kept = keep_previous(path)
            except OSError as e:
                raise UserError(f"Cannot move the earlier {path} aside ({e.strerror or e}); "
                                "nothing was written there.") from None
            if kept:
                logger.info(f"A fresh run: the earlier {path} is kept as {kept}")
        try:
            os.makedirs(self.dump_folder, exist_ok=True)
            self.jsonl = open(self.jsonl_path, "a")
            if self.jsonl.tell() and not _ends_with_newline(self.jsonl_path):  # an earlier run cut off mid-line
                self.jsonl.write("\n")
        except OSError as e:
            raise UserError(f"Cannot write {self.jsonl_path} ({e.strerror or e}); check --job.dump_folder.") from None
        if self.tb_path:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(self.tb_path)

    @staticmethod
    def outputs(cfg, checkpoint_folder: str | None) -> list[str]:
        """Where this run writes its records (``"metrics <path>"``, ``"TensorBoard <path>"``,
        ``"graphs <path>"``, ``"checkpoints <path>"``, ``"profiles <path>"``), for the
        start-up log line; ``checkpoint_folder`` None when checkpointing is off."""
        d = cfg.job.dump_folder
        out = [f"metrics {d}/metrics.jsonl"]
        out += [f"TensorBoard {d}/{cfg.metrics.save_tb_folder}"] * bool(cfg.metrics.enable_tensorboard)
        out += [f"graphs {d}/graphs"] * bool(cfg.compile.dump_graphs and cfg.compile.mode == "aot_fx_trace")
        out += [f"checkpoints {checkpoint_folder}"] * bool(checkpoint_folder)
        out += [f"profiles {d}/{cfg.profiling.save_traces_folder}"] * bool(cfg.profiling.enable_profiling)
        return out

    def _reset_window(self):
        self.win_tokens = 0
        self.win_start = time.perf_counter()
        self.win_data_time = 0.0
        self.win_steps = 0

    def record_step(self, ntokens: int, data_time_s: float) -> None:
        """Account one finished step: tokens this rank consumed and data-loading seconds."""
        self.win_tokens += ntokens
        self.win_data_time += data_time_s
        self.win_steps += 1

    def log(self, step: int, loss: float, grad_norm: float, lr: float | None = None) -> StepMetrics:
        """Close the current window and log it (averaged over its steps)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.win_start
        tps = self.win_tokens / (elapsed * self.non_dp_size)
        tflops = self.flops_per_token * tps / 1e12
        mfu = 100.0 * tflops * 1e12 / self.peak if self.peak else None
        mem, mem_pct = memory_stats(self.device)
        m = StepMetrics(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            tps=tps,
            tflops=tflops,
            mfu=mfu,
            memory_gib=mem,
            memory_pct=mem_pct,
            step_time_s=elapsed / max(self.win_steps, 1),
            data_time_s=self.win_data_time / max(self.win_steps, 1),
            lr=lr,
        )
        self.rows.append(m)
        self._reset_window()
        self._emit(m)
        return m

    def _emit(self, m: StepMetrics) -> None:
        mem = f"{m.memory_gib:.2f}GiB" + (f"({m.memory_pct:.2f}%)" if m.memory_pct is not None else "")
        mfu = f"{m.mfu:.2f}%" if m.mfu is not None else "n/a"
        if not self._opened:
            self._open()
        logger.info(
            f"step: {m.step:2}  loss: {m.loss:8.5f}  grad_norm: {m.grad_norm:7.4f}  "
            + (f"lr: {m.lr:.3e}  " if m.lr is not None else "")
            + f"memory: {mem}  tps: {round(m.tps):,}  tflops: {m.tflops:,.2f}  mfu: {mfu}  "
            f"step_time: {m.step_time_s:.3f}s  data: {m.data_time_s * 1e3:.1f}ms"
        )
        if self.jsonl:
            self.jsonl.write(json.dumps(asdict(m)) + "\n")
            self.jsonl.flush()
        if self.tb:
            for k in ("loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "step_time_s"):
                v = getattr(m, k)
                if v is not None:
                    self.tb.add_scalar(f"train/{k}", v, m.step)

    def summary(self, exclude_steps: int, extra: dict | None = None) -> dict:
        """Medians over logged steps with ``step > exclude_steps`` (warm-up and compile
        steps excluded); appended to metrics.jsonl as ``{"summary": {...}}``."""
        steady = [r for r in self.rows if r.step > exclude_steps] or self.rows[-1:]

        def med(key):
            vals = [getattr(r, key) for r in steady if getattr(r, key) is not None]
            return statistics.median(vals) if vals else None

        s = {
            "steady_steps": [r.step for r in steady],
            **{k: med(k) for k in ("tps", "tflops", "mfu", "memory_gib", "step_time_s", "data_time_s")},
            "max_memory_gib": max((r.memory_gib for r in self.rows), default=None),
            "final_loss": self.rows[-1].loss if self.rows else None,
            **(extra or {}),
        }
        mfu = f"{s['mfu']:.2f}%" if s["mfu"] is not None else "n/a"
        if s["tps"] is not None:
            logger.info(
                f"summary (median of steps {s['steady_steps'][0]}..{s['steady_steps'][-1]}): "
                f"tps: {round(s['tps']):,}  tflops: {s['tflops']:,.2f}  mfu: {mfu}  "
                f"memory: {s['max_memory_gib']:.2f}GiB  step_time: {s['step_time_s']:.3f}s"
            )
        if not self._opened:
            self._open()
        if self.jsonl:
            self.jsonl.write(json.dumps({"summary": s}) + "\n")
            self.jsonl.flush()
        return s

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_metrics(path: str) -> tuple[list[dict], dict | None]:
    """Read a ``metrics.jsonl``: (the per-step rows by step, the last summary or None).

    A resumed run appends to the file and may log again steps that the earlier run had
    logged after its last checkpoint: for each step the last row written is returned (the
    newer measurement), once, in step order; rows without an integer ``step`` follow, as
    written.

    Raises OSError if the file cannot be read, ValueError on a line that is not JSON."""
    by_step: dict = {}
    other, summary = [], None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            if "summary" in obj:
                summary = obj["summary"]
            elif isinstance(obj.get("step"), int):
                by_step[obj["step"]] = obj
            else:
                other.append(obj)
    return [by_step[k] for k in sorted(by_step)] + other, summary
