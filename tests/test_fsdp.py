"""Traceable FSDP against the unsharded model on 2 gloo ranks, and fake-backend dry runs (8 ranks)."""

import functools
import re
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import _early  # tests/ is on sys.path
from _launch import spawn, train_ranks
from _runs import REPO, launch_env

pytestmark = pytest.mark.slow
N_8B, N_DEBUG = 2 + 32 * 9 + 1, 2 + 6 * 9 + 1  # parameters: embedding, output; 9 per block; final norm


def _fsdp_vs_unsharded(rank, world, store_path):  # a gloo rank, its asserts raised by spawn
    from graph_trainer.compiler.passes.bucket_collectives import bucket_collectives_pass
    from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass
    from graph_trainer.distributed import fsdp
    from graph_trainer.model import build_model, loss_fn, model_args
    from graph_trainer.trace import trace_train_step

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_model(model_args("debugmodel", n_layers=2))
    tokens, labels = torch.randint(0, 2048, (2, 32)), torch.randint(0, 2048, (2, 32))
    (ref_loss := loss_fn(model(tokens), labels)).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    bufs, group = list(model.buffers()), dist.group.WORLD
    names, params = zip(*model.named_parameters())
    specs, shards = fsdp.shard_tensors(list(names), list(params), group)
    fsdp.free_parameters(model, names)
    # every rank holds the same batch: the global token count is world x the local one
    traced = trace_train_step(model, functools.partial(loss_fn, dp_group=group), tokens, labels, params=shards,
                              param_names=[s.name for s in specs],
                              materialize=lambda ps: [fsdp.all_gather_param(p, s, group) for p, s in zip(ps, specs)])
    colls = Counter(str(n.target).split(".")[1]  # as traced (the passes below change the graph)
                    for n in traced.gm.graph.nodes if "_c10d_functional" in str(n.target))
    # per parameter one all-gather (forward) and one reduce-scatter (backward); one all-reduce: valid-token count
    assert colls["all_gather_into_tensor"] == colls["reduce_scatter_tensor"] == len(specs)
    assert colls["all_reduce"] == 1 and colls["wait_tensor"] == 2 * len(specs) + 1
    loss, grads = traced(shards, bufs, tokens, labels)
    assert float(loss) * 2 == float(ref_loss.detach())  # each rank's loss is its half of the global batch's mean
    with torch.no_grad():  # bucket_collectives (4 per bucket): bitwise the same step
        gm = bucket_collectives_pass(overlap_collectives_pass(traced.gm), None, bucket_size=4)
        out = gm(*shards, *bufs, tokens, labels)
    assert sum("reduce_scatter_tensor" in str(n.target) for n in gm.graph.nodes) == -(-len(specs) // 4)
    assert torch.equal(out[0], loss) and all(torch.equal(a, b) for a, b in zip(out[1:], grads))
    for s, g in zip(specs, grads):
        dist.all_gather(parts := [torch.empty_like(g) for _ in range(world)], g)
        assert (torch.cat(parts)[: s.numel].view(s.shape) - ref[s.name]).abs().max().item() < 1e-6, s.name
    for p, g in zip(shards, grads):
        p.grad = g
    # fp32 norms of shards vs the fp64 norm of the unsharded grads: up to accumulation order
    ref_norm = torch.stack([g.double().pow(2).sum() for g in ref.values()]).sum().sqrt()
    assert float(fsdp.sharded_grad_norm_(shards, 1e9, group)) == pytest.approx(float(ref_norm), rel=1e-4)
    dist.destroy_process_group()


def test_fsdp_trace_matches_unsharded_gloo(tmp_path):
    """Same batch on both ranks: the unsharded gradients (fp32, up to rounding); bucketed: bitwise unbucketed."""
    spawn(_fsdp_vs_unsharded, (2, str(tmp_path / "store")), 2)  # forked from tests/_launch.py's server


def _counts(r) -> dict[str, int]:  # the collective counts a dry run printed
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {k: int(v) for k, v in re.findall(r"  (\w+): (\d+) ops", r.stdout)}


def test_fake_backend_dry_runs_of_the_debug_model(tmp_path):
    """FSDP4 x TP2 via run_train.sh vs replicate 2 x shard 2 x TP2: the same collectives + one all-reduce each."""
    tp = ["--training.seq_len", "64", "--parallelism.tensor_parallel_degree", "2"]
    hsdp = [*tp, "--comm.mode", "fake_backend", "--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2"]
    with ThreadPoolExecutor(1) as pool:  # run_train.sh and the forked dry run side by side: one core each
        script = pool.submit(subprocess.run, ["bash", "run_train.sh", *tp, "--parallelism.data_parallel_shard_degree",
                                              "4"], cwd=REPO, env=launch_env(COMM_MODE="fake_backend", NGPU="8"),
                             capture_output=True, text=True, timeout=600)
        hsdp = _counts(train_ranks(1, hsdp, tmp_path, env={"NGPU": "8"}))
        fsdp, out = _counts(script.result()), script.result().stdout
    assert "FSDP4xTP2 on 8 fake ranks" in out and hsdp["all_reduce"] == fsdp["all_reduce"] + N_DEBUG
    assert hsdp["all_gather_into_tensor"] == fsdp["all_gather_into_tensor"] > N_DEBUG
    assert hsdp["reduce_scatter_tensor"] == fsdp["reduce_scatter_tensor"] > N_DEBUG


@_early.uses("dry_runs_8b")
def test_fake_backend_dry_runs_of_the_8b():
    """The 8B dry runs: FSDP8 with op-level SAC recomputing; FSDP4 x TP2, every norm tagged, plans for two devices."""
    assert (s := _early.result("dry_runs_8b")["fsdp8"])["layout"] == "FSDP8" and s["world_size"] == 8
    assert [s["collectives"][k]["count"] for k in ("all_gather_into_tensor", "reduce_scatter_tensor")] == [N_8B] * 2
    # bf16 all-gather of ~8.03 B parameters; fp32 reduce-scatter output = the shard
    assert 14.5 < s["collectives"]["all_gather_into_tensor"]["bytes"] / 2**30 < 15.5
    assert s["param_bytes_per_rank"] == pytest.approx(8.03e9 * 4 / 8, rel=0.01)
    assert s["nodes"] > 10000 and s["nodes_by_phase"]["backward"] > 1000
    # fused attention (the math path held > 300 GiB); op-level SAC recomputes: under half the traced peak
    assert "sac_recompute" in s["graph_passes"] and s["peak_graph_bytes_traced"] / 2**30 < 120
    assert s["peak_graph_bytes"] < 0.5 * s["peak_graph_bytes_traced"]
    s, messages = _early.result("dry_runs_8b")["fsdp4_tp2"]  # the seed layout
    assert any("tagged 65 forward + 65 backward RMSNorms + 64 recomputed" in m for m in messages)
    small, large = s["memory_policies"]  # the plans for an 80 GB and a 141 GB device: the smaller no fatter
    assert small["budget_gib"] < large["budget_gib"]
    assert small["predicted_peak_gib"] <= large["predicted_peak_gib"] <= large["budget_gib"]
    assert s["peak_graph_bytes"] <= s["peak_graph_bytes_traced"] and "reshard_after_forward" in s["graph_passes"]
    c = s["collectives"]
    # FSDP: one all-gather + reduce-scatter per parameter; sequence-parallel TP: per block >= 2 of each
    assert all(c[k]["count"] >= N_8B + 2 * 32 for k in ("all_gather_into_tensor", "reduce_scatter_tensor")), c
    assert c["all_reduce"]["count"] >= 2 * 32 + 1  # norm-weight gradients (replicated under TP)
    assert s["layout"] == "FSDP4xTP2" and s["param_bytes_per_rank"] == pytest.approx(8.03e9 * 4 / 8, rel=0.01)


def test_weighted_grad_norm_makes_its_weights_tensor_once(monkeypatch):
    """TP-replicated weights: the norm is sqrt(Σ w_i ||g_i||²); the weights reach the device on the first call."""
    from graph_trainer.distributed import fsdp

    monkeypatch.setattr(fsdp.dist, "all_reduce", lambda t, op=None, group=None: t)  # one rank
    shards = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    shards[0].grad, shards[1].grad = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.0, 2.0])
    fsdp._on_device.cache_clear()
    norms = [float(fsdp.sharded_grad_norm_(shards, 1e9, None, [0.5, 1.0])) for _ in range(2)]
    assert norms == pytest.approx([(0.5 * 25 + 4) ** 0.5] * 2) and fsdp._on_device.cache_info().misses == 1
