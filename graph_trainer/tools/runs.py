"""One ``run_train.sh`` run of a side: command, progress line, log, timeout, process-tree stop, result."""

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
from graph_trainer.tools.sides import Side, child_env, forced_flags
from graph_trainer.tools.stats import fmt_value, profiler_steps, run_stats

LOG_TAIL_LINES = 40

# The trainer's console line of one step (graph_trainer.metrics.MetricsLogger).
STEP_RE = re.compile(r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+).*?tps:\s*(?P<tps>[\d,.]+)"
                     r"(?:.*?mfu:\s*(?P<mfu>\S+))?")


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
    step2_s: float | None = None  # seconds from the launch to step 2's log line: the start-up, compile included
    rows: list[dict] = field(default_factory=list)
    summary: dict | None = None
    stats: dict | None = None
    excluded: tuple[int, ...] = ()  # steps left out of the stats besides the warm-up (the profiler's)


class Progress:
    """One progress line, overwritten in place on a terminal (one line per update otherwise)."""

    def __init__(self, stream=sys.stdout):
        self.stream, self.open = stream, False

    def update(self, text: str) -> None:
        self.done()
        self.open = self.stream.isatty()
        self.stream.write(text if self.open else text + "\n")
        self.stream.flush()

    def done(self, text: str | None = None) -> None:
        """End the progress line; print ``text`` as a line that stays."""
        self.stream.write(("\r\033[K" if self.open else "") + (text + "\n" if text else ""))
        self.stream.flush()
        self.open = False


def execute(run: Run, side: Side, steps: int, warmup: int, prefix: str, verbose: bool,
            timeout: float | None, progress: Progress) -> None:
    """Run ``run.cmd`` in the side's tree, its output to ``run.log`` and the progress line; then set
    ``run``'s status, error, rows and stats. A timeout or Ctrl-C (re-raised) stops its process tree."""
    os.makedirs(os.path.dirname(run.log), exist_ok=True)
    t0 = time.perf_counter()
    timed_out = threading.Event()
    with open(run.log, "w") as log:
        print(f"$ {shlex.join(run.cmd)}\n# cwd {side.root}; CONFIG_FILE={side.config_file}", file=log, flush=True)
        proc = timer = None
        try:
            with _interrupts_deferred():  # a Ctrl-C lands once `proc` is known, so the run is stopped
                proc = subprocess.Popen(run.cmd, cwd=side.root, env=child_env(side), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, bufsize=1,
                                        errors="replace", start_new_session=True)
            if timeout:
                timer = threading.Timer(timeout, lambda: (timed_out.set(), _terminate(proc)))
                timer.daemon = True
                timer.start()
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    progress.done()
                    sys.stdout.write(line)
                m = STEP_RE.search(line)
                if m and "summary" not in line:
                    step = int(m.group("step"))
                    if step == 2 and run.step2_s is None:
                        run.step2_s = time.perf_counter() - t0
                    note = " (excluded)" if step <= max(warmup, 1) or step in run.excluded else ""
                    progress.update(f"{prefix} step {m.group('step')}/{steps}{note}  loss {m.group('loss')}  "
                                    f"tps {m.group('tps')}  mfu {m.group('mfu') or 'n/a'}")
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
    path = os.path.join(run.dump_folder, "metrics.jsonl")
    read_error = summary = None
    try:  # a failed run keeps the steps it logged, for the plot
        run.rows, summary = read_metrics(path)
    except (OSError, ValueError) as e:
        read_error = e
    if timed_out.is_set():
        run.status, run.error = "failed", f"timed out after {timeout:.0f}s"
    elif proc.returncode != 0:
        cause, run.input_error = failure_cause(run.log)
        run.status, run.error = "failed", f"exit code {proc.returncode}" + (f": {cause}" if cause else "")
    elif read_error is not None:
        run.status, run.error = "failed", f"could not read {path}: {read_error}"
    else:
        run.summary, run.stats = summary, run_stats(run.rows, warmup, run.excluded)
        if not run.stats["steady_steps"]:
            run.status, run.error = "failed", f"no steps after the warm-up (and the profiler's) in {path}"
        elif run.stats["tps"] is None:
            run.status, run.error = "failed", f"no tps values in {path}"
        else:
            run.status = "ok"


@contextlib.contextmanager
def _interrupts_deferred(signums=(signal.SIGINT, signal.SIGTERM)):
    """Hold ``signums`` back inside the block (a Ctrl-C while ``Popen`` forks would leave the run, in
    its own session, running), then deliver them to the previous handlers. Main thread only."""
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
    """(pid, start time) of every descendant of ``pid`` (Linux /proc)."""
    try:
        procs = {p: st for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if (st := _proc_stat(p))}
    except OSError:
        return []
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        out += [(p, st[1]) for p, st in procs.items() if st[0] == parent]
        todo += [p for p, st in procs.items() if st[0] == parent]
    return out


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (torchrun forwards it to its workers, in their own groups),
    after 15 s SIGKILL to what is left of the tree (a pid only while its start time is unchanged)."""
    tree = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    for pid, start in tree:
        st = _proc_stat(pid)
        if st and st[1] == start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def failure_cause(path: str) -> tuple[str | None, bool]:
    """(the reason in a failed run's log, whether it is the trainer's input error): the first ``error:
    ...`` line (it would fail again), else the last ``SomethingError: ...`` before torchrun's report."""
    try:
        with open(path, errors="replace") as f:
            lines = [re.sub(r"^\[rank\d+\]:", "", l).strip() for l in f]
    except OSError:
        return None, False
    if errors := [l[len("error: "):] for l in lines if l.startswith("error: ")]:
        return errors[0], True
    lines = lines[:next((i for i, l in enumerate(lines) if "ChildFailedError" in l), len(lines))]
    causes = [l for l in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b.*:", l)]
    return (causes[-1] if causes else None), False


def tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of the log at ``path``; ``(no log)`` if it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def plan_runs(order: list[tuple[str, int]], sides: dict, extra: list[str], steps: int, out: str,
              profile_step: int | None) -> list[Run]:
    """One :class:`Run` per ``(side, repeat)`` of ``order``: the side's ``run_train.sh`` with its flags, ``extra``, the
    forced flags and the profiler on ``profile_step`` (if any); dump folder ``<out>/runs/<side><repeat>``."""
    profile = ["--profiling.enable_profiling", "--profiling.profile_freq", str(profile_step),
               "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1"] if profile_step else []
    runs = []
    for i, (name, rep) in enumerate(order, 1):
        dump = os.path.join(out, "runs", f"{name}{rep}")
        cmd = ["bash", os.path.join(sides[name].root, "run_train.sh"), *sides[name].flags, *extra,
               *forced_flags(steps, dump), *profile]
        runs.append(Run(side=name, repeat=rep, index=i, dump_folder=dump, log=dump + ".log", cmd=cmd,
                        excluded=profiler_steps(profile_step)))
    return runs


def next_run_s(walls: dict[str, list[float]], side: str) -> float:
    """Seconds the next run of ``side`` is expected to take, from ``walls`` (side -> its runs' wall seconds, in
    order): 0 before its first run; after one run, that run scaled by the smallest later-to-first ratio of the sides
    that ran twice (the first run of a call fills the compile caches the later ones read), never above it; after
    more, its last run."""
    own = walls.get(side, [])
    if len(own) != 1:
        return own[-1] if own else 0.0
    return own[0] * min([1.0, *(w[-1] / w[0] for w in walls.values() if len(w) > 1 and w[0] > 0)])


def run_all(runs: list[Run], sides: dict, args, name=lambda r: f"{r.side}{r.repeat}", after_each=None) -> bool:
    """Run ``runs`` in order (``args``: steps, warmup, verbose, run_timeout, deadline_s if any), calling
    ``after_each()`` after each; a side's later runs are skipped after an input error of the trainer, or
    when :func:`next_run_s` says they would end past the deadline. True when interrupted (Ctrl-C, SIGTERM)."""
    progress, start, walls, skip, current = Progress(), time.monotonic(), {}, {}, None
    deadline = getattr(args, "deadline_s", None)
    # SIGTERM (`timeout`, a job scheduler) raises KeyboardInterrupt: the finished runs are reported as on Ctrl-C
    previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for run in runs:
            prefix = f"[{run.index}/{len(runs)}] {name(run)}:"
            reason = skip.get(run.side)
            if not reason and deadline and time.monotonic() - start + next_run_s(walls, run.side) > deadline:
                reason = f"--deadline-s {deadline:.0f} would be passed"
            if reason:
                run.status, run.error = "skipped", reason
                progress.done(f"{prefix} skipped: {run.error}")
                continue
            progress.update(f"{prefix} starting")
            current = run
            execute(run, sides[run.side], args.steps, args.warmup, prefix, args.verbose, args.run_timeout, progress)
            current = None
            walls.setdefault(run.side, []).append(run.wall_s or 0.0)
            if run.status == "ok":
                st = run.stats
                progress.done(f"{prefix} ok in {run.wall_s:.0f}s — tps {fmt_value('tps', st['tps'])}, tflops "
                              f"{fmt_value('tflops', st['tflops'])}, MFU {fmt_value('mfu', st['mfu'])}, memory "
                              f"{fmt_value('memory_gib', st['memory_gib'])} (median of steps "
                              f"{st['steady_steps'][0]}..{st['steady_steps'][-1]})")
            else:
                progress.done(f"{prefix} FAILED ({run.error}); last {LOG_TAIL_LINES} lines of {run.log}:")
                print("\n".join("    | " + l for l in tail(run.log).rstrip("\n").splitlines()), flush=True)
                if run.input_error:  # the trainer rejected its input: every repeat would fail
                    skip[run.side] = (f"{run.side}{run.repeat} failed on an input error of the trainer, "
                                      "which would repeat")
            if after_each:
                after_each()
    except KeyboardInterrupt:
        if current is not None:
            current.status, current.error = "interrupted", "interrupted (Ctrl-C or SIGTERM)"
        progress.done("\ninterrupted; reporting the finished runs")
        return True
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    return False


def side_run(name: str, side: Side, extra: list[str], flags: list[str], steps: int, out: str) -> Run:
    """The one run of side ``name`` (loss_compare, numerics_diff), its command printed; dump folder
    ``<out>/<name lower>``."""
    dump = os.path.join(out, name.lower())
    cmd = ["./run_train.sh", *side.flags, *extra, *flags, *forced_flags(steps, dump)]
    print(f"side {name} ({side.label}): {shlex.join(cmd)}", flush=True)
    return Run(side=name, repeat=1, index="AB".index(name), dump_folder=dump, log=dump + ".log", cmd=cmd)
