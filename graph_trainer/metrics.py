"""Metrics: tps, TFLOPS, MFU, memory -- console (torchtitan's format), TensorBoard, ``metrics.jsonl``.

Definitions (torchtitan's): ``tps`` = tokens this rank processed since the last log / (seconds since the last log * TP
degree; on CUDA the seconds between two events on the device's stream, each behind a logged step's work); ``tflops`` =
``flops_per_token * tps / 1e12`` (torchtitan's ``get_nparams_and_flops``: 6·N without the embedding + attention);
``mfu`` (%) = ``100 * tflops * 1e12 / peak`` (dense bf16 peak, :func:`peak_bf16_flops`; ``None`` on CPU and unknown
GPUs); ``memory_gib``: CUDA max reserved (and % of the device), on CPU the peak RSS.

``metrics.jsonl`` (rank 0): one :class:`StepMetrics` per logged step, then ``{"summary": {...}}``; a resumed run
appends, a fresh one first moves earlier records aside (:func:`keep_previous`). torch is imported lazily: the comparison
tools read ``metrics.jsonl`` without it."""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from graph_trainer import logger
from graph_trainer.errors import UserError

if TYPE_CHECKING:
    import torch

# Dense bf16 peaks in FLOP/s (NVIDIA data sheets), first match wins. Own table: torchtitan's
# get_peak_flops reads lspci and assumes an A100 for unknown GPUs.
_PEAK_BF16 = (("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H20", 148e12),
              ("A100", 312e12), ("B200", 2.25e15))


def peak_bf16_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of ``device``; ``None`` for CPU and unknown GPUs."""
    import torch

    return peak_bf16_for_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_bf16_for_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU named ``name`` (e.g. ``"NVIDIA H100 80GB HBM3"``); None if unknown."""
    return next((flops for key, flops in _PEAK_BF16 if key in name), None)


def keep_previous(path: str) -> str | None:
    """Move an existing file or folder ``path`` aside to ``<stem>.<N><suffix>`` (``metrics.jsonl`` ->
    ``metrics.1.jsonl``, ``graphs`` -> ``graphs.1``), ``N`` one above the highest used. Returns the new path, or None
    when nothing exists at ``path``. Raises OSError (listing, rename)."""
    if not os.path.lexists(path):
        return None
    parent, name = os.path.split(os.path.normpath(path))
    stem, suffix = os.path.splitext(name) if not os.path.isdir(path) else (name, "")
    pattern = re.compile(re.escape(stem) + r"\.(\d+)" + re.escape(suffix))
    n = max((int(m.group(1)) for x in os.listdir(parent or ".") if (m := pattern.fullmatch(x))), default=0) + 1
    while os.path.lexists(new := os.path.join(parent, f"{stem}.{n}{suffix}")):
        n += 1
    os.rename(path, new)
    return new


def memory_stats(device: torch.device) -> tuple[float, float | None]:
    """``(GiB, % of device or None)``: CUDA max reserved, or CPU peak RSS."""
    if device.type == "cuda":
        import torch

        reserved = torch.cuda.max_memory_reserved(device)
        return reserved / 2**30, 100.0 * reserved / torch.cuda.get_device_properties(device).total_memory
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


@dataclass
class WindowEnd:
    """A metrics window closed at ``step`` (:meth:`MetricsLogger.close_window`) whose values the device may still be
    computing: ``values`` the host tensor ``[loss, grad_norm]`` (float64) that a copy behind the step fills; ``start`` /
    ``end`` timestamps (CUDA events, or ``perf_counter`` seconds); tokens, data seconds and steps of the window."""

    step: int
    values: torch.Tensor
    lr: float | None
    tokens: int
    data_time: float
    steps: int
    start: object
    end: object

    def read(self) -> tuple[float, float]:
        """``(loss, grad_norm)``, waiting until the device has reached the window's end (not beyond)."""
        if not isinstance(self.end, float):
            self.end.synchronize()
        return tuple(self.values.tolist())


class MetricsLogger:
    """Turns per-step timings into :class:`StepMetrics`; writes console, TensorBoard, JSONL (rank 0).
    ``non_dp_size``: TP degree; ``resume_step``: the step resumed from (0: fresh). Files open at the
    first write (UserError naming a file that cannot be moved aside or opened)."""

    def __init__(self, device: torch.device, flops_per_token: int, non_dp_size: int = 1, dump_folder: str = "./outputs",
                 enable_tensorboard: bool = False, tb_folder: str = "tb", rank: int = 0, resume_step: int = 0):
        self.device, self.flops_per_token, self.non_dp_size = device, flops_per_token, non_dp_size
        self.peak = peak_bf16_flops(device)
        self.rows: list[StepMetrics] = []
        self.jsonl = self.tb = None
        self.dump_folder, self.resume_step = dump_folder, resume_step
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self.tb_path = os.path.join(dump_folder, tb_folder) if enable_tensorboard else None
        self._opened = rank != 0  # only rank 0 writes files
        self._reset_window()

    def _open(self) -> None:
        self._opened = True
        for path in (self.jsonl_path, self.tb_path) if not self.resume_step else ():
            try:
                kept = path and keep_previous(path)
            except OSError as e:
                raise UserError(f"Cannot move the earlier {path} aside ({e.strerror or e}); "
                                "nothing was written there.") from None
            if kept:
                logger.info(f"A fresh run: the earlier {path} is kept as {kept}")
        try:
            os.makedirs(self.dump_folder, exist_ok=True)
            self.jsonl = open(self.jsonl_path, "a")
            if self.jsonl.tell():
                with open(self.jsonl_path, "rb") as f:  # an earlier run cut off mid-line: end that line
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        self.jsonl.write("\n")
        except OSError as e:
            raise UserError(f"Cannot write {self.jsonl_path} ({e.strerror or e}); check --job.dump_folder.") from None
        if self.tb_path:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(self.tb_path)

    def _write(self, obj: dict) -> None:
        if not self._opened:
            self._open()
        if self.jsonl:
            self.jsonl.write(json.dumps(obj) + "\n")
            self.jsonl.flush()

    @staticmethod
    def outputs(cfg, checkpoint_folder: str | None) -> list[str]:
        """Where this run writes its records (``"metrics <path>"``, ...), for the start-up log line."""
        d = cfg.job.dump_folder
        return ([f"metrics {d}/metrics.jsonl"]
                + [f"TensorBoard {d}/{cfg.metrics.save_tb_folder}"] * bool(cfg.metrics.enable_tensorboard)
                + [f"graphs {d}/graphs"] * bool(cfg.compile.dump_graphs and cfg.compile.mode == "aot_fx_trace")
                + [f"checkpoints {checkpoint_folder}"] * bool(checkpoint_folder)
                + [f"profiles {d}/{cfg.profiling.save_traces_folder}"] * bool(cfg.profiling.enable_profiling))

    def _now(self):
        """A timestamp: on CUDA a timing event recorded on the current stream (the time the device reaches it), on
        CPU ``time.perf_counter()`` seconds."""
        if self.device.type != "cuda":
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _reset_window(self, start=None):
        self.win_tokens, self.win_data_time, self.win_steps = 0, 0.0, 0
        self.win_start = self._now() if start is None else start

    def record_step(self, ntokens: int, data_time_s: float) -> None:
        """Account one finished step: tokens this rank consumed and data-loading seconds."""
        self.win_tokens += ntokens
        self.win_data_time += data_time_s
        self.win_steps += 1

    def close_window(self, step: int, loss, grad_norm, lr: float | None = None) -> WindowEnd:
        """End the current window at ``step`` without waiting for the device: ``loss`` and ``grad_norm`` (0-d
        tensors on the device, or floats) are copied to the host behind the step's work, the window's end is a
        timestamp behind them, and the next window starts there. :meth:`log_window` reads and logs it; until then
        the host can issue the next step, so the device does not go idle at a logged step's end."""
        import torch

        values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(())
                              for v in (loss, grad_norm)])
        host = torch.empty(2, dtype=torch.float64, pin_memory=self.device.type == "cuda")
        host.copy_(values, non_blocking=True)
        end = WindowEnd(step, host, lr, self.win_tokens, self.win_data_time, self.win_steps, self.win_start,
                        self._now())
        self._reset_window(start=end.end)
        return end

    def log_window(self, window: WindowEnd) -> StepMetrics:
        """Log a closed window (averaged over its steps), waiting for the device up to its end only."""
        loss, grad_norm = window.read()
        elapsed = (window.end - window.start if isinstance(window.end, float)
                   else window.start.elapsed_time(window.end) / 1e3)  # ms between the two events on the device
        tps = window.tokens / (elapsed * self.non_dp_size)
        tflops = self.flops_per_token * tps / 1e12
        steps = max(window.steps, 1)
        m = StepMetrics(window.step, loss, grad_norm, tps, tflops,
                        100.0 * tflops * 1e12 / self.peak if self.peak else None, *memory_stats(self.device),
                        elapsed / steps, window.data_time / steps, window.lr)
        self.rows.append(m)
        mem = f"{m.memory_gib:.2f}GiB" + (f"({m.memory_pct:.2f}%)" if m.memory_pct is not None else "")
        mfu = f"{m.mfu:.2f}%" if m.mfu is not None else "n/a"
        self._write(asdict(m))  # opens the files first: what that logs comes before this step's line
        lr_text = f"lr: {m.lr:.3e}  " if m.lr is not None else ""
        logger.info(f"step: {m.step:2}  loss: {m.loss:8.5f}  grad_norm: {m.grad_norm:7.4f}  {lr_text}memory: {mem}  "
                    f"tps: {round(m.tps):,}  tflops: {m.tflops:,.2f}  mfu: {mfu}  step_time: {m.step_time_s:.3f}s  "
                    f"data: {m.data_time_s * 1e3:.1f}ms")
        for k in ("loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "step_time_s") if self.tb else ():
            if getattr(m, k) is not None:
                self.tb.add_scalar(f"train/{k}", getattr(m, k), m.step)
        return m

    def summary(self, exclude_steps: int, extra: dict | None = None) -> dict:
        """Medians over logged steps with ``step > exclude_steps`` (warm-up and compile steps
        excluded), plus ``extra``; appended to metrics.jsonl as ``{"summary": {...}}``."""
        steady = [r for r in self.rows if r.step > exclude_steps] or self.rows[-1:]
        vals = {k: [getattr(r, k) for r in steady if getattr(r, k) is not None]
                for k in ("tps", "tflops", "mfu", "memory_gib", "step_time_s", "data_time_s")}
        s = {"steady_steps": [r.step for r in steady],
             **{k: statistics.median(v) if v else None for k, v in vals.items()},
             "max_memory_gib": max((r.memory_gib for r in self.rows), default=None),
             "final_loss": self.rows[-1].loss if self.rows else None, **(extra or {})}
        if s["tps"] is not None:
            mfu = f"{s['mfu']:.2f}%" if s["mfu"] is not None else "n/a"
            logger.info(f"summary (median of steps {s['steady_steps'][0]}..{s['steady_steps'][-1]}): "
                        f"tps: {round(s['tps']):,}  tflops: {s['tflops']:,.2f}  mfu: {mfu}  "
                        f"memory: {s['max_memory_gib']:.2f}GiB  step_time: {s['step_time_s']:.3f}s")
        self._write({"summary": s})
        return s

    def close(self) -> None:
        for f in (self.jsonl, self.tb):
            if f:
                f.close()


def read_metrics(path: str) -> tuple[list[dict], dict | None]:
    """A ``metrics.jsonl``: (per-step rows in step order, the last written per step, then rows without
    an integer ``step``; the last summary or None). Raises OSError (unreadable), ValueError (not JSON)."""
    by_step, other, summary = {}, [], None
    with open(path) as f:
        for obj in (json.loads(line) for line in f if line.strip()):
            if "summary" in obj:
                summary = obj["summary"]
            elif isinstance(obj.get("step"), int):
                by_step[obj["step"]] = obj
            else:
                other.append(obj)
    return [by_step[k] for k in sorted(by_step)] + other, summary
