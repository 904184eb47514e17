"""Run the debug model for the record / resume tests; the flags of the shared runs of
tests/conftest.py (not a test module)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")
#: The ``finished_run`` fixture (tests/conftest.py): 4 steps of the debug model at seq 64,
#: batch 2, no Inductor, with ``--debug.state_hashes``, a full checkpoint every 2 steps
#: (the project's default for the last one) and the LR schedule of a 6-step run
#: (``--lr_scheduler.total_steps 6``: torchtitan's otherwise depends on ``--training.steps``),
#: so a 6-step run continues it.
FINISHED = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--compile.inductor_compilation", "none",
            "--lr_scheduler.total_steps", "6", "--debug.state_hashes", "--checkpoint.enable", "--checkpoint.interval", "2"]


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


def fsdp4_flags():
    """The debug model's FSDP4 run of tests/test_multinode.py and tests/test_parallel_layouts.py:
    2 steps, seq 64, batch 2 per rank."""
    return ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--parallelism.data_parallel_shard_degree", "4"]


def dry_run_8b_8_ranks(*flags) -> dict:
    """``graph_trainer.dry_run`` of train_configs/llama3_8b.toml with ``flags`` on 8 fake ranks,
    in this process (``NGPU=8`` for the call; the fake process group destroyed after)."""
    import torch.distributed as dist

    from graph_trainer.config import parse_args
    from graph_trainer.dry_run import dry_run

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
