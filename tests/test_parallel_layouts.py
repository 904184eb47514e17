"""aot_fx_trace under TP, FSDP, FSDP x TP, HSDP and replicate x TP on gloo (CPU), against
eager torchtitan of the same layout and against the layouts that see the same batches.

All runs: debug model (fp32, regional Inductor), seq 64, batch 2 per data-parallel rank, 2
steps, one run per layout and mode per module (:func:`runs`); the ranks are started as
torchrun starts them, forked from one process that imported the trainer (tests/_launch.py:
the launcher is tested elsewhere); the traced FSDP4 run is the ``fsdp4_run`` fixture,
through run_train.sh.

* :func:`test_traced_matches_eager`: every mode computes torchtitan's gradient (token-loss
  sum over the global batch's valid tokens, summed over the DP ranks): traced FSDP4 and HSDP
  (replicate 2 x shard 2: reduce-scatter inside a replica, then all-reduce across replicas,
  as graph nodes) are bitwise eager torchtitan of the same layout at every step, loss and
  gradient norm; traced and eager FSDP2 x TP2 have bitwise the same losses, and gradient
  norms equal up to the order in which DTensor sums the TP-replicated norm weights' squares.
* :func:`test_layout_matches_the_same_batches`: TP2 sees the batches of one rank, FSDP2 x TP2
  and replicate 2 x TP2 (traced only: torchtitan's eager DDP refuses TP) those of FSDP2, HSDP
  those of FSDP4: losses match to a tight tolerance, not bitwise (loss-parallel
  cross-entropy, the row-parallel matmuls and the gradients sum in another order).
* :func:`test_tp_collectives_in_graph`: sequence-parallel TP's collectives in the traced graph.
(FSDP vs unsharded on the same batch: tests/test_fsdp.py; two hosts vs one:
tests/test_multinode.py; run-to-run on 2 ranks: tests/test_determinism.py.)
"""

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from graph_trainer.metrics import read_metrics

from _launch import spawn, train_ranks  # tests/ is on sys.path

pytestmark = pytest.mark.slow  # every test starts gloo ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2  # as the fsdp4_run fixture
#: name: (ranks, data_parallel_shard_degree, tensor_parallel_degree, data_parallel_replicate_degree)
LAYOUTS = {
    "one": (1, -1, 1, 1),
    "tp2": (2, 1, 2, 1),
    "fsdp2": (2, 2, 1, 1),
    "fsdp2tp2": (4, 2, 2, 1),
    "rep2tp2": (4, 1, 2, 2),
    "fsdp4": (4, 4, 1, 1),
    "hsdp": (4, 2, 1, 2),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """``runs(layout, mode="aot_fx_trace")``: ``(rank 0's stdout, losses, grad norms)`` of a
    run of :data:`LAYOUTS`, started on first use, once per module; the traced FSDP4 run is
    the ``fsdp4_run`` fixture (tests/conftest.py)."""
    done = {}

    def run(layout, mode="aot_fx_trace"):
        if (layout, mode) == ("fsdp4", "aot_fx_trace"):
            return request.getfixturevalue("fsdp4_run")
        if (layout, mode) not in done:
            ngpu, shard, tp, replicate = LAYOUTS[layout]
            dump = tmp_path_factory.mktemp(f"{layout}_{mode}") / "out"
            r = train_ranks(
                ngpu,
                ["--training.seq_len", "64", "--training.local_batch_size", "2",
                 "--training.steps", str(STEPS), "--job.dump_folder", str(dump), "--compile.mode", mode,
                 "--parallelism.data_parallel_shard_degree", str(shard),
                 "--parallelism.tensor_parallel_degree", str(tp),
                 "--parallelism.data_parallel_replicate_degree", str(replicate)],
                f"{dump}.logs",
            )
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            rows, _ = read_metrics(os.path.join(dump, "metrics.jsonl"))
            done[layout, mode] = r.stdout, [x["loss"] for x in rows], [x["grad_norm"] for x in rows]
        return done[layout, mode]

    return run


def _close(a, b, rtol):
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert abs(x - y) <= rtol * abs(y), (a, b)


@pytest.mark.parametrize("layout, norm_rtol", [("fsdp4", 0.0), ("hsdp", 0.0), ("fsdp2tp2", 1e-6)],
                         ids=["fsdp4", "hsdp", "fsdp2tp2"])
def test_traced_matches_eager(runs, layout, norm_rtol):
    _, loss, norm = runs(layout)
    _, eager_loss, eager_norm = runs(layout, "eager")
    assert len(loss) == STEPS and eager_loss == loss  # bitwise, every step
    if norm_rtol:
        _close(eager_norm, norm, norm_rtol)
    else:
        assert eager_norm == norm


@pytest.mark.parametrize("layout, reference, loss_rtol, norm_rtol, line", [
    ("tp2", "one", 1e-6, 1e-4, "Applied torchtitan's Llama3 TP plan (degree 2, loss parallel True)"),
    ("fsdp2tp2", "fsdp2", 1e-6, 1e-4, "reduce-scatter(s)/other collectives earlier"),  # overlap pass saw them
    ("rep2tp2", "fsdp2", 1e-6, 1e-6, "Replicate degree 2: gradients all-reduced over the replicas inside the graph"),
    ("hsdp", "fsdp4", 1e-6, 1e-4, "Replicate degree 2: gradients all-reduced over the replicas inside the graph"),
], ids=["tp2_vs_one", "fsdp2tp2_vs_fsdp2", "rep2tp2_vs_fsdp2", "hsdp_vs_fsdp4"])
def test_layout_matches_the_same_batches(runs, layout, reference, loss_rtol, norm_rtol, line):
    """The global grad norm: over TP shards + replicated norm weights, over replicas."""
    out, loss, norm = runs(layout)
    _, ref_loss, ref_norm = runs(reference)
    assert line in out
    _close(loss, ref_loss, loss_rtol)
    _close(norm, ref_norm, norm_rtol)


def _tp_worker(rank, world, store_path, result_path):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        from collections import Counter

        from graph_trainer.config import parse_args
        from graph_trainer.model import build_model, loss_fn, model_args
        from graph_trainer.distributed.parallelize import _patch_torchtitan_device_type, build_parallel_dims, distribute_for_trace
        from graph_trainer.trace import trace_train_step
        from torch.distributed.tensor.parallel import loss_parallel

        _patch_torchtitan_device_type("cpu")
        cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
                          "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"])
        args = model_args("debugmodel", n_layers=2)
        model = build_model(args, seed=0)
        pdims = build_parallel_dims(cfg, world, args.n_heads, args.n_kv_heads)
        tpar = distribute_for_trace(model, cfg, pdims, torch.device("cpu"), rank, world)
        tokens = torch.randint(0, 2048, (2, 16))
        with loss_parallel():
            traced = trace_train_step(model, loss_fn, tokens, tokens, params=tpar.params,
                                      param_names=tpar.names, materialize=tpar.materialize)
        colls = Counter(str(n.target).split(".")[1] for n in traced.gm.graph.nodes if "_c10d_functional" in str(n.target))
        shapes = {n: tuple(p.shape) for n, p in zip(tpar.names, tpar.params)}
        with open(f"{result_path}.{rank}", "wb") as f:
            pickle.dump((dict(colls), shapes, tpar.norm_weights.count(0.5)), f)
    finally:
        dist.destroy_process_group()


def test_tp_collectives_in_graph(tmp_path):
    """Sequence-parallel TP: per block, the attention and FFN inputs are all-gathered and
    their outputs reduce-scattered over the sequence inside the one graph; the
    replicated norm weights' gradients are all-reduced."""
    spawn(_tp_worker, (2, str(tmp_path / "store"), str(tmp_path / "result")), 2)  # forked, joined
    for rank in range(2):
        with open(tmp_path / f"result.{rank}", "rb") as f:  # written by the rank before it exited
            colls, shapes, n_replicated = pickle.load(f)
        n_layers = 2
        # forward: 2 all-gathers (attention, FFN input) per block + output's; backward mirrors them
        assert colls["all_gather_into_tensor"] >= 2 * (2 * n_layers + 1)
        assert colls["reduce_scatter_tensor"] >= 2 * n_layers
        assert colls.get("all_reduce", 0) >= 2 * n_layers + 1  # norm weight grads (+ loss parallel)
        assert shapes["layers.0.attention.wq.weight"] == (128, 256)  # colwise: dim 256 -> 256/2 rows
        assert shapes["layers.0.attention.wo.weight"] == (256, 128)  # rowwise
        assert shapes["layers.0.attention_norm.weight"] == (256,)  # replicated
        assert n_replicated == 2 * n_layers + 1
