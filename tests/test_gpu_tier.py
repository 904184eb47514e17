"""The GPU tier (``multigpu``, scripts/gpu/tier.sh): bitwise claims with NCCL on 2 and 4 GPUs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from graph_trainer.metrics import read_metrics
from graph_trainer.tools.loss_compare import first_difference

from _launch import REPO  # tests/ is on sys.path
CONFIG = os.environ.get("GPU_TIER_CONFIG", "train_configs/llama3_1b.toml")
STEPS = int(os.environ.get("GPU_TIER_STEPS", "20"))
#: name: (GPUs, layout flags)
LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2tp2": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
}
#: name: (flags, passes) of a numerics-changing setting (async TP added to the passes where the layout has TP)
OPTIONS = {"regional": (["--compile.numerics_changing_optim"], ["annotate_residual_rmsnorm"]),
           "full": (["--compile.inductor_compilation", "full", "--compile.numerics_changing_optim"], [])}

pytestmark = pytest.mark.multigpu


def _env(layout: str) -> dict:
    """The runs' environment on the layout's GPUs (skipped without them), every rank's output (tracebacks) shown."""
    n = LAYOUTS[layout][0]
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, {torch.cuda.device_count()} visible")
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "COMM_MODE", "NNODES", "NODE_RANK")}
    return {**env, "NGPU": str(n), "CONFIG_FILE": os.path.join(REPO, CONFIG), "LOG_RANK": ",".join(map(str, range(n)))}


def _loss_compare(tmp_path, layout: str, a_flags: list[str], b_flags: list[str], steps: int) -> None:
    """``scripts/loss_compare.py --assert-equal`` of two settings on the layout's GPUs: bitwise equal."""
    env, out = _env(layout), tmp_path / "cmp"
    cmd = [sys.executable, "scripts/loss_compare.py", "--steps", str(steps), "--out", str(out), "--assert-equal",
           "--a-flags", " ".join(a_flags), "--b-flags", " ".join(b_flags), "--",
           *LAYOUTS[layout][1], "--debug.deterministic"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(r.stdout[-4000:], r.stderr[-4000:])
    result = json.loads((out / "loss_compare.json").read_text())
    assert r.returncode == 0 and result["bitwise_equal"], result["first_difference"]


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2tp2"])
def test_eager_equals_traced(tmp_path, layout):
    """torchtitan's eager step == the traced step, bitwise (STEPS steps, final state); with TP, async TP rewrote it."""
    _loss_compare(tmp_path, layout, ["--compile.mode", "eager"], [], STEPS)
    if "tp" in layout:
        passes = {p["pass"]: p for p in read_metrics(str(tmp_path / "cmp" / "b" / "metrics.jsonl"))[1]["passes"]}
        assert "async_tp" in passes and passes["async_tp"]["nodes_after"] < passes["async_tp"]["nodes_before"]


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2tp2"])
def test_cuda_graph_equals_eager(tmp_path, layout):
    """The traced step as a CUDA graph (NCCL, async TP's ops captured) == eager, bitwise, STEPS steps + state."""
    _loss_compare(tmp_path, layout, ["--compile.mode", "eager"], ["--compile.passes", "cudagraph"], STEPS)
    passes = read_metrics(str(tmp_path / "cmp" / "b" / "metrics.jsonl"))[1]["passes"]
    assert "cudagraph" in [p["pass"] for p in passes]


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2tp2"])
def test_run_to_run_with_numerics_changing_options(tmp_path, layout, option):
    """Two runs of the same numerics-changing setting: bitwise, 6 steps and the final state."""
    flags, passes = OPTIONS[option]
    passes = passes + ["async_tp"] * ("tp" in layout)
    flags = [*flags, *(["--compile.passes", ",".join(passes)] if passes else [])]
    _loss_compare(tmp_path, layout, flags, flags, 6)


@pytest.mark.parametrize("layout", ["fsdp2tp2"])
def test_resume_bitwise(tmp_path, layout):
    """A run stopped at step 2 and resumed in new processes equals the uninterrupted 4-step run, bitwise."""
    env, same = _env(layout), [*LAYOUTS[layout][1], "--debug.deterministic", "--debug.state_hashes",
                               "--compile.numerics_changing_optim", "--lr_scheduler.total_steps", "4",
                               "--metrics.log_freq", "1"]
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last_save_model_only"]

    def run(folder, steps, *flags):
        r = subprocess.run(["bash", "run_train.sh", *same, *flags, "--training.steps", str(steps),
                            "--job.dump_folder", str(tmp_path / folder)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    run("a", 4)
    run("b", 2, *ckpt)
    assert "Resumed from" in run("b", 4, *ckpt).stdout
    (rows_a, sum_a), (rows_b, sum_b) = (read_metrics(str(tmp_path / d / "metrics.jsonl")) for d in "ab")
    assert len(rows_a) == 4 and sum_b["resumed_from_step"] == 2
    assert first_difference(rows_a, rows_b, sum_a["state_hashes"], sum_b["state_hashes"]) is None
