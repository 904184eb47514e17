"""Start the trainer's entry point on N local CPU ranks without run_train.sh (not a test module).

``run_train.sh`` pays, per launch, its pre-check (a Python process importing torchtitan),
torchrun, and per rank a Python process importing torch + torchtitan: about 25 s of CPU
before the first step on a 2-core machine. Tests that are about a layout's numerics, not
about the launcher, start the ranks here instead, as torchrun would (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``,
``OMP_NUM_THREADS=1``), each running ``graph_trainer.train.main(argv)``:

* ``fresh=False`` (default): each rank is forked from one server process that imported the
  trainer once per test session (``multiprocessing``'s forkserver): a new process per
  rank and run, without the imports, with the caller's environment and working folder.
  Every rank of every run inherits the server's interpreter state, including its
  string-hash seed (so run-to-run determinism tests use ``fresh=True``) and what torch
  read from the environment at import (``TORCH_TRACE``: use a new interpreter).
* ``fresh=True``: each rank is a new interpreter (``python -m graph_trainer.train``).

The rendezvous store is served by the calling process (a ``TCPStore`` on a port the kernel
picks, held until every rank has exited; the ranks connect to it as torchrun's workers
connect to its agent's store, ``TORCHELASTIC_USE_AGENT_STORE``): no port is chosen, freed
and bound again later, which another process could take meanwhile.

:func:`spawn` starts the workers of the tests that build their own gloo group
(``torch.multiprocessing.spawn``) from the same server.

The launcher itself (pre-check, torchrun, exit codes, stderr filter) is tested through
run_train.sh: tests/test_preflight.py, tests/test_multinode.py, tests/test_data.py,
tests/test_determinism.py, tests/test_resume.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")
_CTX = None


@dataclass
class Ranks:
    """The outcome of :func:`train_ranks`: the first failing rank's exit code (else 0),
    every rank's exit code, and rank 0's stdout / stderr."""

    returncode: int
    returncodes: list
    stdout: str
    stderr: str


def _store():
    """The ranks' rendezvous store, served here on a port the kernel picks."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _rank_env(rank: int, world: int, port: int) -> dict:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "NGPU": str(world)}


def _forked_rank(env: dict, argv: list, out: str, err: str) -> None:
    """A forked rank: its environment (the caller's, as a subprocess would get it), its
    stdout / stderr into files, then the trainer."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    import torch

    torch.set_num_threads(1)
    from graph_trainer.train import main

    sys.exit(main(argv))


def _forkserver():
    """The forkserver context; its server started (once) with tests/_launch_preload.py
    imported: the server finds it and the repository through PYTHONPATH."""
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["_launch_preload"])
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "tests"), REPO] + ([old] if old else []))
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = old
        _CTX = ctx
    return _CTX


def train_ranks(nranks: int, argv: list, tmp, *, fresh: bool = False, env: dict | None = None,
                timeout: float = 600) -> Ranks:
    """``graph_trainer.train.main(["--job.config_file", <debug config>, *argv])`` on
    ``nranks`` gloo ranks; ``tmp`` a folder for the ranks' logs; ``env`` extra variables
    (over the launcher's: e.g. ``NGPU`` for a dry run).
    Waits for every rank to exit (a failed rank's peers, which may wait for it in a
    collective, are stopped 30 s after it; any rank after ``timeout``). The return code is
    that of the first rank, in rank order, that failed by itself, never that of a rank
    stopped here (whatever the order in which they ended)."""
    os.makedirs(tmp, exist_ok=True)
    argv = ["--job.config_file", DEBUG, *argv]
    store = _store()  # held until every rank has exited
    port = store.port
    logs = [(os.path.join(tmp, f"rank{r}.out"), os.path.join(tmp, f"rank{r}.err")) for r in range(nranks)]
    procs = []
    base = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "CONFIG_FILE")}
    if fresh:
        base["PYTHONPATH"] = REPO + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
        for r, (out, err) in enumerate(logs):
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, "-m", "graph_trainer.train", *argv], cwd=REPO,
                                              env={**base, **_rank_env(r, nranks, port), **(env or {})},
                                              stdout=fo, stderr=fe))
        poll = [p.poll for p in procs]
        kill = [p.kill for p in procs]
    else:
        ctx = _forkserver()
        for r, (out, err) in enumerate(logs):
            p = ctx.Process(target=_forked_rank,
                            args=({**base, **_rank_env(r, nranks, port), **(env or {})}, argv, out, err))
            p.start()
            procs.append(p)
        poll = [(lambda p=p: p.exitcode) for p in procs]
        kill = [p.kill for p in procs]
    deadline, failed_at, stopped = time.monotonic() + timeout, None, set()
    while True:
        codes = [f() for f in poll]
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if time.monotonic() > deadline or (failed_at is not None and time.monotonic() > failed_at + 30):
            for r, (k, c) in enumerate(zip(kill, codes)):
                if c is None:
                    k()
                    stopped.add(r)
        time.sleep(0.1)
    if not fresh:
        for p in procs:
            p.join()
    codes = [f() for f in poll]
    del store
    with open(logs[0][0]) as fo, open(logs[0][1]) as fe:
        out, err = fo.read(), fe.read()
    bad = [c for r, c in enumerate(codes) if c != 0 and r not in stopped] or [c for c in codes if c != 0]
    return Ranks(bad[0] if bad else 0, codes, out, err)


def spawn(fn, args: tuple, nprocs: int):
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` (``fn(i, *args)`` in process ``i``,
    joined; a failure raises), the processes forked from the server of :func:`train_ranks`."""
    import torch.multiprocessing as tmp

    _forkserver()
    tmp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def queue():
    """A queue for the processes of :func:`spawn`."""
    return _forkserver().Queue()
