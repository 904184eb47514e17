"""Start ``graph_trainer.train.main`` on N local CPU ranks, forked from one preloaded server (not a test module)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queues
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing import forkserver
from pathlib import Path
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")
_CTX = None
#: Imported once by the fork server: the trainer and the modules it imports lazily.
PRELOAD = ["torch", "torch._inductor.compile_fx", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor.parallel", "torchtitan.components.checkpoint",
           "torchtitan.components.lr_scheduler", "torchtitan.components.optimizer",
           "torchtitan.hf_datasets.text_datasets", "torchtitan.models.llama3.infra.parallelize",
           "graph_trainer.checkpoint", "graph_trainer.config", "graph_trainer.data", "graph_trainer.metrics",
           "graph_trainer.model", "graph_trainer.distributed.parallelize", "graph_trainer.compiler.passes",
           "graph_trainer.step", "graph_trainer.train"]


def _as_child(env: dict, out: str, err: str) -> None:
    """In a forked process: the caller's environment ``env``, stdout / stderr into the files ``out`` / ``err``."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _forked_rank(env: dict, argv: list, out: str, err: str, n_layers: int | None = None) -> None:
    """A forked rank: :func:`_as_child`, the debug flavor at ``n_layers`` blocks if given, the trainer."""
    _as_child(env, out, err)
    import torch

    torch.set_num_threads(1)
    if n_layers is not None:
        import dataclasses

        from graph_trainer.llama3 import llama3_args

        llama3_args["debugmodel"] = dataclasses.replace(llama3_args["debugmodel"], n_layers=n_layers)
    from graph_trainer.train import main

    sys.exit(main(argv))


def _forkserver():
    """The forkserver context, its server started once (finding the repository through PYTHONPATH) without GPUs:
    its children are CPU ranks and scripts, and torch preloaded with GPUs visible would say CUDA is there."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
        old = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
        with mock.patch.dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests"), REPO, *old]),
                             CUDA_VISIBLE_DEVICES=""):
            forkserver.ensure_running()
    return _CTX


def train_ranks(nranks: int, argv: list, tmp, *, fresh: bool = False, env: dict | None = None, timeout: float = 600,
                n_layers: int | None = None, base_env: dict | None = None) -> subprocess.CompletedProcess:
    """The trainer on ``nranks`` gloo ranks (logs in ``tmp``): first self-failed rank's code or 0, rank 0's output."""
    from torch.distributed import TCPStore

    assert n_layers is None or not fresh, "n_layers: forked ranks only"
    os.makedirs(tmp, exist_ok=True)
    argv = ["--job.config_file", DEBUG, *argv]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # held until every rank exited
    base = {k: v for k, v in (os.environ if base_env is None else base_env).items()
            if k not in ("CONFIG", "CONFIG_FILE")}
    if fresh:
        base["PYTHONPATH"] = os.pathsep.join([REPO] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else []))
    procs, logs = [], [(os.path.join(tmp, f"rank{r}.out"), os.path.join(tmp, f"rank{r}.err")) for r in range(nranks)]
    for r, (out, err) in enumerate(logs):
        rank_env = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nranks),
                    "LOCAL_WORLD_SIZE": str(nranks), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
                    "CUDA_VISIBLE_DEVICES": "", "NGPU": str(nranks), **(env or {})}
        if fresh:
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, "-m", "graph_trainer.train", *argv], cwd=REPO,
                                              env=rank_env, stdout=fo, stderr=fe))
        else:
            procs.append(_forkserver().Process(target=_forked_rank, args=(rank_env, argv, out, err, n_layers)))
            procs[-1].start()
    poll = [p.poll if fresh else (lambda p=p: p.exitcode) for p in procs]
    deadline, failed_at, stopped = time.monotonic() + timeout, None, set()
    while None in (codes := [f() for f in poll]):
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if time.monotonic() > deadline or (failed_at is not None and time.monotonic() > failed_at + 30):
            for r, (p, c) in enumerate(zip(procs, codes)):
                if c is None:
                    p.kill()
                    stopped.add(r)
        time.sleep(0.1)
    for p in procs if not fresh else ():
        p.join()
    del store
    out, err = (Path(f).read_text() for f in logs[0])
    bad = [c for r, c in enumerate(codes) if c != 0 and r not in stopped] or [c for c in codes if c != 0]
    return subprocess.CompletedProcess(argv, bad[0] if bad else 0, out, err)


def _forked_script(env: dict, cwd: str, argv: list, out: str, err: str) -> None:
    """A forked ``python3 <argv>`` in ``cwd``: ``argv[0]`` run as ``__main__``, its folder first on ``sys.path``."""
    _as_child(env, out, err)
    os.chdir(cwd)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


def run_script(argv: list, *, env: dict | None = None, cwd: str = REPO,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python3 <argv>`` forked from the server, as ``subprocess.run(..., capture_output=True, text=True)``."""
    with tempfile.TemporaryDirectory(prefix="run_script") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        p = _forkserver().Process(target=_forked_script, args=(dict(os.environ if env is None else env), str(cwd),
                                                                [str(a) for a in argv], out, err))
        p.start()
        p.join(timeout)
        if timed_out := p.exitcode is None:
            p.kill()
            p.join()
        stdout, stderr = Path(out).read_text(), Path(err).read_text()
    if timed_out:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, p.exitcode, stdout, stderr)


def _call_into(q, fn, args: tuple) -> None:
    """A forked ``fn(*args)``: ``(True, its result)`` or ``(False, the traceback)`` into ``q``."""
    try:
        q.put((True, fn(*args)))
    except BaseException:
        q.put((False, traceback.format_exc()))
        raise


def fork_call(fn, *args, timeout: float = 900):
    """Start ``fn(*args)`` forked from the server: a function awaiting its result, with ``.done()``, ``.kill()``."""
    q = queue()
    p = _forkserver().Process(target=_call_into, args=(q, fn, args))
    p.start()

    def result():
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok, value = q.get(timeout=1 if p.exitcode is None else 10)
                break
            except queues.Empty:
                if p.exitcode is not None or time.monotonic() > deadline:
                    p.kill()
                    raise RuntimeError(f"{fn.__name__}: no result from its forked process (exit code {p.exitcode})")
        p.join()
        if not ok:
            raise RuntimeError(f"{fn.__name__} failed in its forked process:\n{value}")
        return value

    result.done = lambda: p.exitcode is not None or not q.empty()
    result.kill = p.kill
    return result


def spawn(fn, args: tuple, nprocs: int):
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` (joined; a failure raises), forked from the server."""
    import torch.multiprocessing as tmp

    _forkserver()
    tmp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def queue():
    """A queue for the processes of :func:`spawn`."""
    return _forkserver().Queue()
