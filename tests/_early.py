"""Runs started early in processes forked from tests/_launch.py's server while tests go on (not a test module)."""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

import _launch

MARK = "early_job"


class _Run:
    def __init__(self, fn: Callable[[Path, dict], Any] | None, module_file: str, needs: tuple[str, ...] = (),
                 slow: bool = True):
        self.fn, self.module_file, self.needs, self.slow, self.env = fn, module_file, needs, slow, dict(os.environ)
        self.waiter = None  # _launch.fork_call's, once started
        self.outcome: tuple[bool, Any] | None = None  # (ok, value or error), once read


_RUNS: dict[str, _Run] = {}
_QUEUE: list[str] = []  # not started yet, in the order the selected tests read them
_TMP = None  # the session's tmp_path_factory


def job(name: str, fn: Callable[[Path, dict], Any] | None = None, needs: tuple[str, ...] = (), slow: bool = True):
    """Register ``fn(tmp folder, environment)`` as run ``name`` (without ``fn``: a decorator registering the function
    it decorates); ``needs``: runs done before it starts; ``slow``: the tests reading it are marked slow (conftest)."""
    module_file = sys._getframe(1).f_globals["__file__"]

    def register(fn):
        _RUNS.setdefault(name, _Run(fn, module_file, tuple(needs), slow))
        return fn

    return register if fn is None else register(fn)


def uses(name: str):
    """The mark of a test reading run ``name``."""
    return getattr(pytest.mark, MARK)(name)


def is_slow(item) -> bool:
    """Whether the test ``item`` reads a run registered as slow."""
    return any(m.args[0] in _RUNS and _RUNS[m.args[0]].slow for m in item.iter_markers(MARK))


def _in_child(module_file: str, name: str, tmp: str, env: dict, needed: dict) -> Any:
    """In a forked process: import the module that registered ``name`` and run it with the ``needed`` outcomes."""
    _launch._CTX = mp.get_context("fork")
    for dep, outcome in needed.items():
        _RUNS.setdefault(dep, _Run(None, "")).outcome = outcome
    spec = importlib.util.spec_from_file_location(f"_early_{Path(module_file).stem}", module_file)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return _RUNS[name].fn(Path(tmp), env)


def _start(name: str) -> None:
    run = _RUNS[name]
    if name in _QUEUE:
        _QUEUE.remove(name)
    for dep in run.needs:
        with contextlib.suppress(RuntimeError):  # a failed one fails in the run's own read of it
            result(dep)
    needed = {dep: _RUNS[dep].outcome for dep in run.needs}
    run.waiter = _launch.fork_call(_in_child, run.module_file, name, str(_TMP.mktemp("early")), dict(run.env), needed)


def start(items, tmp_factory) -> None:
    """Queue the runs that ``items`` (the selected tests, in order) read; start the first."""
    global _TMP
    _TMP = tmp_factory
    for mark in (m for item in items for m in item.iter_markers(MARK)):
        if mark.args[0] in _RUNS and mark.args[0] not in _QUEUE:
            _QUEUE.append(mark.args[0])
    advance()


def advance(at_most: int = 1) -> None:
    """Start the next queued run while fewer than ``at_most`` started runs are still going (called after each
    test, and with 2 while a test waits for a run: the core the tests leave idle runs the next one)."""
    going = sum(r.waiter is not None and r.outcome is None and not r.waiter.done() for r in _RUNS.values())
    if _QUEUE and going < at_most:
        _start(_QUEUE[0])


def stop() -> None:
    """Start no further run; stop those still going (the session ends)."""
    _QUEUE.clear()
    for run in _RUNS.values():
        if run.waiter is not None and run.outcome is None:
            run.waiter.kill()


def result(name: str) -> Any:
    """The outcome of run ``name``: waits for it, or starts it here if it has not started."""
    run = _RUNS[name]
    if run.outcome is None:
        if run.waiter is None:
            _start(name)
        advance(at_most=2)
        try:
            run.outcome = (True, run.waiter())
        except RuntimeError as e:
            run.outcome = (False, e)
        advance()
    ok, value = run.outcome
    if not ok:
        raise value
    return value

