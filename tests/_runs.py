"""Runs of the debug model for the tests, and those of tests/conftest.py's shared runs (not a test module)."""

import contextlib
import functools
import os
import random
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

from _launch import DEBUG, REPO, train_ranks

#: Small shapes of the shared runs: seq 64, batch 2.
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
#: The ``finished_run`` run (tests/conftest.py): 4 steps at :data:`SMALL`, no Inductor, a full checkpoint every 2 steps.
FINISHED = [*SMALL, "--compile.inductor_compilation", "none", "--checkpoint.enable", "--checkpoint.interval", "2"]
#: The numerics-changing RMSNorm pass.
PASS = "--compile.numerics_changing_optim"
#: The launcher's variables: not inherited by a test's run_train.sh.
LAUNCH_VARS = ("NNODES", "NODE_RANK", "RDZV_ENDPOINT", "NGPU", "CONFIG", "CONFIG_FILE", "COMM_MODE", "LOG_RANK")


def run_debug(dump, small, *flags, steps=4, direct=False, forked=False, fresh=False, ngpu=1, config=None, env=None):
    """The debug config through run_train.sh, ``forked`` / ``fresh`` ranks, or ``direct`` one rank (also ``config``)."""
    args = [*small, "--training.steps", str(steps), "--job.dump_folder", str(dump), *flags]
    assert config is None or direct
    if forked or fresh:
        return train_ranks(ngpu, args, f"{dump}.logs", fresh=fresh, base_env=env)
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != "CONFIG_FILE"} | {"NGPU": str(ngpu)}
    launch = ["bash", "run_train.sh"]
    if direct:
        assert ngpu == 1
        launch = [sys.executable, "-m", "graph_trainer.train", "--job.config_file", config or DEBUG]
    return subprocess.run([*launch, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def train_hashed(dump, *flags, check=True, config=None, **launch):
    """:func:`run_debug` at :data:`SMALL` shapes (or ``config`` as is) with state hashes, launched by ``launch``."""
    r = run_debug(dump, [] if config else SMALL, "--debug.state_hashes", *flags, config=config, **launch)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def bitwise_flags(steps, extra=()):
    """The flags of both runs of :func:`bitwise_runs`: the RMSNorm pass, the whole run's LR schedule, ``extra``."""
    return [PASS, "--lr_scheduler.total_steps", str(steps), *extra]


def bitwise_runs(tmp, ngpu, steps, config=None, extra=(), env=None):
    """Run a (uninterrupted) and b (stopped at steps/2, resumed in a new process): ``(a, b, b's resume)``."""
    from graph_trainer.checkpoint import latest_step

    half, same = steps // 2, bitwise_flags(steps, extra)
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(half), "--checkpoint.no-last_save_model_only"]
    if ngpu == 1 and config is None:
        ckpt += ["--training.dataloader.num_workers", "1"]
    a, b, launch = tmp / "a", tmp / "b", {"direct": True} if ngpu == 1 else {"fresh": True, "ngpu": ngpu}
    launch_a = launch if ngpu == 1 else {"forked": True, "ngpu": ngpu}  # b's ranks: new interpreters
    runs = [functools.partial(train_hashed, a, *same, steps=steps, config=config, env=env, **launch_a),  # never saves
            functools.partial(train_hashed, b, *same, *ckpt, steps=half, config=config, env=env, **launch)]
    if ngpu == 1 and config is None:  # on one CPU rank, a and the first half of b side by side: one core each
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda run: run(), runs))  # a run's failure raised here
    else:  # in this thread: ranks forked from a thread other than the main one may fail at their exit
        for run in runs:
            run()
    assert latest_step(str(b / "checkpoint")) == half
    return a, b, train_hashed(b, *same, *ckpt, steps=steps, config=config, env=env, **launch)


def launch_env(base=None, **launch):
    """The caller's environment (or ``base``) without launcher variables, CPU only, plus ``launch``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in LAUNCH_VARS}
    return {**env, "CUDA_VISIBLE_DEVICES": "", **launch}


def fixed_port() -> int:
    """A free 127.0.0.1 port below the ephemeral range, not 29500, for torchrun's static rendezvous."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:  # not Linux: IANA's ephemeral range
        low = 49152
    for port in random.Random().sample([p for p in range(max(1024, low - 8192), low) if p != 29500], 256):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free port below the ephemeral range")


def train_debug(tmp_path, name, *flags):
    """The debug config trained in this process into ``tmp_path/name`` at seq 64, batch 2: ``read_metrics``'s."""
    from graph_trainer.config import parse_args
    from graph_trainer.metrics import read_metrics
    from graph_trainer.train import train

    train(parse_args(["--job.config_file", DEBUG, "--job.dump_folder", str(out := tmp_path / name), *SMALL, *flags]))
    return read_metrics(str(out / "metrics.jsonl"))


def dry_run_in_process(ngpu, *flags, config=DEBUG) -> dict:
    """The dry run of ``config`` (the debug one) with ``flags`` on ``ngpu`` fake ranks, in this process."""
    import torch.distributed as dist

    from graph_trainer.config import parse_args
    from graph_trainer.projection.dry_run import dry_run

    try:
        with mock.patch.dict(os.environ, NGPU=str(ngpu), CONFIG=os.environ.get("CONFIG", "")):
            return dry_run(parse_args(["--job.config_file", config, *flags]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def dry_run_8b_8_ranks(*flags) -> dict:
    """The dry run of train_configs/llama3_8b.toml with ``flags`` on 8 fake ranks, in this process."""
    return dry_run_in_process(8, *flags, config=os.path.join(REPO, "train_configs", "llama3_8b.toml"))
