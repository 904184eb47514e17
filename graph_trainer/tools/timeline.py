"""A profiled step's timeline: where its wall time goes (:func:`timeline_breakdown`), its compact JSON
form (``rank<r>_kernels.json["step_intervals"]``) and its picture: kernels (on CPU: ATen ops) as bars
coloured by category on a compute and a communication lane, and bands where only communication runs
(exposed) and where nothing runs (idle). No torch; matplotlib only when drawing."""

import json
import statistics

Kernel = tuple[float, float, str]  # (start_us, end_us, category)
Launch = tuple[float, float, str]  # (kernel start_us, its host launch start_us, the host op that launched it)

#: bar colour per kernel category; a category not listed here is drawn dark grey
COLORS = {"matmul": "tab:blue", "attention": "tab:orange", "inductor triton": "tab:green",
          "eager pointwise / reduction": "tab:olive", "copy": "tab:brown", "view / metadata (CPU)": "tab:pink",
          "communication": "tab:purple", "other": "tab:cyan"}
BANDS = {"exposed comm": ("red", "exposed comm (only communication running)"),
         "idle": ("0.7", "idle (nothing running)")}
# y of each lane (bottom, height), top to bottom
LANES = {"compute": (2.1, 0.8), "communication": (1.1, 0.8), "exposed comm": (0.65, 0.3), "idle": (0.2, 0.3)}

#: the rows of :func:`timeline_breakdown` that add up to the wall time, in print order
TIMELINE_ROWS = [("wall_ms", "wall"), ("compute_ms", "compute kernels running"),
                 ("exposed_comm_ms", "only communication running"), ("idle_ms", "nothing running")]
#: further rows (not part of the sum)
TIMELINE_EXTRA_ROWS = [("exposed_head_ms", "(of it: before the first matmul)"),
                       ("exposed_tail_ms", "(of it: after the last matmul)"),
                       ("comm_ms", "(communication running, overlapped or not)")]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _gaps(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of ``[lo, hi]`` that no interval covers."""
    out, at = [], lo
    for a, b in _clip(_union(intervals), lo, hi):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    return out + [(at, hi)] if at < hi else out


def device_steps(host: list[tuple[float, float]], device: list[tuple[float, float]],
                 kernels: list[Kernel]) -> list[tuple[float, float]]:
    """Each step's window on the device, ``(start_us, end_us)``: from where the device finished the work before it
    (the last kernel ending before the step's first; no earlier than the host step's start) to the end of the last
    kernel the host step launched. ``host``: the ``ProfilerStep`` host ranges; ``device``: their device annotations
    (the first to the last kernel each launched), in the same order. The host runs a step ahead of the device (the
    loop reads a step's loss after issuing the next), so its ranges would cut the device's steps. Without device
    annotations (CPU), or not one per host step, the host ranges."""
    if not device or len(device) != len(host):
        return host
    out = []
    for (h0, _), (d0, d1) in zip(host, device):
        before = max((b for _, b, _ in kernels if b <= d0), default=None)
        out.append((d0 if before is None else min(max(h0, before), d0), d1))
    return out


def bands(kernels: list[Kernel], step: tuple[float, float]) -> dict[str, list[tuple[float, float]]]:
    """``{"exposed comm": [...], "idle": [...]}``: the ``(start_us, end_us)`` ranges of ``step``
    where only communication kernels run, and where no kernel runs."""
    lo, hi = step
    idle = _gaps([(a, b) for a, b, _ in kernels], lo, hi)
    return {"exposed comm": _gaps([(a, b) for a, b, c in kernels if c != "communication"] + idle, lo, hi), "idle": idle}


def timeline_breakdown(kernels: list[Kernel], steps: list[tuple[float, float]]) -> dict[str, float]:
    """Where the wall time of each step (``(start_us, end_us)``) goes, from ``(start_us, end_us,
    category)`` kernels; ms, the mean over ``steps`` (zero without): ``wall_ms = compute_ms +
    exposed_comm_ms + idle_ms``, ``comm_ms`` (communication, overlapped or not) and, of the exposed
    time, ``exposed_head_ms`` / ``exposed_tail_ms`` before the first / after the last matmul."""
    out = dict.fromkeys(("wall_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "idle_ms",
                         "exposed_head_ms", "exposed_tail_ms"), 0.0)
    if not steps:
        return out
    comp = _union([(a, b) for a, b, c in kernels if c != "communication"])
    comm = _union([(a, b) for a, b, c in kernels if c == "communication"])
    mms = [(a, b) for a, b, c in kernels if c == "matmul"]
    for lo, hi in steps:
        marked = bands(kernels, (lo, hi))
        exposed = marked["exposed comm"]
        mm = _clip(mms, lo, hi)
        first, last = min((a for a, _ in mm), default=hi), max((b for _, b in mm), default=hi)
        for key, us in (("wall_ms", hi - lo), ("compute_ms", _length(_clip(comp, lo, hi))),
                        ("comm_ms", _length(_clip(comm, lo, hi))), ("exposed_comm_ms", _length(exposed)),
                        ("idle_ms", _length(marked["idle"])), ("exposed_head_ms", _length(_clip(exposed, lo, first))),
                        ("exposed_tail_ms", _length(_clip(exposed, last, hi)))):
            out[key] += us / 1e3
    return {k: v / len(steps) for k, v in out.items()}


def collective_breakdown(kernels: list[Kernel], collectives: list[Kernel],
                         steps: list[tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Per label of ``collectives`` (``(start_us, end_us, label)``) the mean per step of ``ms``,
    ``exposed_ms`` (while no compute kernel runs; collectives in flight together each count it) and
    ``launches``, by descending ``exposed_ms``."""
    comp = [(a, b) for a, b, c in kernels if c != "communication"]
    out: dict[str, dict[str, float]] = {}
    for lo, hi in steps:
        idle_compute = _gaps(comp, lo, hi)  # where no compute kernel runs
        for label in sorted({c for _, _, c in collectives}):
            if not (mine := _clip([(a, b) for a, b, c in collectives if c == label], lo, hi)):
                continue
            row = out.setdefault(label, {"ms": 0.0, "exposed_ms": 0.0, "launches": 0.0})
            ms = _length(_union(mine))
            row["ms"] += ms / 1e3  # exposed: |mine ∩ idle_compute| = |mine| + |idle_compute| - |mine ∪ idle_compute|
            row["exposed_ms"] += (ms + _length(idle_compute) - _length(_union(mine + idle_compute))) / 1e3
            row["launches"] += len(mine)
    rows = {k: {key: v / max(len(steps), 1) for key, v in row.items()} for k, row in out.items()}
    return dict(sorted(rows.items(), key=lambda kv: (-kv[1]["exposed_ms"], kv[0])))


def idle_causes(kernels: list[Kernel], launches: list[Launch], steps: list[tuple[float, float]], top: int = 5) -> dict:
    """Why the device idles: each gap of a step where no kernel runs (:func:`bands`) is charged by the kernel
    that ends it, whose host launch ``launches`` gives (``(kernel_start_us, launch_us, host_op)``, matched on the
    kernel's start). ``host_ms``: that kernel was launched after the gap began, the device waited for the host
    (``by_host_op``: ms per op that launched it, the ``top`` largest); ``queued_ms``: launched before, it waited
    for another stream, an event or a peer; ``tail_ms``: no kernel follows before the step's end; ``unknown_ms``:
    no launch recorded. ``lead_ms``: the upper median over the steps' kernels of launch-to-start time (how far
    the host runs ahead; near 0 where it is the bottleneck). ms, means per step; all zero without steps."""
    out = dict.fromkeys(("host_ms", "queued_ms", "tail_ms", "unknown_ms", "lead_ms"), 0.0)
    if not steps:
        return {**out, "by_host_op": {}}
    first_launch: dict[float, tuple[float, str]] = {}
    for start, launch, op in launches:  # kernels starting together: the earliest launch
        if start not in first_launch or launch < first_launch[start][0]:
            first_launch[start] = (launch, op)
    by_op, leads = {}, []
    for lo, hi in steps:
        leads += [start - launch for start, launch, _ in launches if lo <= start < hi]
        for a, b in bands(kernels, (lo, hi))["idle"]:
            ms = (b - a) / 1e3
            if b >= hi:
                out["tail_ms"] += ms
            elif b not in first_launch:
                out["unknown_ms"] += ms
            elif first_launch[b][0] > a:
                out["host_ms"] += ms
                by_op[first_launch[b][1]] = by_op.get(first_launch[b][1], 0.0) + ms
            else:
                out["queued_ms"] += ms
    n = len(steps)
    out = {k: v / n for k, v in out.items()}
    out["lead_ms"] = statistics.median_high(leads) / 1e3 if leads else 0.0
    return {**out, "by_host_op": {op: ms / n for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]}}


def pack_step(kernels: list[Kernel], step: tuple[float, float], step_num: int | None = None) -> dict:
    """One step's kernels, compact: ``{"step": step_num, "wall_ms", "categories": [name, ...], "kernels":
    [[start_ms, dur_ms, category index], ...]}``, from the step's start, 0.1 us, clipped, sorted."""
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
    Raises KeyError, IndexError, TypeError for a malformed dict."""
    cats = packed["categories"]
    return [(a * 1e3, (a + d) * 1e3, cats[i]) for a, d, i in packed["kernels"]], (0.0, packed["wall_ms"] * 1e3)


def read_step(path: str) -> tuple[list[Kernel], tuple[float, float], dict]:
    """``(kernels, step, summary)`` of a ``rank<r>_kernels.json``. Raises OSError (unreadable),
    ValueError (not JSON, or no step intervals), KeyError, IndexError, TypeError (malformed)."""
    with open(path) as f:
        summary = json.load(f)
    if not isinstance(summary, dict) or not isinstance(summary.get("step_intervals"), dict):
        raise ValueError(f"{path} holds no step intervals (profiled by an older graph_trainer?)")
    return (*unpack_step(summary["step_intervals"]), summary)


def _depths(kernels: list[Kernel]) -> list[int]:
    """Nesting depth of each kernel of one lane (CPU ops nest), so inner ones are drawn on top."""
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
    for lane in ("compute", "communication"):
        rows = sorted(((max(a, lo), min(b, hi), c) for a, b, c in kernels
                       if (c == "communication") == (lane == "communication") and b > lo and a < hi),
                      key=lambda k: (k[0], -k[1]))  # an outer op before the ops inside it
        groups: dict[tuple[int, str], list] = {}
        for (a, b, c), d in zip(rows, _depths(rows)):
            groups.setdefault((d, c), []).append(((a - lo) / 1e3, (b - a) / 1e3))  # (x, width) in ms
        for (_, c), bars in sorted(groups.items(), key=lambda kv: kv[0][0]):
            color = COLORS.get(c, "0.3")
            ax.broken_barh(bars, LANES[lane], facecolors=color, edgecolors=color, linewidth=0.3, label=c)
    marked = bands(kernels, step)
    for name, (color, label) in BANDS.items():
        if marked[name]:
            ax.broken_barh([((a - lo) / 1e3, (b - a) / 1e3) for a, b in marked[name]], LANES[name],
                           facecolors=color, edgecolors=color, linewidth=0.3, label=label)
    t = timeline_breakdown(kernels, [step])
    ax.set_title(f"{title}: wall {t['wall_ms']:.2f} ms = compute {t['compute_ms']:.2f} + exposed comm "
                 f"{t['exposed_comm_ms']:.2f} + idle {t['idle_ms']:.2f} ms", fontsize=9)
    ax.set_yticks([y + h / 2 for y, h in LANES.values()], list(LANES))
    ax.set_ylim(0, 3.1)
    ax.grid(axis="x", alpha=0.3)
    return {**t, **{f"{key}_ranges_ms": [((a - lo) / 1e3, (b - lo) / 1e3) for a, b in marked[name]]
                    for key, name in (("exposed", "exposed comm"), ("idle", "idle"))}}


def _draw(path: str, steps: list[tuple[list[Kernel], tuple[float, float], str]]) -> list[dict]:
    """One row per ``(kernels, step, title)``, on one x scale, to ``path`` (PNG)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 0.6 + 2.8 * len(steps)))
    axes = fig.subplots(len(steps), 1, sharex=True, squeeze=False)[:, 0]
    out = [_draw_step(ax, *s) for ax, s in zip(axes, steps)]
    axes[0].set_xlim(0, max(hi - lo for _, (lo, hi), _ in steps) / 1e3)
    handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
    order = list(COLORS) + [label for _, label in BANDS.values()]  # unknown categories before the bands
    labels = sorted(handles, key=lambda lab: order.index(lab) if lab in order else len(COLORS) - 0.5)
    axes[0].legend([handles[lab] for lab in labels], labels, fontsize=7, loc="upper left",
                   bbox_to_anchor=(1.005, 1.0), borderaxespad=0)
    axes[-1].set_xlabel("ms from the start of the step")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend sits right of the axes
    return out


def draw_timeline(path: str, kernels: list[Kernel], step: tuple[float, float], title: str = "step") -> dict:
    """Draw one step (``(start_us, end_us)``) to ``path`` (PNG). Returns :func:`timeline_breakdown` plus
    ``"exposed_ranges_ms"``, ``"idle_ranges_ms"`` (from the step's start) and ``"path"``. Raises
    ImportError without matplotlib, OSError."""
    return {**_draw(path, [(kernels, step, title)])[0], "path": path}


def timeline_a_vs_b(path: str, a: str, b: str, labels: tuple[str, str] = ("A", "B")) -> dict:
    """Draw the steps of two ``rank<r>_kernels.json`` files, A above B on one x scale, to ``path``. Returns
    ``{"path", "A", "B"}`` (rows as :func:`draw_timeline`'s). Raises as :func:`read_step`, :func:`draw_timeline`."""
    rows = []
    for side, label, p in zip("AB", labels, (a, b)):
        kernels, step, summary = read_step(p)
        rows.append((kernels, step, f"{side}: {label}, step {summary['step_intervals'].get('step')} "
                                    f"({summary.get('unit', 'device')})"))
    drawn = _draw(path, rows)
    return {"path": path, "A": drawn[0], "B": drawn[1]}
