"""aot_fx_trace on gloo in each layout against eager torchtitan and layouts that see the same batches."""

import functools

import pytest

from graph_trainer.metrics import read_metrics

import _early  # tests/ is on sys.path
from _launch import train_ranks
from _runs import SMALL

pytestmark = [pytest.mark.slow, _early.uses("traced_fsdp4")]  # every test starts gloo ranks; one run early

STEPS = 2
#: name: (ranks, data_parallel_shard_degree, tensor_parallel_degree, data_parallel_replicate_degree)
LAYOUTS = {"one": (1, -1, 1, 1), "tp2": (2, 1, 2, 1), "fsdp2": (2, 2, 1, 1), "fsdp2tp2": (4, 2, 2, 1),
           "rep2tp2": (4, 1, 2, 2), "fsdp4": (4, 4, 1, 1), "hsdp": (4, 2, 1, 2), "tp2bf16": (2, 1, 2, 1),
           "rep2bf16": (2, 1, 1, 2), "tp2noclip": (2, 1, 2, 1)}
BF16 = "--training.mixed_precision_param bfloat16"  # the GPU configs' setting
#: Flags of a layout beyond its degrees: bf16 parameters; for TP2 also op-level SAC keeping all but the cheap ops (the
#: norms and TP's all-gathers redone in the backward; a batch of one gathers the sequence without a cat), and TP's
#: collectives issued a matmul ahead; no clipping (a norm bound never reached: eager under fp32 TP alone scales the norm
#: weights' unreduced gradients, the traced step their sum)
FLAGS = {"rep2bf16": BF16, "tp2bf16": f"{BF16} --training.local_batch_size 1 --activation_checkpoint.mode selective "
                                      "--activation_checkpoint.selective_ac_option op --compile.sac.save all_but_cheap",
         "tp2noclip": "--training.max_norm 1e9 --training.seq_len 256 --training.local_batch_size 8"}
#: Blocks of a layout's model but 2: the whole debug model and batch, whose embedding gradient norm rounds apart
#: when taken over TP shards rather than eager's replicated gradient
LAYERS = {"tp2noclip": None}
REPLICAS = "Replicate degree 2: gradients all-reduced over the replicas inside the graph"


def _run(tmp, layout, mode, env=None):
    """``layout`` in ``mode`` on forked gloo ranks, the debug model at 2 blocks: ``(stdout, losses, norms, hashes)``."""
    ngpu, shard, tp, replicate = LAYOUTS[layout]
    dump = tmp / "out"
    flags = (f"--training.steps {STEPS} --compile.mode {mode} --parallelism.data_parallel_shard_degree {shard} "
             f"--parallelism.tensor_parallel_degree {tp} --parallelism.data_parallel_replicate_degree {replicate} "
             f"--debug.deterministic --debug.state_hashes {FLAGS.get(layout, '')}")
    r = train_ranks(ngpu, [*SMALL, *flags.split(), "--job.dump_folder", str(dump)], f"{dump}.logs",
                    n_layers=LAYERS.get(layout, 2), base_env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows, summary = read_metrics(str(dump / "metrics.jsonl"))
    assert summary["final_loss"] > 0
    return r.stdout, [x["loss"] for x in rows], [x["grad_norm"] for x in rows], summary["state_hashes"]


_early.job("traced_fsdp4", lambda tmp, env: _run(tmp, "fsdp4", "aot_fx_trace", env))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(layout, mode)``: ``(stdout, losses, grad norms, state hashes)``, each run once per module."""
    @functools.cache
    def run(layout, mode):
        return (_early.result("traced_fsdp4") if (layout, mode) == ("fsdp4", "aot_fx_trace")  # tests/_early.py's run
                else _run(tmp_path_factory.mktemp(f"{layout}_{mode}"), layout, mode))

    return run


@pytest.mark.parametrize("layout, reference, loss_rtol, norm_rtol, line", [  # reference: "eager" or a layout traced
    # rtol 0: bitwise, every step, the final state; tp2noclip: fp32 TP alone (eager's replicated / partial gradients)
    ("fsdp4", "eager", 0.0, 0.0, ""), ("hsdp", "eager", 0.0, 0.0, ""), ("fsdp2tp2", "eager", 0.0, 0.0, ""),
    ("tp2noclip", "eager", 0.0, 0.0, ""), ("rep2bf16", "eager", 0.0, 0.0, ""),  # rep2bf16, tp2bf16: see below
    # TP / replicas alone with bf16 parameters: the eager baseline's FSDP2 over a 1-rank shard dimension (HSDP
    # for the replicas) casts the parameters as the traced step does (plain eager would train in fp32)
    ("tp2bf16", "eager", 0.0, 0.0, " 9 TP collective(s) 1 matmul / attention op(s) ahead"),
    # the same batches (not bitwise: loss-parallel cross-entropy, row-parallel matmuls, gradient sums reorder);
    # replicate 2 x TP2 traced only (torchtitan's eager DDP refuses TP)
    ("tp2", "one", 1e-6, 1e-4, "Applied torchtitan's Llama3 TP plan (degree 2, loss parallel True)"),
    ("fsdp2tp2", "fsdp2", 1e-6, 1e-4, "reduce-scatter(s)/other collectives earlier"),  # the overlap pass
    ("rep2tp2", "fsdp2", 1e-6, 1e-6, REPLICAS), ("hsdp", "fsdp4", 1e-6, 1e-4, REPLICAS),
], ids=["fsdp4_eager", "hsdp_eager", "fsdp2tp2_eager", "tp2noclip_eager", "rep2bf16_eager", "tp2bf16_eager",
        "tp2_vs_one", "fsdp2tp2_vs_fsdp2", "rep2tp2_vs_fsdp2", "hsdp_vs_fsdp4"])
def test_traced_layout_matches_reference(runs, layout, reference, loss_rtol, norm_rtol, line):
    """Loss and grad norm every step; against eager (rtol 0) also the final state."""
    eager = reference == "eager"  # first: eager FSDP4 while traced_fsdp4 runs early
    _, ref_loss, ref_norm, ref_hashes = runs(layout, "eager") if eager else runs(reference, "aot_fx_trace")
    out, loss, norm, hashes = runs(layout, "aot_fx_trace")
    assert line in out and len(loss) == len(ref_loss) == len(norm) == len(ref_norm) == STEPS
    for x, y, rtol in [*zip(loss, ref_loss, [loss_rtol] * STEPS), *zip(norm, ref_norm, [norm_rtol] * STEPS)]:
        assert abs(x - y) <= rtol * abs(y), (loss, ref_loss, norm, ref_norm)
    if eager:
        assert hashes == ref_hashes
