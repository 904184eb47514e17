"""aot_fx_trace under TP, FSDP, FSDP x TP, HSDP and replicate x TP on gloo (CPU), against
eager torchtitan and the unsharded run.

All runs: debug model, fp32, seq 64, batch 2; the ranks are started as torchrun starts
them, forked from one process that imported the trainer (tests/_launch.py: the launcher is
tested elsewhere); the traced FSDP4 run is the ``fsdp4_run`` fixture, through run_train.sh.
* Every mode computes torchtitan's gradient (token-loss sum over the global batch's valid
  tokens, summed over the DP ranks): traced FSDP2 and FSDP4 are bitwise eager torchtitan
  FSDP2 of the same layout at every step, loss and gradient norm.
* TP2 sees the same batches as one rank: its losses match the single-rank run to a
  tight tolerance (not bitwise: loss-parallel cross-entropy and the row-parallel
  matmuls sum in another order).
* FSDP2 x TP2 (4 ranks) sees the same batches as FSDP2 (2 ranks): losses match; traced and
  eager FSDP2 x TP2 have bitwise the same losses, and gradient norms equal up to the order
  in which DTensor sums the TP-replicated norm weights' squares. Replicate 2 x TP2 (traced
  only: torchtitan's eager DDP refuses TP) matches FSDP2 as well.
* HSDP (replicate 2 x shard 2) is bitwise eager torchtitan HSDP, and matches FSDP4.
(FSDP vs unsharded on the same batch: tests/test_fsdp.py.)
"""

import os

import pytest
import torch
import torch.distributed as dist

from graph_trainer.metrics import read_metrics

from _launch import queue, spawn, train_ranks  # tests/ is on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(dump, ngpu, shard, tp, mode="aot_fx_trace", steps=3, replicate=1):
    r = train_ranks(
        ngpu,
        ["--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.steps", str(steps), "--job.dump_folder", str(dump), "--compile.mode", mode,
         "--parallelism.data_parallel_shard_degree", str(shard), "--parallelism.tensor_parallel_degree", str(tp),
         "--parallelism.data_parallel_replicate_degree", str(replicate)],
        f"{dump}.logs",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows, _ = read_metrics(os.path.join(dump, "metrics.jsonl"))
    return r.stdout, [x["loss"] for x in rows], [x["grad_norm"] for x in rows]


def _close(a, b, rtol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rtol * abs(y), (a, b)


@pytest.mark.slow
def test_tp2_matches_single_rank(tmp_path):
    _, ref_loss, ref_norm = _train(tmp_path / "one", 1, -1, 1)
    out, loss, norm = _train(tmp_path / "tp2", 2, 1, 2)
    assert "Applied torchtitan's Llama3 TP plan (degree 2, loss parallel True)" in out
    _close(loss, ref_loss, 1e-6)
    _close(norm, ref_norm, 1e-4)  # global grad norm over TP shards + replicated norm weights


@pytest.mark.slow
def test_fsdp2_tp2_matches_fsdp2_and_eager(tmp_path):
    _, ref_loss, ref_norm = _train(tmp_path / "fsdp2", 2, 2, 1)
    _, eager_loss, eager_norm = _train(tmp_path / "fsdp2_eager", 2, 2, 1, mode="eager")
    assert (eager_loss, eager_norm) == (ref_loss, ref_norm)  # bitwise, every step
    out, loss, norm = _train(tmp_path / "fsdp2tp2", 4, 2, 2)
    assert "issued" in out and "reduce-scatter" in out  # overlap pass saw the collectives
    _close(loss, ref_loss, 1e-6)
    _close(norm, ref_norm, 1e-4)
    _, eager_loss, eager_norm = _train(tmp_path / "fsdp2tp2_eager", 4, 2, 2, mode="eager")
    assert eager_loss == loss
    _close(eager_norm, norm, 1e-6)
    # replicate 2 x TP2: the TP-local gradients all-reduced over the replicas inside the graph
    # (torchtitan has no eager replicate x TP); the same batches as FSDP2
    out, loss, norm = _train(tmp_path / "rep2tp2", 4, 1, 2, replicate=2)
    assert "Replicate degree 2: gradients all-reduced over the replicas inside the graph" in out
    _close(loss, ref_loss, 1e-6)
    _close(norm, ref_norm, 1e-6)


@pytest.mark.slow
def test_fsdp4_and_hsdp_match_eager_bitwise(tmp_path, fsdp4_run):
    """4 gloo ranks: the traced step and eager torchtitan agree bitwise (loss, grad norm, every
    step) for FSDP4 and for HSDP (replicate 2 x shard 2: reduce-scatter inside a replica, then
    all-reduce across replicas, as graph nodes). FSDP4 and HSDP see the same batches: the same
    losses; the gradients are summed in another order, so their norms agree to a tolerance.
    The traced FSDP4 run is ``fsdp4_run`` (run_train.sh, the same flags, 2 steps)."""
    _, loss, norm = fsdp4_run
    assert len(loss) == 2
    _, eager_loss, eager_norm = _train(tmp_path / "fsdp4_eager", 4, 4, 1, mode="eager", steps=2)
    assert (eager_loss, eager_norm) == (loss, norm)
    out, h_loss, h_norm = _train(tmp_path / "hsdp", 4, 2, 1, steps=2, replicate=2)
    assert "Replicate degree 2" in out
    _, e_loss, e_norm = _train(tmp_path / "hsdp_eager", 4, 2, 1, mode="eager", steps=2, replicate=2)
    assert (e_loss, e_norm) == (h_loss, h_norm)
    _close(h_loss, loss, 1e-6)
    _close(h_norm, norm, 1e-4)


def _tp_worker(rank, world, store_path, q):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        from collections import Counter

        from graph_trainer.config import parse_args
        from graph_trainer.model import build_model, loss_fn, model_args
        from graph_trainer.parallelize import _patch_torchtitan_device_type, build_parallel_dims, distribute_for_trace
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
        q.put((rank, dict(colls), shapes, tpar.norm_weights.count(0.5)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp_collectives_in_graph(tmp_path):
    """Sequence-parallel TP: per block, the attention and FFN inputs are all-gathered and
    their outputs reduce-scattered over the sequence inside the one graph; the
    replicated norm weights' gradients are all-reduced."""
    q = queue()
    spawn(_tp_worker, (2, str(tmp_path / "store"), q), 2)  # forked from tests/_launch.py's server
    for _ in range(2):
        rank, colls, shapes, n_replicated = q.get(timeout=60)
        n_layers = 2
        # forward: 2 all-gathers (attention, FFN input) per block + output's; backward mirrors them
        assert colls["all_gather_into_tensor"] >= 2 * (2 * n_layers + 1)
        assert colls["reduce_scatter_tensor"] >= 2 * n_layers
        assert colls.get("all_reduce", 0) >= 2 * n_layers + 1  # norm weight grads (+ loss parallel)
        assert shapes["layers.0.attention.wq.weight"] == (128, 256)  # colwise: dim 256 -> 256/2 rows
        assert shapes["layers.0.attention.wo.weight"] == (256, 128)  # rowwise
        assert shapes["layers.0.attention_norm.weight"] == (256,)  # replicated
        assert n_replicated == 2 * n_layers + 1
