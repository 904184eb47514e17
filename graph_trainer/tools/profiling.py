"""``--profiling.enable_profiling``: torch.profiler on torchtitan's ``[profiling]`` schedule (built here: torchtitan's
needs a process group). Each recorded window writes ``rank<r>_trace.json``, ``rank<r>_kernels.md`` / ``.json`` (time per
step by kernel category, the step's timeline, each collective's time and exposed time, on CUDA the idle time by
cause (waiting for the host's launch, by host op, or queued behind a stream / peer), top kernels, the step's kernels)
and ``rank<r>_timeline.png`` to ``<dump_folder>/<save_traces_folder>/iteration_<step>/``, keeping earlier files. On CPU
the ATen ops' CPU time counts instead of kernels, gloo's collectives as communication."""

import json
import os
import re
from collections import defaultdict
from typing import Any

import torch

from graph_trainer import logger
from graph_trainer.metrics import keep_previous
from graph_trainer.tools.timeline import (TIMELINE_EXTRA_ROWS, TIMELINE_ROWS, collective_breakdown, device_steps,
                                          draw_timeline, idle_causes, pack_step, timeline_breakdown)

#: (category, regex over the kernel name), first match wins. Order matters: Inductor's generated
#: kernels (but FlexAttention's), NCCL and attention kernels are matched before the generic
#: GEMM / Triton patterns.
KERNEL_CATEGORIES: list[tuple[str, re.Pattern]] = [
    # Inductor names a kernel after the ops it fused: the copies around an attention op, the add and
    # copy-in that feed a reduce-scatter (``triton_poi_fused_add_reduce_scatter_tensor_…``) are Triton work
    ("inductor triton", re.compile(r"^triton_(?!tem_fused\w*flex_attention)")),
    ("communication", re.compile(r"nccl|^gloo:|all_?gather|reduce_?scatter|all_?reduce|c10d", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(?:tensorop|mma)|aten::(?:mm|addmm|bmm)", re.I)),
    ("inductor triton", re.compile(r"^triton_|triton", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|CatArrayBatched|aten::_to_copy|aten::copy_", re.I)),
    ("view / metadata (CPU)", re.compile(
        r"^aten::(t|view|_unsafe_view|as_strided|reshape|expand|permute|transpose|detach|slice|select|"
        r"unsqueeze|squeeze|split|split_with_sizes|alias|empty|empty_strided|resize_)$")),
    ("eager pointwise / reduction", re.compile(r"elementwise|vectorized|reduce_kernel|unrolled|aten::", re.I)),
]


#: the rows of :func:`~graph_trainer.tools.timeline.idle_causes` that add up to the idle time
IDLE_ROWS = [("host_ms", "host-late: the next kernel launched after the device went idle"),
             ("queued_ms", "queued: launched before, waiting for a stream, an event or a peer"),
             ("tail_ms", "after the step's last kernel"), ("unknown_ms", "no launch recorded")]


def kernel_category(name: str) -> str:
    """Category of a kernel (or, on CPU, ATen op) name; ``"other"`` when nothing matches."""
    return next((cat for cat, pattern in KERNEL_CATEGORIES if pattern.search(name)), "other")


# dtype tokens of NCCL's kernel names (``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL``,
# ``ncclKernel_AllReduce_RING_LL_Sum_float``)
_NCCL_DTYPES = {"f8e4m3", "f8e5m2", "f16", "bf16", "f32", "f64", "i8", "u8", "i32", "u32", "i64", "u64",
                "half", "float", "double", "bfloat16", "int8", "uint8", "int32", "uint32", "int64", "uint64"}


def collective_label(name: str) -> str:
    """A communication kernel's collective and dtype: ``"ReduceScatter f32"`` for
    ``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(...)``, ``"AllGather"`` (no dtype for a copy), ``"all_gather"`` for
    ``gloo:all_gather``; another name, its first 40 characters. (FSDP reduces in fp32, TP in bf16.)"""
    if name.startswith("gloo:"):
        return name[len("gloo:"):]
    m = re.search(r"Kernel_(\w+)", name)
    if not m:
        return name[:40]
    kind, *rest = m.group(1).split("_")
    dtype = next((t for t in rest if t in _NCCL_DTYPES), None)
    return f"{kind} {dtype}" if dtype else kind


def summarize_events(events: list[tuple[str, float, int]], steps: int, top: int = 15) -> dict[str, Any]:
    """Per-step milliseconds from ``(name, self_time_us, calls)`` rows summed over ``steps`` steps:
    ``{"steps", "total_ms", "categories": {cat: {"ms", "share", "calls"}}, "kernels": [{"name", "category",
    "ms", "calls"}], "top": the first ``top`` kernels}``, by descending ms."""
    steps = max(1, int(steps))
    cats: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    rows = []
    for name, us, calls in events:
        if us > 0:
            row = {"name": name, "category": kernel_category(name), "ms": us / 1e3 / steps, "calls": calls / steps}
            cats[row["category"]]["ms"] += row["ms"]
            cats[row["category"]]["calls"] += row["calls"]
            rows.append(row)
    total = sum(c["ms"] for c in cats.values())
    categories = {k: {**v, "share": v["ms"] / total if total else 0.0}
                  for k, v in sorted(cats.items(), key=lambda kv: -kv[1]["ms"])}
    rows.sort(key=lambda r: -r["ms"])
    return {"steps": steps, "total_ms": total, "categories": categories, "kernels": rows, "top": rows[:top]}


def summary_markdown(summary: dict[str, Any], unit: str = "device") -> str:
    """The summary of :func:`summarize_events` (and its ``"timeline"``, if any) as markdown tables."""
    lines = [f"{unit} time per step, {summary['steps']} recorded step(s); total {summary['total_ms']:.2f} ms "
             "(self time summed over kernels / ops: work on overlapping streams counts twice)", "",
             "| category | ms/step | share | launches/step |", "|---|---:|---:|---:|"]
    for cat, c in summary["categories"].items():
        lines.append(f"| {cat} | {c['ms']:.2f} | {100 * c['share']:.1f} % | {c['calls']:.0f} |")
    t = summary.get("timeline")
    if t and t.get("wall_ms"):
        lines += ["", "| step timeline | ms/step | share of wall |", "|---|---:|---:|"]
        for key, label in TIMELINE_ROWS + [r for r in TIMELINE_EXTRA_ROWS if r[0] in t]:
            lines.append(f"| {label} | {t[key]:.2f} | {100 * t[key] / t['wall_ms']:.1f} % |")
    if (idle := summary.get("idle_causes")) and t and t.get("idle_ms"):
        lines += ["", "| idle (nothing running), by cause | ms/step |", "|---|---:|"]
        lines += [f"| {label} | {idle[key]:.2f} |" for key, label in IDLE_ROWS]
        lines += [f"| (host-late, launched by `{op}`) | {ms:.2f} |" for op, ms in idle["by_host_op"].items()]
        lines.append(f"\n(host lead: a kernel starts a median {idle['lead_ms']:.2f} ms after its launch)")
    if summary.get("collectives"):
        lines += ["", "| collective (dtype, stream) | ms/step | exposed ms/step | launches/step |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {label} | {c['ms']:.2f} | {c['exposed_ms']:.2f} | {c['launches']:.0f} |"
                  for label, c in summary["collectives"].items()]
        lines.append("\n(exposed: while no compute kernel runs; collectives in flight together each count it)")
    lines += ["", "| top kernel | category | ms/step | launches/step |", "|---|---|---:|---:|"]
    for r in summary["top"]:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(f"| `{name}` | {r['category']} | {r['ms']:.3f} | {r['calls']:.0f} |")
    return "\n".join(lines) + "\n"


def _counted(evt, name: str, on_device: bool) -> bool:
    """Device kernels on CUDA (not user annotations such as ``ProfilerStep*`` or ``nccl:...``,
    which span kernels), ATen ops and gloo collectives (``gloo:<op>``) on CPU."""
    if on_device:
        return evt.device_type == torch.autograd.DeviceType.CUDA and not getattr(evt, "is_user_annotation", False)
    return name.startswith(("aten::", "gloo:"))


def _events_of(prof, steps: list[tuple[float, float]], on_device: bool | None = None) -> tuple[list, str]:
    """``(name, self_time_us, calls)`` rows for :func:`summarize_events` of the events that start inside ``steps``
    (their ranges in us, :func:`_intervals_of`; none: every event), and the unit. Not ``key_averages()``: with the
    host ahead, the profiler's window also holds device work of the step before."""
    on_device = torch.cuda.is_available() if on_device is None else on_device
    rows: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if _counted(evt, evt.name, on_device) and (not steps or any(a <= evt.time_range.start < b for a, b in steps)):
            rows[evt.name][0] += evt.self_device_time_total if on_device else evt.self_cpu_time_total
            rows[evt.name][1] += 1
    return [(name, us, calls) for name, (us, calls) in rows.items()], ("device" if on_device else "CPU")


def _intervals_of(prof, on_device: bool | None = None) -> tuple[list, list[tuple[float, float]], list]:
    """``(kernels, steps, collectives)`` of the recorded window in microseconds, for
    :func:`timeline_breakdown` and :func:`collective_breakdown` (labels get ``" (stream <id>)"`` where one
    runs on several streams, i.e. groups; steps: :func:`~graph_trainer.tools.timeline.device_steps`, from the
    ``ProfilerStep`` host ranges and device annotations in time order, the device's nested ones left out: the
    profiler names every step ``ProfilerStep*``). On CPU ATen ops on a gloo thread belong to its collective."""
    on_device = torch.cuda.is_available() if on_device is None else on_device
    events = list(prof.events())
    gloo_threads = set() if on_device else {getattr(e, "thread", None) for e in events if e.name.startswith("gloo:")}
    kernels, host, device, comm = [], [], [], []
    for evt in events:
        tr = evt.time_range
        if evt.name.startswith("ProfilerStep"):  # a step's host range, or one of its device annotations
            (device if evt.device_type == torch.autograd.DeviceType.CUDA else host).append((tr.start, tr.end))
        elif _counted(evt, evt.name, on_device):
            if not (evt.name.startswith("aten::") and getattr(evt, "thread", None) in gloo_threads):
                kernels.append((tr.start, tr.end, kernel_category(evt.name)))
                if kernels[-1][2] == "communication":
                    comm.append((tr.start, tr.end, collective_label(evt.name),
                                 getattr(evt, "device_resource_id", None) if on_device else None))
    streams: dict[str, set] = defaultdict(set)
    for *_, label, stream in comm:
        streams[label].add(stream)
    collectives = [(a, b, f"{label} (stream {s})" if len(streams[label]) > 1 else label) for a, b, label, s in comm]
    device.sort(key=lambda s: (s[0], -s[1]))
    outermost = [s for i, s in enumerate(device) if all(s[1] > t[1] for t in device[:i])]
    return kernels, device_steps(sorted(host), outermost, kernels), collectives


# host-side CUDA runtime / driver calls that start device work (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync)
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")
# parts of host op names that differ per region or graph: Inductor's graph hash, Dynamo's frame ids
_OP_IDS = re.compile(r"(?<=CompiledFxGraph) \w+|: \d+/\d+")


def _host_op(evt) -> str:
    """The host ops around a runtime call (below the ``ProfilerStep*`` window), ids stripped: ``"outer › inner"``
    (e.g. ``symm_mem::fused_all_gather_matmul › aten::mm``), or one name when they are the same op."""
    chain, parent = [], evt.cpu_parent
    while parent is not None and not parent.name.startswith("ProfilerStep"):
        chain.append(_OP_IDS.sub("", parent.name))
        parent = parent.cpu_parent
    if not chain:
        return "(no host op)"
    return chain[-1] if len(chain) == 1 else f"{chain[-1]} › {chain[0]}"


def _launches_of(events: list) -> list[tuple[float, float, str]]:
    """``(kernel start_us, launch start_us, host op)`` of every device kernel whose runtime call was recorded
    (the two share the CUPTI correlation id), for :func:`~graph_trainer.tools.timeline.idle_causes`."""
    calls = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU and _RUNTIME_CALL.match(e.name)}
    return [(e.time_range.start, calls[e.id].time_range.start, _host_op(calls[e.id])) for e in events
            if e.id in calls and _counted(e, e.name, on_device=True)]


def _json_text(summary: dict[str, Any]) -> str:
    """``summary`` as indented JSON, the rows of ``step_intervals.kernels`` one per line."""
    rows = summary.get("step_intervals", {}).get("kernels")
    if not rows:
        return json.dumps(summary, indent=1)
    text = json.dumps({**summary, "step_intervals": {**summary["step_intervals"], "kernels": "<rows>"}}, indent=1)
    return text.replace('"kernels": "<rows>"',
                        '"kernels": [\n' + ",\n".join("   " + json.dumps(r) for r in rows) + "\n  ]", 1)


def _write_picture(path: str, kernels: list, step: tuple[float, float], title: str) -> None:
    """:func:`~graph_trainer.tools.timeline.draw_timeline`, or one log line when it cannot draw."""
    try:
        draw_timeline(path, kernels, step, title)
    except ImportError as e:
        logger.info(f"no step timeline picture ({e}); install matplotlib for {os.path.basename(path)}")
    except Exception as e:  # noqa: BLE001 -- a picture is not worth a training run
        logger.warning(f"could not draw the step timeline {path}: {type(e).__name__}: {e}")


class StepProfiler:
    """torch.profiler on torchtitan's schedule; ``step()`` after every train step, ``stop()`` at the end."""

    def __init__(self, cfg, dump_folder: str, rank: int, start_step: int = 0):
        self.trace_dir = os.path.join(dump_folder, cfg.save_traces_folder)
        if rank == 0 and start_step == 0 and (kept := keep_previous(self.trace_dir)):
            logger.info(f"A fresh run: the earlier {self.trace_dir} is kept as {kept}")
        self.rank, self.active = rank, cfg.profiler_active
        wait = cfg.profile_freq - (cfg.profiler_active + cfg.profiler_warmup)
        if wait < 0:  # graph_trainer.config.validate rejects this at start-up
            raise ValueError("profile_freq must be >= profiler_warmup + profiler_active")
        # CPU and, when there, CUDA activities; no shapes: an 8B step's trace is large enough without
        schedule = torch.profiler.schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active)
        self.prof = torch.profiler.profile(schedule=schedule, on_trace_ready=self._ready, record_shapes=False)
        self.prof.start()
        self.prof.step_num = start_step
        self.step, self.stop = self.prof.step, self.prof.stop
        logger.info(f"Profiling every {cfg.profile_freq} steps; traces and kernel summaries in {self.trace_dir}")

    def _ready(self, prof) -> None:
        kernels, steps, collectives = _intervals_of(prof)
        events, unit = _events_of(prof, steps)
        summary = summarize_events(events, len(steps) or self.active)
        if not summary["total_ms"]:  # the partial window flushed by stop(): nothing recorded
            return
        folder = os.path.join(self.trace_dir, f"iteration_{prof.step_num}")
        summary.update(step=prof.step_num, rank=self.rank, unit=unit, timeline=timeline_breakdown(kernels, steps),
                       collectives=collective_breakdown(kernels, collectives, steps))
        if unit == "device":
            try:
                summary["idle_causes"] = idle_causes(kernels, _launches_of(prof.events()), steps)
            except Exception as e:  # noqa: BLE001 -- a summary row is not worth a training run
                logger.warning(f"no idle time by cause: {type(e).__name__}: {e}")
        if steps:  # the window's last step, for the pictures
            summary["step_intervals"] = pack_step(kernels, steps[-1], prof.step_num)
        os.makedirs(folder, exist_ok=True)
        trace, md_path, json_path, png = (os.path.join(folder, f"rank{self.rank}_{name}")
                                          for name in ("trace.json", "kernels.md", "kernels.json", "timeline.png"))
        for path in (trace, md_path, json_path, png):  # a resumed run profiling a step again
            keep_previous(path)
        prof.export_chrome_trace(trace)
        md = summary_markdown(summary, unit)
        for path, text in ((md_path, md), (json_path, _json_text(summary))):
            with open(path, "w") as f:
                f.write(text)
        if steps:
            _write_picture(png, kernels, steps[-1], f"rank {self.rank}, step {prof.step_num} ({unit})")
        if self.rank == 0:
            logger.info(f"profile at step {prof.step_num} ({folder}):\n{md}")
