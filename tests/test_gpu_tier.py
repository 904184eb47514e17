"""The GPU tier (``multigpu``, scripts/gpu/tier.sh): bitwise claims with NCCL on 2 and 4 GPUs."""

import os
import subprocess

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
           "pointwise": (["--compile.numerics_changing_optim"], ["annotate_pointwise"]),
           "full": (["--compile.inductor_compilation", "full", "--compile.numerics_changing_optim"], [])}

EAGER = ["--compile.mode", "eager"]
_EAGER: dict[tuple, tuple] = {}  # (layout, steps): eager's run, shared by the claims against it

pytestmark = pytest.mark.multigpu


def _env(layout: str) -> dict:
    """The runs' environment on the layout's GPUs (skipped without them), every rank's output (tracebacks) shown."""
    n = LAYOUTS[layout][0]
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, {torch.cuda.device_count()} visible")
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG", "COMM_MODE", "NNODES", "NODE_RANK")}
    return {**env, "NGPU": str(n), "CONFIG_FILE": os.path.join(REPO, CONFIG), "LOG_RANK": ",".join(map(str, range(n)))}


def _train(tmp_path, layout: str, flags: list[str], steps: int, name: str) -> tuple[list, dict, str]:
    """``run_train.sh`` on the layout's GPUs, deterministic, with state hashes: (rows, summary, stdout)."""
    r = subprocess.run(["bash", "run_train.sh", *LAYOUTS[layout][1], "--debug.deterministic", "--debug.state_hashes",
                        "--metrics.log_freq", "1", *flags, "--training.steps", str(steps),
                        "--job.dump_folder", str(tmp_path / name)], cwd=REPO, env=_env(layout), capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows, summary = read_metrics(str(tmp_path / name / "metrics.jsonl"))
    print(f"[{name}] {' '.join(flags) or '(no flags)'}: losses {[row['loss'] for row in rows]}")
    return rows, summary, r.stdout


def _bitwise(tmp_path, layout: str, a_flags: list[str], b_flags: list[str], steps: int) -> dict:
    """Two settings on the layout's GPUs: losses, grad norms and final state bitwise equal (``loss_compare.py
    --assert-equal``'s test); eager's run is made once per layout for every claim against it. Returns B's summary."""
    a = _EAGER.get((layout, steps)) if a_flags == EAGER else None
    if a is None:
        a = _train(tmp_path, layout, a_flags, steps, "a")
        if a_flags == EAGER:
            _EAGER[layout, steps] = a
    b = _train(tmp_path, layout, b_flags, steps, "b")
    assert (diff := first_difference(a[0], b[0], a[1]["state_hashes"], b[1]["state_hashes"])) is None, diff
    return b[1]


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2tp2"])
def test_eager_equals_traced(tmp_path, layout):
    """torchtitan's eager step == the traced step, bitwise (STEPS steps, final state); with TP, async TP rewrote it."""
    summary = _bitwise(tmp_path, layout, EAGER, [], STEPS)
    if "tp" in layout:
        passes = {p["pass"]: p for p in summary["passes"]}
        assert "async_tp" in passes and passes["async_tp"]["nodes_after"] < passes["async_tp"]["nodes_before"]


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2tp2"])
def test_cuda_graph_equals_eager(tmp_path, layout):
    """The traced step as a CUDA graph (NCCL, async TP's ops captured) == eager, bitwise, STEPS steps + state."""
    summary = _bitwise(tmp_path, layout, EAGER, ["--compile.passes", "cudagraph"], STEPS)
    assert "cudagraph" in [p["pass"] for p in summary["passes"]]


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2tp2"])
def test_run_to_run_with_numerics_changing_options(tmp_path, layout, option):
    """Two runs of the same numerics-changing setting: bitwise, 6 steps and the final state."""
    flags, passes = OPTIONS[option]
    passes = passes + ["async_tp"] * ("tp" in layout)
    flags = [*flags, *(["--compile.passes", ",".join(passes)] if passes else [])]
    _bitwise(tmp_path, layout, flags, flags, 6)


@pytest.mark.parametrize("layout", ["fsdp2tp2"])
def test_resume_bitwise(tmp_path, layout):
    """A run stopped at step 2 and resumed in new processes equals the uninterrupted 4-step run, bitwise."""
    same = ["--compile.numerics_changing_optim", "--lr_scheduler.total_steps", "4"]
    ckpt = [*same, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last_save_model_only"]
    rows_a, sum_a, _ = _train(tmp_path, layout, same, 4, "a")
    _train(tmp_path, layout, ckpt, 2, "b")
    rows_b, sum_b, out = _train(tmp_path, layout, ckpt, 4, "b")
    assert "Resumed from" in out
    assert len(rows_a) == 4 and sum_b["resumed_from_step"] == 2
    assert first_difference(rows_a, rows_b, sum_a["state_hashes"], sum_b["state_hashes"]) is None
