"""Runs that tests start early (not a test module). A test module registers a run with :func:`job`
and marks the tests reading it with :func:`uses`; a test takes the outcome with :func:`result`, which
runs it in the test's own thread the first time. With :data:`BACKGROUND` (off) tests/conftest.py
would start the selected tests' runs after collection on a background thread instead.

A run gets its own temporary folder and the environment of the session's start (taken when it is
registered, at collection), never what a test has monkeypatched meanwhile; its outcome is whatever
the function returns (checked by the tests, as before)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

MARK = "early_job"


class _Run:
    def __init__(self, fn: Callable[[Path, dict], Any]):
        self.fn, self.env = fn, dict(os.environ)
        self.claimed, self.lock, self.done = False, threading.Lock(), threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def claim(self) -> bool:
        with self.lock:
            claimed, self.claimed = self.claimed, True
            return not claimed

    def run(self, tmp_factory) -> None:
        try:
            self.value = self.fn(Path(tmp_factory.mktemp("early")), dict(self.env))
        except BaseException as e:  # raised again in the test that reads it
            self.error = e
        finally:
            self.done.set()


_RUNS: dict[str, _Run] = {}
_TMP = None  # the session's tmp_path_factory
_stop = threading.Event()


def job(name: str, fn: Callable[[Path, dict], Any]) -> None:
    """Register ``fn(tmp folder, environment)`` as run ``name`` (at a test module's import)."""
    _RUNS.setdefault(name, _Run(fn))


def uses(name: str):
    """The mark of a test reading run ``name``."""
    return getattr(pytest.mark, MARK)(name)


#: Start the runs on a background thread at collection. Off: each run starts in the first test that
#: reads it. On, a fresh-clone suite aborted (a fatal error in the main thread while the background
#: thread started a forked script); not root-caused.
BACKGROUND = False


def start(items, tmp_factory) -> None:
    """Start the runs that ``items`` (the selected tests, in order) use, on one background thread
    (only with :data:`BACKGROUND`)."""
    global _TMP
    _TMP = tmp_factory
    if not BACKGROUND:
        return
    names = []
    for item in items:
        for mark in item.iter_markers(MARK):
            if mark.args[0] in _RUNS and mark.args[0] not in names:
                names.append(mark.args[0])
    if not names:
        return
    from _launch import _forkserver

    _forkserver()  # started here, in the main thread, before any run forks from it

    def work():
        for name in names:
            if _stop.is_set():
                return
            if _RUNS[name].claim():
                _RUNS[name].run(_TMP)

    threading.Thread(target=work, name="early-runs", daemon=True).start()


def stop() -> None:
    """Start no further run (the session ends)."""
    _stop.set()


def result(name: str, tmp_factory=None) -> Any:
    """The outcome of run ``name``: waits for it, or runs it here if it has not started."""
    run = _RUNS[name]
    if run.claim():
        run.run(tmp_factory or _TMP)
    run.done.wait()
    if run.error is not None:
        raise run.error
    return run.value


def reading(value: Any) -> Any:
    """``value``, a reading a run took between its steps, or raise it when the run stored the
    exception that reading met instead."""
    if isinstance(value, Exception):
        raise value
    return value


def readings(steps: list, run: Callable[[Any], Any]) -> list:
    """``(run(args), read())`` for each ``(args, read)`` of ``steps``, in order: each reading is taken
    right after its run, before the next changes the folder; a reading that raises is stored as
    its exception (:func:`reading` raises it in the test, after the test's checks of the run)."""
    out = []
    for args, read in steps:
        r = run(args)
        try:
            out.append((r, read()))
        except Exception as e:  # noqa: BLE001
            out.append((r, e))
    return out
