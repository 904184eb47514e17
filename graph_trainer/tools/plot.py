"""The tps-per-step plot of a comparison (``tps_per_step.png``).

matplotlib is imported only inside :func:`plot`, so that importing the tools stays
cheap and works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graph_trainer.tools.stats import steady_rows

if TYPE_CHECKING:
    from graph_trainer.tools.runs import Run


def plot(path: str, runs: list[Run], sides: dict, warmup: int) -> str | None:
    """tps per step for every run (A blue, B orange; one line style per repeat), written
    to ``path`` (PNG); the excluded warm-up steps are shaded. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = {"A": "tab:blue", "B": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(9, 5))
    steady_vals = []
    for r in runs:
        if not r.rows:
            continue
        xs = [row["step"] for row in r.rows]
        ys = [row["tps"] for row in r.rows]
        steady_vals += [row["tps"] for row in steady_rows(r.rows, warmup)]
        label = f"{r.side}{r.repeat}: {sides[r.side].label}" + ("" if r.status == "ok" else f" [{r.status}]")
        ax.plot(xs, ys, styles[(r.repeat - 1) % len(styles)], color=colors[r.side], marker=".",
                label=label, alpha=0.9)
    first = max(warmup, 1)
    excluded = "step 1" if first == 1 else f"steps 1..{first}"
    ax.axvspan(0.5, first + 0.5, color="grey", alpha=0.15, label=f"excluded from stats ({excluded})")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if steady_vals:
        lo, hi = min(steady_vals), max(steady_vals)
        pad = max((hi - lo) * 0.3, hi * 0.02)
        ax.set_ylim(max(lo - pad, 0), hi + pad)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title("tps per step: A vs B")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

