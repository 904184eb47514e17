"""The timeline of a profiled step: where its wall time goes, and its picture
(``rank<r>_timeline.png``, ``timeline_a_vs_b.png``).

This module owns the interval arithmetic over ``(start_us, end_us, category)`` kernels and
:func:`timeline_breakdown` (wall = compute + exposed communication + idle);
:mod:`graph_trainer.tools.profiling` imports them from here, never the other way round.

The picture shows one recorded step (:mod:`graph_trainer.tools.profiling`) on two lanes:
compute (every kernel that is not communication) and communication
(:data:`graph_trainer.tools.profiling.KERNEL_CATEGORIES`' ``"communication"``; on CPU the
gloo collectives), each kernel (on CPU: ATen op) a bar
coloured by its category; under them a red band where only communication runs (exposed
communication) and a grey band where nothing runs (idle). The x axis is milliseconds from
the start of the step; the title holds the step's :func:`timeline_breakdown`.

``rank<r>_kernels.json`` keeps the step's kernels in a compact form (:func:`pack_step`,
``"step_intervals"``), so :func:`timeline_a_vs_b` draws two runs from their JSON files
without parsing a trace.

No torch at all, and matplotlib only inside the drawing functions (as in
:mod:`graph_trainer.tools.plot`): the launchers (:mod:`graph_trainer.tools.compare_mfu`,
:mod:`graph_trainer.tools.stats`) read a profile's step without the profiler.
"""

from __future__ import annotations

import json

Kernel = tuple[float, float, str]  # (start_us, end_us, category)

#: bar colour per kernel category; a category not listed here is drawn dark grey
COLORS = {
    "matmul": "tab:blue",
    "attention": "tab:orange",
    "inductor triton": "tab:green",
    "eager pointwise / reduction": "tab:olive",
    "copy": "tab:brown",
    "view / metadata (CPU)": "tab:pink",
    "communication": "tab:purple",
    "other": "tab:cyan",
}
EXPOSED_COLOR, IDLE_COLOR = "red", "0.7"
# y of each lane (bottom, height), top to bottom
LANES = {"compute": (2.1, 0.8), "communication": (1.1, 0.8), "exposed comm": (0.65, 0.3), "idle": (0.2, 0.3)}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` merged into disjoint ranges, sorted by start."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    """Summed length of ``intervals`` (disjoint ones: a :func:`_union`)."""
    return sum(b - a for a, b in intervals)


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``intervals`` inside ``[lo, hi]``."""
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def timeline_breakdown(kernels: list[Kernel], steps: list[tuple[float, float]]) -> dict[str, float]:
    """Where a step's wall time goes on the device, from kernel intervals.

    Args:
        kernels: ``(start_us, end_us, category)`` of every device kernel in the window,
            ``category`` as :func:`graph_trainer.tools.profiling.kernel_category` returns it.
        steps: ``(start_us, end_us)`` of each recorded step (the profiler's
            ``ProfilerStep#N`` ranges, same clock); kernels are clipped to them.

    Returns:
        Milliseconds per step (mean over ``steps``): ``wall_ms``; ``compute_ms``, the union
        of every non-communication kernel (time the GPU computes); ``comm_ms``, the union of
        communication kernels; ``exposed_comm_ms``, communication while no compute kernel
        runs; ``idle_ms``, time with no kernel at all (launch-bound or waiting on the host).
        ``compute_ms + exposed_comm_ms + idle_ms == wall_ms``. Of ``exposed_comm_ms``:
        ``exposed_head_ms`` lies before the step's first matmul kernel starts (e.g. the
        first all-gather) and ``exposed_tail_ms`` after its last matmul ends (e.g. the last
        reduce-scatters before the optimizer); the rest is exposed between matmuls. A step
        without matmul kernels counts all of it as head. All zero without ``steps``.
    """
    out = {"wall_ms": 0.0, "compute_ms": 0.0, "comm_ms": 0.0, "exposed_comm_ms": 0.0, "idle_ms": 0.0,
           "exposed_head_ms": 0.0, "exposed_tail_ms": 0.0}
    if not steps:
        return out
    comp = _union([(a, b) for a, b, c in kernels if c != "communication"])
    comm = _union([(a, b) for a, b, c in kernels if c == "communication"])
    mms = [(a, b) for a, b, c in kernels if c == "matmul"]
    for lo, hi in steps:
        c, m = _clip(comp, lo, hi), _clip(comm, lo, hi)
        busy = _length(_union(c + m))
        out["wall_ms"] += (hi - lo) / 1e3
        out["compute_ms"] += _length(c) / 1e3
        out["comm_ms"] += _length(m) / 1e3
        out["exposed_comm_ms"] += (busy - _length(c)) / 1e3
        out["idle_ms"] += (hi - lo - busy) / 1e3
        mm = _clip(mms, lo, hi)
        first = min((a for a, _ in mm), default=hi)
        last = max((b for _, b in mm), default=hi)
        for key, a, b in (("exposed_head_ms", lo, first), ("exposed_tail_ms", last, hi)):
            cc, mc = _clip(c, a, b), _clip(m, a, b)
            out[key] += (_length(_union(cc + mc)) - _length(cc)) / 1e3
    return {k: v / len(steps) for k, v in out.items()}


#: the rows of :func:`timeline_breakdown` that add up to the wall time, in print order
TIMELINE_ROWS: list[tuple[str, str]] = [
    ("wall_ms", "wall"), ("compute_ms", "compute kernels running"),
    ("exposed_comm_ms", "only communication running"), ("idle_ms", "nothing running"),
]
#: further rows (not part of the sum)
TIMELINE_EXTRA_ROWS: list[tuple[str, str]] = [
    ("exposed_head_ms", "(of it: before the first matmul)"), ("exposed_tail_ms", "(of it: after the last matmul)"),
    ("comm_ms", "(communication running, overlapped or not)"),
]


def pack_step(kernels: list[Kernel], step: tuple[float, float], step_num: int | None = None) -> dict:
    """The compact JSON form of one step's kernels (``rank<r>_kernels.json["step_intervals"]``).

    Args:
        kernels: ``(start_us, end_us, category)`` as :func:`timeline_breakdown` takes them (any window; only the parts inside ``step`` are kept).
        step: ``(start_us, end_us)`` of the step, same clock.
        step_num: the training step, stored as ``"step"``.

    Returns:
        ``{"step", "wall_ms", "categories": [name, ...], "kernels": [[start_ms, dur_ms, i], ...]}``:
        times in milliseconds from the step's start (rounded to 0.1 us), ``i`` indexes
        ``categories``; rows sorted by start.
    """
    lo, hi = step
    cats: dict[str, int] = {}
    rows = []
    for a, b, c in sorted(kernels):
        a, b = max(a, lo), min(b, hi)
        if b > a:
            rows.append([round((a - lo) / 1e3, 4), round((b - a) / 1e3, 4), cats.setdefault(c, len(cats))])
    return {"step": step_num, "wall_ms": round((hi - lo) / 1e3, 4), "categories": list(cats), "kernels": rows}


def unpack_step(packed: dict) -> tuple[list[Kernel], tuple[float, float]]:
    """``(kernels, step)`` in microseconds from a :func:`pack_step` dict, the step starting at 0.

    Raises:
        KeyError, IndexError, TypeError: ``packed`` is not a :func:`pack_step` dict.
    """
    cats = packed["categories"]
    kernels = [(a * 1e3, (a + d) * 1e3, cats[i]) for a, d, i in packed["kernels"]]
    return kernels, (0.0, packed["wall_ms"] * 1e3)


def read_step(path: str) -> tuple[list[Kernel], tuple[float, float], dict]:
    """``(kernels, step, summary)`` of a ``rank<r>_kernels.json`` (:func:`unpack_step` of its
    ``"step_intervals"``; ``summary`` is the whole file).

    Raises:
        OSError: the file cannot be read. ValueError: not JSON, or without step intervals
        (written before they were recorded, or a window without a step). KeyError,
        IndexError, TypeError: malformed step intervals.
    """
    with open(path) as f:
        summary = json.load(f)
    if not isinstance(summary, dict) or not isinstance(summary.get("step_intervals"), dict):
        raise ValueError(f"{path} holds no step intervals (profiled by an older graph_trainer?)")
    kernels, step = unpack_step(summary["step_intervals"])
    return kernels, step, summary


def _gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``[lo, hi]`` that no interval covers."""
    out, at = [], lo
    for a, b in _clip(_union(intervals), lo, hi):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def bands(kernels: list[Kernel], step: tuple[float, float]) -> dict[str, list[tuple[float, float]]]:
    """``{"exposed comm": [...], "idle": [...]}``: the ``(start_us, end_us)`` ranges of
    ``step`` where only communication kernels run, and where no kernel runs. Their lengths
    add up to :func:`timeline_breakdown`'s ``exposed_comm_ms`` and ``idle_ms`` of the step."""
    lo, hi = step
    compute = [(a, b) for a, b, c in kernels if c != "communication"]
    idle = _gaps([(a, b) for a, b, _ in kernels], lo, hi)
    return {"exposed comm": _gaps(compute + idle, lo, hi), "idle": idle}


def _depths(kernels: list[Kernel]) -> list[int]:
    """Nesting depth of each kernel of one lane (CPU ops nest: ``aten::linear`` holds
    ``aten::addmm``), so that inner ones are drawn over outer ones."""
    out, ends = [], []
    for a, b, _ in kernels:
        while ends and ends[-1] <= a:
            ends.pop()
        out.append(len(ends))
        ends.append(b)
    return out


def _draw_step(ax, kernels: list[Kernel], step: tuple[float, float], title: str) -> dict:
    """Draw one step on ``ax``; returns its breakdown plus the bands (ms from the step start)."""
    lo, hi = step
    ms = lambda a, b: ((a - lo) / 1e3, (b - a) / 1e3)  # noqa: E731 -- (x, width) of a bar
    used = set()
    for lane in ("compute", "communication"):
        rows = sorted(((max(a, lo), min(b, hi), c) for a, b, c in kernels
                       if (c == "communication") == (lane == "communication") and b > lo and a < hi),
                      key=lambda k: (k[0], -k[1]))  # an outer op before the ops inside it
        groups: dict[tuple[int, str], list] = {}
        for (a, b, c), d in zip(rows, _depths(rows)):
            groups.setdefault((d, c), []).append(ms(a, b))
        for (_, c), bars in sorted(groups.items(), key=lambda kv: kv[0][0]):
            color = COLORS.get(c, "0.3")
            ax.broken_barh(bars, LANES[lane], facecolors=color, edgecolors=color, linewidth=0.3,
                           label=None if c in used else c)
            used.add(c)
    marked = bands(kernels, step)
    for name, color, label in (("exposed comm", EXPOSED_COLOR, "exposed comm (only communication running)"),
                               ("idle", IDLE_COLOR, "idle (nothing running)")):
        if marked[name]:
            ax.broken_barh([ms(a, b) for a, b in marked[name]], LANES[name], facecolors=color, edgecolors=color,
                           linewidth=0.3, label=label)
    t = timeline_breakdown(kernels, [step])
    ax.set_title(f"{title}: wall {t['wall_ms']:.2f} ms = compute {t['compute_ms']:.2f} + exposed comm "
                 f"{t['exposed_comm_ms']:.2f} + idle {t['idle_ms']:.2f} ms", fontsize=9)
    ax.set_yticks([y + h / 2 for y, h in LANES.values()], list(LANES))
    ax.set_ylim(0, 3.1)
    ax.grid(axis="x", alpha=0.3)
    ranges = lambda v: [((a - lo) / 1e3, (b - lo) / 1e3) for a, b in v]  # noqa: E731
    return {**t, "exposed_ranges_ms": ranges(marked["exposed comm"]), "idle_ranges_ms": ranges(marked["idle"])}


def _save(fig, ax_legend, path: str) -> None:
    import matplotlib.pyplot as plt

    seen: dict = {}
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    order = list(COLORS)  # the categories in a fixed order, unknown ones next, the bands last
    labels = sorted(seen, key=lambda lab: (lab.startswith(("exposed comm", "idle")),
                                           order.index(lab) if lab in order else len(order)))
    handles = [seen[lab] for lab in labels]
    ax_legend.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0)
    fig.axes[-1].set_xlabel("ms from the start of the step")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend sits right of the axes
    plt.close(fig)


def draw_timeline(path: str, kernels: list[Kernel], step: tuple[float, float], title: str = "step") -> dict:
    """Write the picture of one step to ``path`` (PNG).

    Args:
        kernels: ``(start_us, end_us, category)``, categories as
            :func:`graph_trainer.tools.profiling.kernel_category` returns them; the parts outside
            ``step`` are not drawn.
        step: ``(start_us, end_us)`` of the step (the x axis starts at 0 there).
        title: the title's start; the step's wall / compute / exposed-comm / idle ms follow.

    Returns:
        :func:`timeline_breakdown` of the step (ms) plus
        ``"exposed_ranges_ms"`` and ``"idle_ranges_ms"``, the marked ``(start_ms, end_ms)``
        ranges from the step's start, and ``"path"``.

    Raises:
        ImportError: matplotlib is not installed. OSError: ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 3.4))
    out = _draw_step(ax, kernels, step, title)
    ax.set_xlim(0, (step[1] - step[0]) / 1e3)
    _save(fig, ax, path)
    return {**out, "path": path}


def timeline_a_vs_b(path: str, a: str, b: str, labels: tuple[str, str] = ("A", "B")) -> dict:
    """Write two steps, A above B on one x scale, to ``path`` (PNG).

    Args:
        a, b: ``rank<r>_kernels.json`` files of the two runs (their ``"step_intervals"``).
        labels: the row titles' start.

    Returns:
        ``{"path", "A": ..., "B": ...}``, per row what :func:`draw_timeline` returns (less the path).

    Raises:
        OSError, ValueError: as :func:`read_step`. ImportError: matplotlib is not installed.
    """
    steps = [read_step(p) for p in (a, b)]  # errors before any drawing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(14, 6.2), sharex=True)
    out: dict = {"path": path}
    for side, ax, label, (kernels, step, summary) in zip("AB", axes, labels, steps):
        title = f"{side}: {label}, step {summary['step_intervals'].get('step')} ({summary.get('unit', 'device')})"
        out[side] = _draw_step(ax, kernels, step, title)
    axes[0].set_xlim(0, max(s[1][1] - s[1][0] for s in steps) / 1e3)
    _save(fig, axes[0], path)
    return out
