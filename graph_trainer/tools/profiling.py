"""``--profiling.enable_profiling``: torch.profiler traces plus a kernel-time summary.

torchtitan's ``[profiling]`` fields are used as torchtitan's Trainer uses them
(``profile_freq``, ``profiler_warmup``, ``profiler_active``, ``save_traces_folder``): every
``profile_freq`` steps the profiler records ``profiler_active`` steps after
``profiler_warmup`` warm-up steps. (torchtitan 0.2.2's ``maybe_enable_profiling`` calls
``torch.distributed.get_rank()``, which fails on one GPU without a process group, so the
schedule is rebuilt here with the same fields.)

For each recorded window this writes, under
``<dump_folder>/<save_traces_folder>/iteration_<step>/``:

* ``rank<r>_trace.json``: the Chrome trace (Perfetto / chrome://tracing), as torchtitan;
* ``rank<r>_kernels.md`` and ``rank<r>_kernels.json``: device time per step by kernel
  category (matmul, attention, communication, Inductor Triton, eager ATen pointwise /
  reduction, copy, other) and the top kernels, so two runs (``jit`` vs ``aot_fx_trace``,
  a pass on vs off) can be compared without opening a trace; and the step's timeline
  (:func:`graph_trainer.tools.timeline.timeline_breakdown`, re-exported here): wall time,
  time with compute kernels running, time with only communication running (exposed
  communication) and time with nothing running (the GPU waiting on the CPU). The tables
  are also logged. The JSON also holds the kernels of
  the window's last step (``"step_intervals"``, :func:`graph_trainer.tools.timeline.pack_step`);
* ``rank<r>_timeline.png``: that step as a picture, compute and communication lanes with
  the exposed communication and idle time marked (:mod:`graph_trainer.tools.timeline`;
  skipped with one log line without matplotlib).

On CPU (no CUDA) the summary counts CPU time of ATen ops instead of kernels, and gloo's
collectives (the ``gloo:<op>`` ranges on gloo's threads) as communication; the ATen ops
that gloo's threads run inside a collective are part of it, not compute, in the timeline.

Nothing recorded earlier is written over: a fresh run (not resumed from a checkpoint)
moves an existing ``<save_traces_folder>`` aside to ``<save_traces_folder>.<N>`` (rank 0,
before the first step), and a file that a resumed run would write again
(``iteration_<step>/rank<r>_*``) is first renamed to ``rank<r>_trace.<N>.json`` etc.
(:func:`graph_trainer.metrics.keep_previous`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from typing import Any

import torch

from graph_trainer.metrics import keep_previous
from graph_trainer.tools.timeline import (
    TIMELINE_EXTRA_ROWS,
    TIMELINE_ROWS,
    draw_timeline,
    pack_step,
    timeline_breakdown,
)

logger = logging.getLogger("graph_trainer")

#: (category, regex over the kernel name), first match wins. Order matters: NCCL and
#: attention kernels are matched before the generic GEMM / Triton patterns.
KERNEL_CATEGORIES: list[tuple[str, re.Pattern]] = [
    ("communication", re.compile(r"nccl|^gloo:|all_?gather|reduce_?scatter|all_?reduce|c10d", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(?:tensorop|mma)|aten::mm|aten::addmm|aten::bmm", re.I)),
    ("inductor triton", re.compile(r"^triton_|triton", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|CatArrayBatched|aten::_to_copy|aten::copy_", re.I)),
    ("view / metadata (CPU)", re.compile(
        r"^aten::(t|view|_unsafe_view|as_strided|reshape|expand|permute|transpose|detach|slice|select|"
        r"unsqueeze|squeeze|split|split_with_sizes|alias|empty|empty_strided|resize_)$")),
    ("eager pointwise / reduction", re.compile(r"elementwise|vectorized|reduce_kernel|unrolled|aten::", re.I)),
]


def kernel_category(name: str) -> str:
    """Category of a kernel (or, on CPU, ATen op) name; ``"other"`` when nothing matches."""
    for cat, pattern in KERNEL_CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def summarize_events(events: list[tuple[str, float, int]], steps: int, top: int = 15) -> dict[str, Any]:
    """Aggregate ``(name, self_time_us, calls)`` rows into per-step milliseconds.

    Args:
        events: one row per kernel name (device time, or CPU time on CPU), microseconds,
            summed over the recorded window; ``calls`` = number of launches.
        steps: steps in the window (>= 1); every time is divided by it.
        top: how many kernels to list.

    Returns:
        ``{"steps", "total_ms", "categories": {cat: {"ms", "share", "calls"}},
        "top": [{"name", "category", "ms", "calls"}]}`` (ms per step; ``share`` of
        ``total_ms``, the summed kernel time, which counts overlapping streams twice).
    """
    steps = max(1, int(steps))
    cats: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    rows = []
    for name, us, calls in events:
        if us <= 0:
            continue
        cat = kernel_category(name)
        ms = us / 1e3 / steps
        cats[cat]["ms"] += ms
        cats[cat]["calls"] += calls / steps
        rows.append({"name": name, "category": cat, "ms": ms, "calls": calls / steps})
    total = sum(c["ms"] for c in cats.values())
    categories = {
        k: {"ms": v["ms"], "share": v["ms"] / total if total else 0.0, "calls": v["calls"]}
        for k, v in sorted(cats.items(), key=lambda kv: -kv[1]["ms"])
    }
    rows.sort(key=lambda r: -r["ms"])
    return {"steps": steps, "total_ms": total, "categories": categories, "top": rows[:top]}


def summary_markdown(summary: dict[str, Any], unit: str = "device") -> str:
    """The summary of :func:`summarize_events` as two markdown tables."""
    lines = [
        f"{unit} time per step, {summary['steps']} recorded step(s); total {summary['total_ms']:.2f} ms "
        "(self time summed over kernels / ops: work on overlapping streams counts twice)",
        "",
        "| category | ms/step | share | launches/step |",
        "|---|---:|---:|---:|",
    ]
    for cat, c in summary["categories"].items():
        lines.append(f"| {cat} | {c['ms']:.2f} | {100 * c['share']:.1f} % | {c['calls']:.0f} |")
    t = summary.get("timeline")
    if t and t.get("wall_ms"):
        lines += ["", "| step timeline | ms/step | share of wall |", "|---|---:|---:|"]
        for key, label in TIMELINE_ROWS + [r for r in TIMELINE_EXTRA_ROWS if r[0] in t]:
            lines.append(f"| {label} | {t[key]:.2f} | {100 * t[key] / t['wall_ms']:.1f} % |")
    lines += ["", "| top kernel | category | ms/step | launches/step |", "|---|---|---:|---:|"]
    for r in summary["top"]:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(f"| `{name}` | {r['category']} | {r['ms']:.3f} | {r['calls']:.0f} |")
    return "\n".join(lines) + "\n"


def _annotation(evt) -> bool:
    """A GPU user annotation (``ProfilerStep*``, ``nccl:all_gather...``, ``Optimizer.step#...``):
    a range on the device timeline spanning kernels, not a kernel; counting it would count
    those kernels twice."""
    return bool(getattr(evt, "is_user_annotation", False))


def _on_cuda(evt) -> bool:
    return getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA


#: on CPU, the name prefix of a gloo collective's range (``gloo:all_gather``), recorded on
#: the gloo thread that runs it
CPU_COLLECTIVE_PREFIX = "gloo:"


def _counted(evt, name: str, on_device: bool) -> bool:
    """The events both summaries count: device kernels (not annotations) on CUDA, ATen ops
    and gloo collectives (by ``name``) on CPU."""
    if on_device:
        return _on_cuda(evt) and not _annotation(evt)
    return name.startswith(("aten::", CPU_COLLECTIVE_PREFIX))


def _events_of(prof) -> tuple[list[tuple[str, float, int]], str]:
    on_device = torch.cuda.is_available()
    out = []
    for evt in prof.key_averages():
        if not _counted(evt, evt.key, on_device):
            continue
        if on_device:
            us = getattr(evt, "self_device_time_total", None)
            if us is None:  # older torch
                us = evt.self_cuda_time_total
        else:
            us = evt.self_cpu_time_total
        out.append((evt.key, float(us), int(evt.count)))
    return out, ("device" if on_device else "CPU")


def _intervals_of(prof, on_device: bool | None = None
                  ) -> tuple[list[tuple[float, float, str]], list[tuple[float, float]]]:
    """The recorded window as :func:`timeline_breakdown` takes it: ``(kernels, steps)`` in
    microseconds, kernels = device kernels (on CPU: ATen ops, nested ones included, and gloo
    collectives; the ATen ops on a gloo thread are left out, they belong to its collective).
    ``on_device``: default ``torch.cuda.is_available()``."""
    on_device = torch.cuda.is_available() if on_device is None else on_device
    events = list(prof.events())
    gloo_threads = set() if on_device else {
        getattr(e, "thread", None) for e in events if e.name.startswith(CPU_COLLECTIVE_PREFIX)}
    kernels, steps = [], []
    for evt in events:
        tr = evt.time_range
        if evt.name.startswith("ProfilerStep"):  # "ProfilerStep#N", listed as "ProfilerStep*"
            # the host-side range only: on CUDA the profiler also lists the step as a GPU
            # annotation, which would make one recorded step count as two windows
            if not _on_cuda(evt):
                steps.append((tr.start, tr.end))
        elif _counted(evt, evt.name, on_device):  # CPU: nested ops, the union counts them once
            if evt.name.startswith("aten::") and getattr(evt, "thread", None) in gloo_threads:
                continue
            kernels.append((tr.start, tr.end, kernel_category(evt.name)))
    return kernels, sorted(steps)


def _timeline_of(prof, on_device: bool | None = None) -> dict[str, float]:
    """:func:`timeline_breakdown` of the recorded window (device kernels; on CPU, ATen ops
    and gloo collectives). ``on_device``: default ``torch.cuda.is_available()``."""
    return timeline_breakdown(*_intervals_of(prof, on_device))


def _json_text(summary: dict[str, Any]) -> str:
    """``summary`` as indented JSON, the rows of ``step_intervals.kernels`` one per line."""
    rows = summary.get("step_intervals", {}).get("kernels")
    if not rows:
        return json.dumps(summary, indent=1)
    marker = '"kernels": "<rows>"'
    text = json.dumps({**summary, "step_intervals": {**summary["step_intervals"], "kernels": "<rows>"}}, indent=1)
    return text.replace(marker, '"kernels": [\n' + ",\n".join("   " + json.dumps(r) for r in rows) + "\n  ]", 1)


def _write_picture(path: str, kernels: list, step: tuple[float, float], title: str) -> None:
    """:func:`graph_trainer.tools.timeline.draw_timeline`, or one log line when it cannot draw
    (no matplotlib, or a drawing error: the run goes on)."""
    try:
        draw_timeline(path, kernels, step, title)
    except ImportError as e:
        logger.info(f"no step timeline picture ({e}); install matplotlib for {os.path.basename(path)}")
    except Exception as e:  # noqa: BLE001 -- a picture is not worth a training run
        logger.warning(f"could not draw the step timeline {path}: {type(e).__name__}: {e}")


class StepProfiler:
    """torch.profiler on torchtitan's schedule; call :meth:`step` after every train step
    and :meth:`stop` at the end. Created by :func:`maybe_start_profiler`."""

    def __init__(self, cfg, dump_folder: str, rank: int, start_step: int = 0):
        self.trace_dir = os.path.join(dump_folder, cfg.save_traces_folder)
        if rank == 0 and start_step == 0 and (kept := keep_previous(self.trace_dir)):
            logger.info(f"A fresh run: the earlier {self.trace_dir} is kept as {kept}")
        self.rank = rank
        self.active = cfg.profiler_active
        wait = cfg.profile_freq - (cfg.profiler_active + cfg.profiler_warmup)
        if wait < 0:  # graph_trainer.config.validate rejects this at start-up
            raise ValueError("profile_freq must be >= profiler_warmup + profiler_active")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active),
            on_trace_ready=self._ready,
            record_shapes=False,  # torchtitan records shapes; an 8B step's trace is large enough without
        )
        self.prof.start()
        self.prof.step_num = start_step
        logger.info(f"Profiling every {cfg.profile_freq} steps; traces and kernel summaries in {self.trace_dir}")

    def _ready(self, prof) -> None:
        events, unit = _events_of(prof)
        summary = summarize_events(events, self.active)
        if not summary["total_ms"]:  # the partial window flushed by stop(): nothing recorded
            return
        folder = os.path.join(self.trace_dir, f"iteration_{prof.step_num}")
        kernels, steps = _intervals_of(prof)
        summary.update(step=prof.step_num, rank=self.rank, unit=unit, timeline=timeline_breakdown(kernels, steps))
        if steps:  # the window's last step, for the pictures
            summary["step_intervals"] = pack_step(kernels, steps[-1], prof.step_num)
        os.makedirs(folder, exist_ok=True)
        names = ("trace.json", "kernels.md", "kernels.json", "timeline.png")
        paths = [os.path.join(folder, f"rank{self.rank}_{name}") for name in names]
        for path in paths:  # a resumed run profiling a step again
            keep_previous(path)
        prof.export_chrome_trace(paths[0])
        md = summary_markdown(summary, unit)
        with open(paths[1], "w") as f:
            f.write(md)
        with open(paths[2], "w") as f:
            f.write(_json_text(summary))
        if steps:
            _write_picture(paths[3], kernels, steps[-1], f"rank {self.rank}, step {prof.step_num} ({unit})")
        if self.rank == 0:
            logger.info(f"profile at step {prof.step_num} ({folder}):\n{md}")

    def step(self) -> None:
        self.prof.step()

    def stop(self) -> None:
        self.prof.stop()


def maybe_start_profiler(cfg, dump_folder: str, rank: int, start_step: int = 0) -> StepProfiler | None:
    """A started :class:`StepProfiler` when ``cfg.enable_profiling`` (torchtitan's
    ``[profiling]`` section), else ``None``.

    Raises:
        ValueError: ``profile_freq < profiler_warmup + profiler_active``.
    """
    if not cfg.enable_profiling:
        return None
    return StepProfiler(cfg, dump_folder, rank, start_step)
