"""One ``run_train.sh`` run of a side: its command, progress line, log, timeout, result.

:func:`execute` streams a run's output to its log and to a one-line progress display
(parsed from the trainer's ``step:`` lines), reads its ``metrics.jsonl`` afterwards and
records the outcome on the :class:`Run`. A run is stopped together with its process
tree (torchrun and its workers, which sit in their own process groups): SIGTERM to the
group, then SIGKILL to whatever of the tree is left (Linux ``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from graph_trainer.metrics import read_metrics
from graph_trainer.tools.sides import Side, child_env
from graph_trainer.tools.stats import run_stats

LOG_TAIL_LINES = 40

# The trainer's console line of one step (graph_trainer.metrics.MetricsLogger).
STEP_RE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+).*?tps:\s*(?P<tps>[\d,.]+)"
    r"(?:.*?mfu:\s*(?P<mfu>\S+))?"
)


@dataclass
class Run:
    """One run of a side: its command and folders, then its outcome and metrics rows."""

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
        """Every field, for the tools' JSON output."""
        return dict(self.__dict__)


class Progress:
    """One compact progress line per step; overwritten in place on a terminal."""

    def __init__(self, stream=sys.stdout):
        self.stream = stream
        self.tty = stream.isatty()
        self.open = False

    def update(self, text: str) -> None:
        """Show ``text`` as the current progress line."""
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, text: str | None = None) -> None:
        """End the progress line; print ``text`` as a line that stays."""
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
        proc = timer = None
        try:
            with _interrupts_deferred():  # a Ctrl-C lands once `proc` is known: the run is stopped
                proc = subprocess.Popen(run.cmd, cwd=side.root, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, bufsize=1,
                                        errors="replace", start_new_session=True)
            if timeout:
                def _kill():
                    timed_out.set()
                    _terminate(proc)
                timer = threading.Timer(timeout, _kill)
                timer.daemon = True
                timer.start()
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    progress.done()
                    sys.stdout.write(line)
                m = STEP_RE.search(line)
                if m and "summary" not in line:
                    mfu = m.group("mfu") or "n/a"
                    note = " (excluded)" if int(m.group("step")) <= max(warmup, 1) else ""
                    progress.update(
                        f"{prefix} step {m.group('step')}/{steps}{note}  loss {m.group('loss')}  "
                        f"tps {m.group('tps')}  mfu {mfu}"
                    )
            proc.wait()
        except BaseException:  # Ctrl-C: stop the run (torchrun forwards SIGTERM to its workers)
            if proc is not None:
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


@contextlib.contextmanager
def _interrupts_deferred(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
    """Hold ``signums`` back inside the block, then deliver them to the handlers that were
    installed before it. Around the start of a run: a Ctrl-C (or SIGTERM) that arrives
    while ``Popen`` forks would otherwise raise before the caller knows the run's process,
    and the run (in its own session) would be left running. Holds nothing back outside the
    main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in dict.fromkeys(pending):
            signal.raise_signal(s)


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
    """The last ``n`` lines of the log at ``path``; ``(no log)`` if it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


