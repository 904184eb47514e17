"""Run the debug model for the record / resume tests (not a test module)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBUG = os.path.join(REPO, "train_configs", "debug_model.toml")


def run_debug(dump, small, *flags, steps=4, direct=False):
    """``run_train.sh`` on the debug config with ``small`` then ``flags`` (torchrun; a worker's
    user error exits 2), or with ``direct`` the trainer's own entry point in one process
    (exit 2 on bad input, no launcher pre-check). Returns the CompletedProcess."""
    env = {**os.environ, "NGPU": "1"}
    env.pop("CONFIG_FILE", None)
    launch = ["bash", "run_train.sh"]
    if direct:
        launch = [sys.executable, "-m", "graph_trainer.train", "--job.config_file", DEBUG]
    return subprocess.run(
        [*launch, *small, "--training.steps", str(steps), "--job.dump_folder", str(dump), *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
