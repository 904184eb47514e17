"""Compare tps / TFLOPS / MFU / memory between two sides (branches or flag sets).

One command that a reviewer can trust for "main: 6,538 tps, 38.29% MFU — this PR:
6,600 tps, 38.65% MFU"::

    scripts/compare_mfu.py --a main --b HEAD --repeats 3 -- --compile.mode aot_fx_trace
    scripts/compare_mfu.py --a-flags "" --b-flags "--compile.numerics_changing_optim"
    graph-trainer-compare --a main        # B = the working tree as it is (uncommitted changes too)

Sides. Each of A and B is a git ref (``--a REF``: checked out with ``git worktree add
--detach`` into a temporary folder, run from there, removed afterwards), extra
``run_train.sh`` flags (``--a-flags "..."``, shell-quoted), or both. A side given
neither is the working tree of ``--repo`` with no extra flags. Arguments after ``--``
go to ``run_train.sh`` on both sides.

Runs. ``--repeats R`` runs per side, alternating A B A B ... so that drift (thermals,
other jobs) hits both sides. Each run is ``bash <side>/run_train.sh <side flags> <args
after --> --training.steps N --job.dump_folder <out>/runs/<side><k> --metrics.log_freq 1``
with ``PYTHONPATH=<side>``. The environment is inherited (``NGPU``, ``LOG_RANK``,
``CUDA_VISIBLE_DEVICES``, ...); the config is ``--config-file``, else ``CONFIG_FILE``,
else ``CONFIG`` (a config name, as run_train.sh maps it), else
``train_configs/debug_model.toml``. A relative config path is taken from each side's
own tree when it exists there (a ref side runs the ref's version of the config), else
from the current directory.

Statistics. Steps ``1..max(--warmup, 1)`` are excluded (step 1 traces and compiles).
Per run: the median over the remaining steps of tps, tflops and MFU, and the max
memory over all steps. Per side: the median over its successful runs, with the
min-max range. The delta of B vs A (%) is called "real" when ``|delta|`` exceeds the
spread, the larger relative range ``(max - min) / median`` of the two sides' repeats;
else "within noise". With one repeat per side the spread is unknown.

Output (``--out DIR``, default ``./outputs/compare_<timestamp>``): ``comparison.json``
(settings, sides, every run with its per-step rows and log path, the table),
``tps_per_step.png``, ``runs/<side><k>/`` (each run's dump folder, metrics.jsonl) and
``runs/<side><k>.log`` (its full output).

Kernels (``--profile-step N``): every run also records step N with the profiler
(:mod:`graph_trainer.profiling`); the device (on CPU: CPU) milliseconds of that step by
kernel category -- matmul, attention, communication, Inductor Triton, eager pointwise,
copy -- are printed per side (median over its runs) with the difference, and stored as
``comparison.json["kernels"]``. The profiled step stays in the tps medians (one slower
step of many barely moves a median).

Errors before any run starts (exit 2): an unknown ref, a ref that is HEAD while the
working tree has uncommitted changes (you probably meant those changes: commit or
stash, use a side without a ref to run the working tree, or ``--allow-dirty``), flags
that the trainer's config parser rejects (checked with ``python3 -m
graph_trainer.config`` in each side's tree), bad ``--steps`` / ``--warmup``.
A failed run is recorded as failed, its cause and the tail of its log are printed, the
other runs go on; the exit code is then 1. When the cause is the trainer's own input
error (an ``error: ...`` line, e.g. a pass-list conflict that the config pre-check does
not see), the remaining repeats of that side are recorded as skipped, since they would
fail the same way. ``--run-timeout S`` kills a hung run (and its torchrun workers).
Ctrl-C stops the current run and reports the finished ones (exit 130).

Progress: one line per step of the current run (side, repeat, step, loss, tps, MFU),
parsed from the trainer's ``step:`` lines; ``-v`` streams the full output.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# run_train.sh's CONFIG names (kept in sync with run_train.sh / graph_trainer.config).
CONFIG_NAMES = {
    "graph_trainer_llama3_debugmodel": "train_configs/debug_model.toml",
    "graph_trainer_llama3_debug_model": "train_configs/debug_model.toml",
    "graph_trainer_llama3_1b": "train_configs/llama3_1b.toml",
    "graph_trainer_llama3_8b": "train_configs/llama3_8b.toml",
}
DEFAULT_CONFIG = "train_configs/debug_model.toml"
# Flags this tool sets itself; a user value would be silently overridden.
OWNED_FLAGS = {
    "--training.steps": "--steps",
    "--job.dump_folder": "--out",
    "--metrics.log_freq": "(always 1)",
}
METRICS = ("tps", "tflops", "mfu", "memory_gib")
METRIC_TITLES = {"tps": "tps", "tflops": "tflops", "mfu": "MFU", "memory_gib": "memory"}
LOG_TAIL_LINES = 40
ENV_RECORDED = ("NGPU", "CONFIG_FILE", "CONFIG", "LOG_RANK", "MODULE", "COMM_MODE",
                "CUDA_VISIBLE_DEVICES", "PYTHONPATH")

_STEP_RE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+).*?tps:\s*(?P<tps>[\d,.]+)"
    r"(?:.*?mfu:\s*(?P<mfu>\S+))?"
)


class CompareError(Exception):
    """Bad input, found before any run starts (exit code 2)."""


# ---------------------------------------------------------------------------------
# statistics and formatting (pure functions, unit-tested)
# ---------------------------------------------------------------------------------


def steady_rows(rows: list[dict], warmup: int) -> list[dict]:
    """Rows with ``step > max(warmup, 1)``: step 1 (trace + compile) is always excluded."""
    first = max(warmup, 1)
    return [r for r in rows if r.get("step", 0) > first]


def run_stats(rows: list[dict], warmup: int) -> dict:
    """One run's numbers: medians of tps/tflops/mfu over steady steps, max memory.

    ``None`` where a metric is null on every steady step (MFU on CPU).
    """
    steady = steady_rows(rows, warmup)

    def med(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    mem = [r["memory_gib"] for r in rows if r.get("memory_gib") is not None]
    mem_pct = [r["memory_pct"] for r in rows if r.get("memory_pct") is not None]
    return {
        "steady_steps": [r["step"] for r in steady],
        "tps": med("tps"),
        "tflops": med("tflops"),
        "mfu": med("mfu"),
        "memory_gib": max(mem) if mem else None,
        "memory_pct": max(mem_pct) if mem_pct else None,
        "step_time_s": med("step_time_s"),
        "final_loss": rows[-1].get("loss") if rows else None,
    }


def side_stats(per_run: list[dict]) -> dict:
    """Aggregate the per-run stats of one side: median, min, max, n, relative spread."""
    out = {}
    for key in METRICS:
        vals = [s[key] for s in per_run if s.get(key) is not None]
        if not vals:
            out[key] = {"median": None, "min": None, "max": None, "n": 0, "spread_pct": None}
            continue
        med = statistics.median(vals)
        spread = None
        if len(vals) >= 2:
            spread = 100.0 * (max(vals) - min(vals)) / abs(med) if med else None
        out[key] = {"median": med, "min": min(vals), "max": max(vals), "n": len(vals),
                    "spread_pct": spread}
    return out


def delta(a: dict, b: dict) -> dict:
    """B vs A for each metric: ``pct`` change of the medians, the noise ``spread_pct``
    (the larger of the two sides' relative ranges) and a ``verdict``."""
    out = {}
    for key in METRICS:
        ma, mb = a[key]["median"], b[key]["median"]
        if ma is None or mb is None or ma == 0:
            out[key] = {"pct": None, "spread_pct": None, "verdict": "n/a"}
            continue
        pct = 100.0 * (mb - ma) / abs(ma)
        spreads = [a[key]["spread_pct"], b[key]["spread_pct"]]
        if None in spreads:
            spread, verdict = None, "spread unknown: 1 repeat"
            if a[key]["n"] >= 2 or b[key]["n"] >= 2:
                verdict = "spread unknown: a side has 1 successful run"
        else:
            spread = max(spreads)
            verdict = "real" if abs(pct) > spread else "within noise"
        if mb == ma:
            verdict = "no change"
        out[key] = {"pct": pct, "spread_pct": spread, "verdict": verdict}
    return out


def fmt_number(key: str, v: float) -> str:
    """The number alone: ``6,538`` tps, ``378.66`` tflops (4 significant digits below 1),
    ``38.29`` MFU %, ``30.92`` GiB."""
    if key == "tps":
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"
    if key == "tflops":
        return f"{v:,.2f}" if abs(v) >= 1 else f"{v:.4g}"
    return f"{v:.2f}"


_UNITS = {"tps": "", "tflops": "", "mfu": "%", "memory_gib": " GiB"}


def fmt_value(key: str, v: float | None) -> str:
    """The number with its unit (``38.29%``, ``30.92 GiB``); ``n/a`` for None."""
    return "n/a" if v is None else fmt_number(key, v) + _UNITS[key]


def fmt_cell(key: str, s: dict) -> str:
    """``median (min–max)``; just the median for one run; ``n/a`` when null."""
    if s["median"] is None:
        return "n/a"
    if s["n"] < 2:
        return fmt_value(key, s["median"])
    return f"{fmt_value(key, s['median'])} ({fmt_number(key, s['min'])}–{fmt_number(key, s['max'])})"


def fmt_delta(d: dict) -> str:
    if d["pct"] is None:
        return "n/a"
    spread = f", spread {d['spread_pct']:.2f}%" if d["spread_pct"] is not None else ""
    return f"{d['pct']:+.2f}% ({d['verdict']}{spread})"


def markdown_table(labels: dict, stats: dict, deltas: dict | None, runs_ok: dict, repeats: int,
                   no_result: dict | None = None) -> str:
    """The markdown table: one row per side, one delta row (B vs A). ``no_result[side]``
    fills the cells of a side without a successful run ("failed", "interrupted")."""
    no_result = no_result or {}
    cols = [METRIC_TITLES[k] for k in METRICS]
    lines = [
        "| side | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for side in ("A", "B"):
        name = f"{side}: {labels[side]} ({runs_ok[side]}/{repeats} runs)"
        if runs_ok[side] == 0:
            cells = [no_result.get(side, "not run")] * len(METRICS)
        else:
            cells = [fmt_cell(k, stats[side][k]) for k in METRICS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if deltas is not None:
        lines.append("| Δ B vs A | " + " | ".join(fmt_delta(deltas[k]) for k in METRICS) + " |")
    else:
        lines.append("| Δ B vs A | " + " | ".join("n/a" for _ in METRICS) + " |")
    return "\n".join(lines)


def one_liner(labels: dict, stats: dict, runs_ok: dict) -> str:
    """``A (main): 6,538 tps, 378.66 tflops, 38.29% MFU, 30.92 GiB — B (...): ...``."""
    parts = []
    for side in ("A", "B"):
        if runs_ok[side] == 0:
            parts.append(f"{side} ({labels[side]}): no successful run")
            continue
        s = stats[side]
        parts.append(
            f"{side} ({labels[side]}): {fmt_value('tps', s['tps']['median'])} tps, "
            f"{fmt_value('tflops', s['tflops']['median'])} tflops, "
            f"{fmt_value('mfu', s['mfu']['median'])} MFU, "
            f"{fmt_value('memory_gib', s['memory_gib']['median'])}"
        )
    return " — ".join(parts)


# ---------------------------------------------------------------------------------
# sides: refs, worktrees, flags, validation
# ---------------------------------------------------------------------------------


@dataclass
class Side:
    name: str  # "A" or "B"
    ref: str | None
    flags: list[str]
    label: str = ""
    commit: str | None = None
    root: str = ""  # the tree it runs from
    worktree: bool = False
    config_file: str = ""  # as passed to run_train.sh (relative to root, or absolute)
    config_note: str = ""
    dirty: list[str] = field(default_factory=list)  # working-tree sides: uncommitted paths

    def describe(self) -> dict:
        d = {
            "label": self.label, "ref": self.ref, "commit": self.commit, "flags": self.flags,
            "tree": self.root, "worktree": self.worktree, "config_file": self.config_file,
        }
        if not self.worktree:
            d["uncommitted_changes"] = self.dirty
        return d


def _git(repo: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=check)


def default_repo() -> str:
    """The tree holding this package's run_train.sh, else the git top level of the cwd."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(here, "run_train.sh")):
        return here
    r = _git(os.getcwd(), "rev-parse", "--show-toplevel", check=False)
    return r.stdout.strip() if r.returncode == 0 else os.getcwd()


def resolve_ref(repo: str, ref: str) -> str:
    """Full commit sha of ``ref``. Raises CompareError for unknown refs / no git repo."""
    r = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if r.returncode != 0 or not r.stdout.strip():
        inside = _git(repo, "rev-parse", "--git-dir", check=False).returncode == 0
        if not inside:
            raise CompareError(f"--repo {repo} is not a git repository, so ref '{ref}' cannot be checked out.")
        raise CompareError(
            f"unknown git ref '{ref}' in {repo} (git rev-parse --verify '{ref}^{{commit}}' failed). "
            f"Check the branch/tag/sha; `git fetch` if it is a remote branch."
        )
    return r.stdout.strip()


def dirty_paths(repo: str) -> list[str]:
    """Uncommitted changes of the working tree (tracked changes and untracked files)."""
    r = _git(repo, "status", "--porcelain", "--untracked-files=normal", check=False)
    if r.returncode != 0:
        return []
    return [line[3:] for line in r.stdout.splitlines() if line.strip()]


def check_owned_flags(flags: list[str], where: str) -> None:
    for f in flags:
        key = f.split("=", 1)[0]
        if key in OWNED_FLAGS:
            raise CompareError(
                f"{where} sets {key}, which this tool sets for every run; use {OWNED_FLAGS[key]} instead."
            )


def resolve_config(cli_value: str | None, env: dict) -> tuple[str, str]:
    """(config path as given, where it came from). Raises CompareError for unknown CONFIG names."""
    if cli_value:
        return cli_value, "--config-file"
    if env.get("CONFIG_FILE"):
        return env["CONFIG_FILE"], "CONFIG_FILE"
    if env.get("CONFIG"):
        name = env["CONFIG"]
        if name not in CONFIG_NAMES:
            raise CompareError(
                f"CONFIG={name} is not a known config name ({', '.join(sorted(CONFIG_NAMES))}); "
                f"or set CONFIG_FILE / --config-file to a TOML file."
            )
        return CONFIG_NAMES[name], f"CONFIG={name}"
    return DEFAULT_CONFIG, "default"


def config_for_side(config: str, side: Side) -> None:
    """Set ``side.config_file``: relative paths from the side's tree when there, else the cwd."""
    if os.path.isabs(config):
        if not os.path.isfile(config):
            raise CompareError(f"config file '{config}' does not exist.")
        side.config_file, side.config_note = config, "absolute path"
        return
    if os.path.isfile(os.path.join(side.root, config)):
        side.config_file, side.config_note = config, "from the side's tree"
        return
    if os.path.isfile(config):
        side.config_file, side.config_note = os.path.abspath(config), "not in the side's tree; from the current directory"
        return
    raise CompareError(
        f"config file '{config}' exists neither in side {side.name}'s tree ({side.root}) nor in the current directory."
    )


def validate_flags(side: Side, extra: list[str], steps: int, dump: str) -> str | None:
    """Run the trainer's own config check in the side's tree; the error text or None."""
    cmd = ["python3", "-m", "graph_trainer.config", "--job.config_file", side.config_file,
           *side.flags, *extra, *forced_flags(steps, dump)]
    env = child_env(side)
    r = subprocess.run(cmd, cwd=side.root, env=env, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    text = "\n".join(l for l in (r.stderr + r.stdout).splitlines() if "HF assets path" not in l)
    return text.strip() or f"exit code {r.returncode}"


def forced_flags(steps: int, dump: str) -> list[str]:
    return ["--training.steps", str(steps), "--job.dump_folder", dump, "--metrics.log_freq", "1"]


def child_env(side: Side) -> dict:
    env = dict(os.environ)
    env["CONFIG_FILE"] = side.config_file
    env.pop("CONFIG", None)  # resolved into CONFIG_FILE
    env["PYTHONPATH"] = side.root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------


@dataclass
class Run:
    side: str
    repeat: int
    index: int
    dump_folder: str
    log: str
    cmd: list[str] = field(default_factory=list)
    status: str = "pending"  # ok | failed | skipped | interrupted | pending (never started)
    returncode: int | None = None
    error: str | None = None
    input_error: bool = False  # failed on the trainer's own "error: ..." (bad input)
    wall_s: float | None = None
    rows: list[dict] = field(default_factory=list)
    summary: dict | None = None
    stats: dict | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def read_metrics(path: str) -> tuple[list[dict], dict | None]:
    rows, summary = [], None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            if "summary" in obj:
                summary = obj["summary"]
            else:
                rows.append(obj)
    return rows, summary


class Progress:
    """One compact progress line per step; overwritten in place on a terminal."""

    def __init__(self, stream=sys.stdout):
        self.stream = stream
        self.tty = stream.isatty()
        self.open = False

    def update(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, text: str | None = None) -> None:
        if self.open:
            self.stream.write("\r\033[K")
            self.open = False
        if text:
            self.stream.write(text + "\n")
        self.stream.flush()


def execute(run: Run, side: Side, steps: int, warmup: int, prefix: str, verbose: bool,
            timeout: float | None, progress: Progress) -> None:
    """Run one ``run_train.sh``, streaming its output to the log and the progress line."""
    os.makedirs(os.path.dirname(run.log), exist_ok=True)
    env = child_env(side)
    t0 = time.perf_counter()
    timed_out = threading.Event()
    with open(run.log, "w") as log:
        log.write("$ " + shlex.join(run.cmd) + f"\n# cwd {side.root}; CONFIG_FILE={side.config_file}\n")
        log.flush()
        proc = subprocess.Popen(run.cmd, cwd=side.root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1,
                                errors="replace", start_new_session=True)
        timer = None
        if timeout:
            def _kill():
                timed_out.set()
                _terminate(proc)
            timer = threading.Timer(timeout, _kill)
            timer.daemon = True
            timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    progress.done()
                    sys.stdout.write(line)
                m = _STEP_RE.search(line)
                if m and "summary" not in line:
                    mfu = m.group("mfu") or "n/a"
                    note = " (excluded)" if int(m.group("step")) <= max(warmup, 1) else ""
                    progress.update(
                        f"{prefix} step {m.group('step')}/{steps}{note}  loss {m.group('loss')}  "
                        f"tps {m.group('tps')}  mfu {mfu}"
                    )
            proc.wait()
        except BaseException:  # Ctrl-C: stop the run (torchrun forwards SIGTERM to its workers)
            _terminate(proc)
            raise
        finally:
            if timer:
                timer.cancel()
    run.wall_s = time.perf_counter() - t0
    run.returncode = proc.returncode
    if timed_out.is_set() or proc.returncode != 0:  # keep the steps it logged, for the plot
        try:
            run.rows, _ = read_metrics(os.path.join(run.dump_folder, "metrics.jsonl"))
        except (OSError, ValueError):
            pass
    if timed_out.is_set():
        run.status, run.error = "failed", f"timed out after {timeout:.0f}s"
    elif proc.returncode != 0:
        cause, run.input_error = failure_cause(run.log)
        run.status, run.error = "failed", f"exit code {proc.returncode}" + (f": {cause}" if cause else "")
    else:
        path = os.path.join(run.dump_folder, "metrics.jsonl")
        try:
            run.rows, run.summary = read_metrics(path)
        except (OSError, ValueError) as e:
            run.status, run.error = "failed", f"could not read {path}: {e}"
            return
        run.stats = run_stats(run.rows, warmup)
        if not run.stats["steady_steps"]:
            run.status, run.error = "failed", f"no steps after the warm-up in {path}"
        elif run.stats["tps"] is None:
            run.status, run.error = "failed", f"no tps values in {path}"
        else:
            run.status = "ok"


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a process from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19]
    except (OSError, ValueError, IndexError):
        return None


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of the child processes of ``pid``, recursively (Linux /proc)."""
    children: dict[int, list[tuple[int, str]]] = {}
    try:
        entries = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    for p in entries:
        st = _proc_stat(p)
        if st:
            children.setdefault(st[0], []).append((p, st[1]))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c[0])
    return out


def _terminate(proc: subprocess.Popen) -> None:
    """Stop one run: SIGTERM to its process group (torchrun forwards it to the workers,
    which run in their own groups), then SIGKILL to whatever of that process tree is
    still alive after 15 s (a pid is only killed if its start time is unchanged)."""
    tree = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    for pid, start in tree:
        st = _proc_stat(pid)
        if st and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def failure_cause(path: str) -> tuple[str | None, bool]:
    """The reason in a failed run's log and whether it is the trainer's own input error:
    the first ``error: ...`` line (a UserError: deterministic, it would fail again), else
    the last ``SomethingError: ...`` line before torchrun's report."""
    try:
        with open(path, errors="replace") as f:
            lines = [re.sub(r"^\[rank\d+\]:", "", l).strip() for l in f]
    except OSError:
        return None, False
    for l in lines:
        if l.startswith("error: "):
            return l[len("error: "):], True
    cause = None
    for l in lines:
        if "ChildFailedError" in l:
            break
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:", l):
            cause = l
    return cause, False


def tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------
# results: table, json, plot
# ---------------------------------------------------------------------------------


def build_results(sides: dict, runs: list[Run], repeats: int) -> dict:
    per_side = {s: [r.stats for r in runs if r.side == s and r.status == "ok"] for s in ("A", "B")}
    stats = {s: side_stats(per_side[s]) for s in ("A", "B")}
    runs_ok = {s: len(per_side[s]) for s in ("A", "B")}
    runs_failed = {s: sum(r.side == s and r.status in ("failed", "skipped") for r in runs) for s in ("A", "B")}
    no_result = {}
    for s in ("A", "B"):
        if runs_failed[s]:
            no_result[s] = "failed"
        elif any(r.side == s and r.status == "interrupted" for r in runs):
            no_result[s] = "interrupted"
    deltas = delta(stats["A"], stats["B"]) if runs_ok["A"] and runs_ok["B"] else None
    labels = {s: sides[s].label for s in ("A", "B")}
    return {
        "sides": stats,
        "delta_b_vs_a": deltas,
        "runs_ok": runs_ok,
        "runs_failed": runs_failed,
        "markdown": markdown_table(labels, stats, deltas, runs_ok, repeats, no_result),
        "summary": one_liner(labels, stats, runs_ok),
    }


def profile_flags(step: int | None) -> list[str]:
    """run_train.sh flags that record exactly step ``step`` (>= 2) with the profiler: wait
    ``step - 2`` steps, warm up 1, record 1 (the window repeats every ``step`` steps)."""
    if not step:
        return []
    return ["--profiling.enable_profiling", "--profiling.profile_freq", str(step),
            "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1"]


def kernel_comparison(runs: list[Run], labels: dict, step: int) -> dict:
    """Device (CPU on CPU) milliseconds of the profiled step by kernel category, per side.

    Reads ``<dump>/profile_traces/iteration_<step>/rank0_kernels.json`` of every finished
    run (written by :mod:`graph_trainer.profiling`) and takes, per side and category, the
    median over its runs; likewise for the step timeline (wall, compute running, exposed
    communication, idle). Returns ``{"step", "unit", "runs": {side: n}, "sides": {side:
    {category: ms}}, "timeline": {side: {key: ms}}, "markdown"}``; a side without a
    readable summary has no entry.
    """
    from graph_trainer.profiling import TIMELINE_ROWS  # here: the launcher itself imports no torch

    found: dict[str, list[dict]] = {"A": [], "B": []}
    for r in runs:
        path = os.path.join(r.dump_folder, "profile_traces", f"iteration_{step}", "rank0_kernels.json")
        try:
            with open(path) as f:
                found[r.side].append(json.load(f))
        except (OSError, ValueError):
            continue
    unit = next((k.get("unit", "device") for s in found.values() for k in s), "device")
    cats = sorted({c for s in found.values() for k in s for c in k["categories"]})
    sides = {
        s: {c: statistics.median(k["categories"].get(c, {}).get("ms", 0.0) for k in ks) for c in cats}
        for s, ks in found.items() if ks
    }
    for s in sides:
        sides[s]["total"] = sum(sides[s][c] for c in cats)
    order = sorted(cats, key=lambda c: -max(sides[s][c] for s in sides)) if sides else []
    lines = [
        f"{unit} ms of step {step} by kernel category (median over runs; "
        f"runs with a profile: A {len(found['A'])}, B {len(found['B'])})",
        "",
        f"| category | A: {labels['A']} | B: {labels['B']} | Δ B − A |",
        "|---|---:|---:|---:|",
    ]
    def row(label: str, per_side: dict, key: str) -> str:
        a, b = (per_side.get(s, {}).get(key) for s in ("A", "B"))
        d = f"{b - a:+.2f}" if a is not None and b is not None else "n/a"
        cell = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        return f"| {label} | {cell(a)} | {cell(b)} | {d} |"

    for c in order + ["total"]:
        lines.append(row("**total**" if c == "total" else c, sides, c))
    timeline = {
        s: {key: statistics.median(k["timeline"][key] for k in ks) for key, _ in TIMELINE_ROWS}
        for s, ks in found.items() if ks and all(k.get("timeline", {}).get("wall_ms") for k in ks)
    }
    if timeline:
        lines += ["", f"| step timeline | A: {labels['A']} | B: {labels['B']} | Δ B − A |", "|---|---:|---:|---:|"]
        lines += [row(label, timeline, key) for key, label in TIMELINE_ROWS]
    return {"step": step, "unit": unit, "runs": {s: len(v) for s, v in found.items()}, "sides": sides,
            "timeline": timeline, "markdown": "\n".join(lines)}


def write_json(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def plot(path: str, runs: list[Run], sides: dict, warmup: int) -> str | None:
    """tps per step for every run (A blue, B orange; one line style per repeat)."""
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


# ---------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------


def _join_flag_values(argv: list[str]) -> list[str]:
    """``--b-flags --compile.x`` -> ``--b-flags=--compile.x`` (argparse would take the
    value for an option)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--a-flags", "--b-flags") and i + 1 < len(argv) and argv[i + 1] != "--":
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Run run_train.sh for two sides (git refs and/or flag sets), alternating, "
        "and compare tps / tflops / MFU / memory with a noise estimate.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""examples:
  %(prog)s --a main --b HEAD --repeats 3 -- --compile.mode aot_fx_trace
  %(prog)s --a-flags "" --b-flags "--compile.numerics_changing_optim" --repeats 3
  %(prog)s --a main                      # B = the working tree (uncommitted changes included)
  NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml %(prog)s --a main --steps 30 --warmup 5

A side with neither a ref nor flags is the working tree of --repo with no extra flags.
Arguments after -- go to run_train.sh on both sides. The environment (NGPU, CONFIG_FILE,
CONFIG, LOG_RANK, CUDA_VISIBLE_DEVICES, ...) is inherited by every run.
Exit codes: 0 all runs ok; 1 a run failed (the others are still reported; the later
repeats of a side that failed on a trainer input error are skipped); 2 bad input (nothing
was run); 130 interrupted.""",
    )
    p.add_argument("--a", metavar="REF", help="git ref of side A (run from a temporary worktree)")
    p.add_argument("--b", metavar="REF", help="git ref of side B")
    p.add_argument("--a-flags", default=None, metavar="FLAGS",
                   help='extra run_train.sh flags of side A, one shell-quoted string ("" for none)')
    p.add_argument("--b-flags", default=None, metavar="FLAGS", help="extra run_train.sh flags of side B")
    p.add_argument("--a-label", help="name of side A in the table (default: ref@sha / working tree + flags)")
    p.add_argument("--b-label", help="name of side B in the table")
    p.add_argument("--repeats", type=int, default=3, help="runs per side, alternating A B A B (default 3)")
    p.add_argument("--steps", type=int, default=20, help="--training.steps of every run (default 20)")
    p.add_argument("--warmup", type=int, default=3,
                   help="steps 1..W are excluded from the statistics; step 1 always is (default 3)")
    p.add_argument("--config-file", help="TOML config (default: $CONFIG_FILE, $CONFIG, train_configs/debug_model.toml)")
    p.add_argument("--out", help="output folder (default ./outputs/compare_<timestamp>)")
    p.add_argument("--repo", help="git repository / tree to compare (default: the one holding this tool)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="allow a ref side that is HEAD while the working tree has uncommitted changes "
                   "(runs the committed HEAD, not your changes)")
    p.add_argument("--run-timeout", type=float, default=None, metavar="S",
                   help="kill a run after S seconds and record it as failed")
    p.add_argument("--profile-step", type=int, default=None, metavar="N",
                   help="profile step N of every run (--profiling.*) and print device time per step by kernel "
                        "category, A vs B (graph_trainer/profiling.py); the profiled step stays in the medians")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan, run nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="stream every run's full output")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        own, extra = argv[:i], argv[i + 1:]
    else:
        own, extra = argv, []
    return build_parser().parse_args(_join_flag_values(own)), extra


def _split_flags(value: str | None, opt: str) -> list[str]:
    try:
        return shlex.split(value or "")
    except ValueError as e:
        raise CompareError(f"{opt} {value!r} is not a valid shell-quoted string: {e}") from None


def _label(side: Side) -> str:
    base = f"{side.ref}@{side.commit[:8]}" if side.ref else "working tree"
    return base + (" + " + shlex.join(side.flags) if side.flags else "")


def prepare(args: argparse.Namespace, extra: list[str], tmpdir_holder: list) -> dict:
    """Resolve both sides (refs, worktrees, configs) and validate everything. Raises CompareError."""
    if args.repeats < 1:
        raise CompareError(f"--repeats must be >= 1, got {args.repeats}.")
    if args.warmup < 0:
        raise CompareError(f"--warmup must be >= 0, got {args.warmup}.")
    if args.steps <= max(args.warmup, 1):
        raise CompareError(
            f"--steps {args.steps} leaves no step to measure: steps 1..{max(args.warmup, 1)} are "
            f"excluded (--warmup {args.warmup}; step 1 always). Use --steps > {max(args.warmup, 1)}."
        )
    profile_step = getattr(args, "profile_step", None)
    if profile_step is not None and not 2 <= profile_step <= args.steps:
        raise CompareError(f"--profile-step must be in 2..--steps ({args.steps}), got {profile_step}.")
    if args.a is None and args.b is None and args.a_flags is None and args.b_flags is None:
        raise CompareError(
            "nothing to compare: give a ref (--a REF / --b REF) and/or flags (--a-flags / --b-flags) "
            "for at least one side; a side without either is the working tree."
        )
    repo = os.path.abspath(args.repo) if args.repo else default_repo()
    if not os.path.isdir(repo):
        raise CompareError(f"--repo {repo} is not a folder.")
    check_owned_flags(extra, "the arguments after --")
    sides = {}
    for name, ref, flags, label in (("A", args.a, args.a_flags, args.a_label),
                                    ("B", args.b, args.b_flags, args.b_label)):
        fl = _split_flags(flags, f"--{name.lower()}-flags")
        check_owned_flags(fl, f"--{name.lower()}-flags")
        sides[name] = Side(name=name, ref=ref, flags=fl)

    # 1. refs (cheap, git only) and the dirty-tree rule.
    r = _git(repo, "rev-parse", "--verify", "--quiet", "HEAD", check=False)
    head = r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None
    dirty = dirty_paths(repo) if head else []
    refs = [s for s in sides.values() if s.ref is not None]
    if refs:
        for s in refs:
            s.commit = resolve_ref(repo, s.ref)
        at_head = [s for s in refs if s.commit == head]
        if at_head and dirty and not args.allow_dirty:
            names = ", ".join(f"--{s.name.lower()} {s.ref}" for s in at_head)
            shown = ", ".join(dirty[:5]) + (f", ... ({len(dirty)} paths)" if len(dirty) > 5 else "")
            raise CompareError(
                f"{names} {'are' if len(at_head) > 1 else 'is'} HEAD ({head[:8]}), but the working tree has uncommitted changes "
                f"({shown}); the ref side would run the committed HEAD without them. "
                f"Commit or stash, or use flags-only sides (leave out --a/--b for the side that "
                f"should run the working tree), or pass --allow-dirty to run the committed HEAD anyway."
            )
    for s in sides.values():
        if s.ref is None:
            s.root, s.commit, s.dirty = repo, head, dirty[:50]
            if not os.path.isfile(os.path.join(repo, "run_train.sh")):
                raise CompareError(f"{repo} has no run_train.sh; pass --repo with the graph_trainer tree.")
    # 2. worktrees (one per distinct commit).
    if refs:
        tmp = tempfile.mkdtemp(prefix="graph_trainer_compare_")
        tmpdir_holder.append(tmp)
        by_commit: dict[str, str] = {}
        for s in refs:
            if s.commit not in by_commit:
                path = os.path.join(tmp, f"{s.name}_{s.commit[:8]}")
                r = _git(repo, "worktree", "add", "--detach", path, s.commit, check=False)
                if r.returncode != 0:
                    raise CompareError(f"git worktree add for {s.ref} failed: {r.stderr.strip()}")
                tmpdir_holder.append(("worktree", repo, path))
                by_commit[s.commit] = path
            s.root, s.worktree = by_commit[s.commit], True
            if not os.path.isfile(os.path.join(s.root, "run_train.sh")):
                raise CompareError(f"ref {s.ref} ({s.commit[:8]}) has no run_train.sh; it predates the trainer.")
    # 3. config and labels.
    config, config_src = resolve_config(args.config_file, os.environ)
    for s in sides.values():
        config_for_side(config, s)
        s.label = _label(s)
    if args.a_label:
        sides["A"].label = args.a_label
    if args.b_label:
        sides["B"].label = args.b_label
    return {"repo": repo, "head": head, "config": config, "config_source": config_src, "sides": sides}


def validate_sides(sides: dict, extra: list[str], steps: int, dump: str) -> None:
    """The trainer's config check for both sides (in parallel). Raises CompareError."""
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as ex:
        seen = {}
        for s in sides.values():
            key = (s.root, s.config_file, tuple(s.flags))
            if key not in seen:
                seen[key] = ex.submit(validate_flags, s, extra, steps, dump)
            jobs[s.name] = seen[key]
        errors = {n: f.result() for n, f in jobs.items()}
    bad = [n for n in ("A", "B") if errors[n]]
    if bad:
        msgs = []
        for n in bad:
            s = sides[n]
            msgs.append(
                f"side {n} ({s.label}): run_train.sh would reject its flags "
                f"[{shlex.join(s.flags + extra)}]:\n{errors[n]}"
            )
        raise CompareError("\n\n".join(msgs))


def _cleanup(holder: list) -> None:
    """Remove the temporary worktrees (and their folder); prune git's worktree list."""
    repos = set()
    for item in reversed(holder):
        if isinstance(item, tuple) and item[0] == "worktree":
            _, repo, path = item
            _git(repo, "worktree", "remove", "--force", path, check=False)
            repos.add(repo)
        elif isinstance(item, str):
            shutil.rmtree(item, ignore_errors=True)
    for repo in repos:
        _git(repo, "worktree", "prune", check=False)
    holder.clear()


def run_cli(body) -> int:
    """Run ``body(holder) -> exit code`` with this tool's error handling: a CompareError
    prints one paragraph and gives 2, Ctrl-C gives 130; the temporary worktrees that
    ``body`` records in ``holder`` are removed in every case."""
    holder: list = []
    try:
        return body(holder)
    except CompareError as e:
        print(f"\nerror: {e}\n", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        _cleanup(holder)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parse(argv)
    return run_cli(lambda holder: _main(args, extra, argv, holder))


def _main(args, extra, argv, holder) -> int:
    ctx = prepare(args, extra, holder)
    sides: dict[str, Side] = ctx["sides"]
    out = os.path.abspath(args.out or os.path.join(
        "outputs", "compare_" + _dt.datetime.now().strftime("%Y%m%d_%H%M%S")))

    if os.path.isdir(out) and os.listdir(out) and not args.dry_run:
        raise CompareError(f"--out {out} exists and is not empty; choose a new folder so runs do not mix.")

    print(f"compare_mfu: {args.repeats} run(s) per side, alternating A B; {args.steps} steps, "
          f"steps 1..{max(args.warmup, 1)} excluded; config {ctx['config']} ({ctx['config_source']})")
    for s in sides.values():
        if s.worktree:
            where = f"worktree of {s.ref} @ {s.commit[:8]}"
        else:
            where = f"working tree {s.root}" + (f" (HEAD {s.commit[:8]}" + (
                f" + {len(s.dirty)} uncommitted path(s))" if s.dirty else ", clean)") if s.commit else "")
        print(f"  {s.name}: {s.label}\n     {where}; flags: {shlex.join(s.flags) or '(none)'}; "
              f"config {s.config_file} ({s.config_note})")
    if extra:
        print(f"  both: {shlex.join(extra)}")
    env_shown = {k: os.environ[k] for k in ("NGPU", "CUDA_VISIBLE_DEVICES", "LOG_RANK") if k in os.environ}
    if env_shown:
        print("  env: " + " ".join(f"{k}={v}" for k, v in env_shown.items()))
    if sides["A"].root == sides["B"].root and sides["A"].flags == sides["B"].flags:
        print("  note: A and B are identical; this measures run-to-run noise.")
    print("validating both sides' flags with graph_trainer.config ...", flush=True)
    validate_sides(sides, extra, args.steps, os.path.join(out, "runs", "check"))

    runs: list[Run] = []
    order = [(rep, s) for rep in range(1, args.repeats + 1) for s in ("A", "B")]
    for i, (rep, s) in enumerate(order, 1):
        side = sides[s]
        dump = os.path.join(out, "runs", f"{s}{rep}")
        run = Run(side=s, repeat=rep, index=i, dump_folder=dump, log=dump + ".log")
        run.cmd = ["bash", os.path.join(side.root, "run_train.sh"), *side.flags, *extra,
                   *forced_flags(args.steps, dump), *profile_flags(args.profile_step)]
        runs.append(run)
    if args.dry_run:
        print("dry run; would run:")
        for r in runs:
            sd = sides[r.side]
            print(f"  [{r.side}{r.repeat}] (cd {sd.root} && CONFIG_FILE={shlex.quote(sd.config_file)} "
                  f"PYTHONPATH={shlex.quote(sd.root)} {shlex.join(r.cmd)})")
        if any(sd.worktree for sd in sides.values()):
            print("  (the temporary worktree is removed again now; a real run keeps it until the end)")
        return 0

    os.makedirs(out, exist_ok=True)
    print(f"output: {out}", flush=True)
    payload = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": ["compare_mfu.py", *argv],
        "cwd": os.getcwd(),
        "repo": ctx["repo"],
        "head": ctx["head"],
        "config_file": ctx["config"],
        "config_source": ctx["config_source"],
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
        "settings": {"repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
                     "excluded_steps": list(range(1, max(args.warmup, 1) + 1)), "extra_args": extra},
        "sides": {n: s.describe() for n, s in sides.items()},
        "runs": [],
        "table": None,
        "plot": None,
        "ok": False,
    }
    json_path = os.path.join(out, "comparison.json")
    progress = Progress()
    state: dict = {"run": None}
    interrupted = False

    def _sigterm(signum, frame):  # `timeout` / a job scheduler: report the finished runs like Ctrl-C
        raise KeyboardInterrupt

    previous_sigterm = signal.signal(signal.SIGTERM, _sigterm)
    try:
        skip: dict[str, str] = {}
        for run in runs:
            side = sides[run.side]
            prefix = f"[{run.index}/{len(runs)}] {run.side}{run.repeat} ({side.label}):"
            if run.side in skip:
                run.status, run.error = "skipped", skip[run.side]
                progress.done(f"{prefix} skipped: {run.error}")
                continue
            progress.update(f"{prefix} starting")
            state["run"] = run
            execute(run, side, args.steps, args.warmup, prefix, args.verbose, args.run_timeout, progress)
            if run.status == "ok":
                st = run.stats
                progress.done(
                    f"{prefix} ok in {run.wall_s:.0f}s — tps {fmt_value('tps', st['tps'])}, "
                    f"tflops {fmt_value('tflops', st['tflops'])}, MFU {fmt_value('mfu', st['mfu'])}, "
                    f"memory {fmt_value('memory_gib', st['memory_gib'])} "
                    f"(median of steps {st['steady_steps'][0]}..{st['steady_steps'][-1]})"
                )
            else:
                progress.done(f"{prefix} FAILED ({run.error}); last {LOG_TAIL_LINES} lines of {run.log}:")
                print(_indent(tail(run.log)), flush=True)
                if run.input_error:  # the trainer rejected its input: every repeat would fail
                    skip[run.side] = (f"{run.side}{run.repeat} failed on an input error of the trainer, "
                                      f"which would repeat")
            state["run"] = None
            payload["runs"] = [r.to_json() for r in runs if r.status != "pending"]
            write_json(json_path, payload)
    except KeyboardInterrupt:
        interrupted = True
        if state.get("run") is not None:
            state["run"].status, state["run"].error = "interrupted", "interrupted (Ctrl-C or SIGTERM)"
        progress.done("\ninterrupted; reporting the finished runs")
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)

    done = [r for r in runs if r.rows]
    results = build_results(sides, runs, args.repeats)
    payload["runs"] = [r.to_json() for r in runs]
    payload["table"] = results
    try:
        payload["plot"] = os.path.basename(plot(os.path.join(out, "tps_per_step.png"), done, sides, args.warmup))
    except Exception as e:  # the numbers matter more than the picture
        print(f"warning: could not write the plot: {e}", file=sys.stderr)
    failed = [r for r in runs if r.status in ("failed", "skipped")]
    payload["ok"] = not failed and not interrupted
    if args.profile_step:
        payload["kernels"] = kernel_comparison(runs, {s: sides[s].label for s in sides}, args.profile_step)
    write_json(json_path, payload)

    print()
    print(results["markdown"])
    print()
    print(results["summary"])
    if args.repeats == 1:
        print("spread unknown with 1 repeat per side: use --repeats 3 (or more) to tell a real "
              "change from noise.")
    else:
        print('"real": |Δ| exceeds the spread ((max - min) / median) of the repeats of either side; '
              'else "within noise".')
    if payload.get("kernels"):
        print()
        print(payload["kernels"]["markdown"])
    print(f"\nwrote {json_path}" + (f" and {os.path.join(out, payload['plot'])}" if payload["plot"] else ""))
    if failed:
        print(f"{len(failed)} run(s) failed or skipped:", file=sys.stderr)
        for r in failed:
            err = r.error if len(r.error or "") <= 200 else r.error[:197] + "..."
            print(f"  {r.side}{r.repeat}: {r.status}: {err}" + (f" (log {r.log})" if r.status == "failed" else ""),
                  file=sys.stderr)
    if interrupted:
        return 130
    return 1 if failed else 0


def _indent(text: str) -> str:
    return "\n".join("    | " + l for l in text.rstrip("\n").splitlines())


if __name__ == "__main__":
    sys.exit(main())
