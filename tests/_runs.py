"""Run the debug model for the record / resume tests; the flags of the shared runs of
tests/conftest.py (not a test module)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")
#: The ``finished_run`` fixture (tests/conftest.py): 4 steps of the debug model at seq 64,
#: batch 2, no Inductor, a full checkpoint every 2 steps (the project's default for the last one).
FINISHED = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--compile.inductor_compilation", "none",
            "--checkpoint.enable", "--checkpoint.interval", "2"]


def run_debug(dump, small, *flags, steps=4, direct=False, forked=False):
    """``run_train.sh`` on the debug config with ``small`` then ``flags`` (torchrun; a worker's
    user error exits 2), or the trainer's own entry point in one process (exit 2 on bad
    input, no launcher pre-check): with ``direct`` a new interpreter (``python -m
    graph_trainer.train``), with ``forked`` a process forked from tests/_launch.py's server
    (rank 0's logs beside ``dump``). Returns an object with ``returncode``, ``stdout`` and
    ``stderr``."""
    if forked:
        from _launch import train_ranks

        return train_ranks(1, [*small, "--training.steps", str(steps), "--job.dump_folder", str(dump), *flags],
                           f"{dump}.logs")
    env = {**os.environ, "NGPU": "1"}
    env.pop("CONFIG_FILE", None)
    launch = ["bash", "run_train.sh"]
    if direct:
        launch = [sys.executable, "-m", "graph_trainer.train", "--job.config_file", DEBUG]
    return subprocess.run(
        [*launch, *small, "--training.steps", str(steps), "--job.dump_folder", str(dump), *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )


#: The launcher's variables: not inherited by a test's run_train.sh.
LAUNCH_VARS = ("NNODES", "NODE_RANK", "RDZV_ENDPOINT", "NGPU", "CONFIG", "CONFIG_FILE", "COMM_MODE", "LOG_RANK")


def launch_env(**launch):
    """The caller's environment without launcher variables, CPU only (two "hosts" on one
    machine must not share its GPUs), plus ``launch``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "CUDA_VISIBLE_DEVICES": "", **launch}


def fixed_port() -> int:
    """A TCP port of 127.0.0.1 that is free now, below the kernel's ephemeral range (and not
    torchrun's default 29500), for a server that a test cannot start itself (torchrun's
    static rendezvous on the NODE_RANK=0 host): no socket bound to port 0 or opened by a
    connect() is given it meanwhile."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:  # not Linux: IANA's ephemeral range
        low = 49152
    for port in random.Random().sample(range(max(1024, low - 8192), low), 256):
        if port == 29500:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def fsdp4_flags():
    """The debug model's FSDP4 run of tests/test_multinode.py and tests/test_parallel_layouts.py:
    2 steps, seq 64, batch 2 per rank."""
    return ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--parallelism.data_parallel_shard_degree", "4"]


def dry_run_8b_8_ranks(*flags) -> dict:
    """``graph_trainer.projection.dry_run`` of train_configs/llama3_8b.toml with ``flags`` on 8 fake ranks,
    in this process (``NGPU=8`` for the call; the fake process group destroyed after)."""
    import torch.distributed as dist

    from graph_trainer.config import parse_args
    from graph_trainer.projection.dry_run import dry_run

    os.environ.setdefault("CONFIG", "")
    cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "llama3_8b.toml"), *flags])
    old = os.environ.get("NGPU")
    os.environ["NGPU"] = "8"
    try:
        return dry_run(cfg)
    finally:
        if old is None:
            os.environ.pop("NGPU")
        else:
            os.environ["NGPU"] = old
        if dist.is_initialized():
            dist.destroy_process_group()
