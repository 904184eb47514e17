"""Traceable FSDP on gloo (2 ranks) against the unsharded model, and the fake-backend dry
run (8 ranks, one process). (Traced FSDP / HSDP / FSDP x TP runs against eager torchtitan:
tests/test_parallel_layouts.py.)"""

import functools
import os
import pickle
import subprocess
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from _launch import spawn  # tests/ is on sys.path
from _runs import dry_run_8b_8_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank, world, store_path, result_path):
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        from graph_trainer.distributed import fsdp
        from graph_trainer.model import build_model, loss_fn, model_args
        from graph_trainer.trace import trace_train_step

        model = build_model(model_args("debugmodel", n_layers=2))
        tokens = torch.randint(0, 2048, (2, 32))
        labels = torch.randint(0, 2048, (2, 32))
        ref_loss = loss_fn(model(tokens), labels)
        ref_loss.backward()
        ref = {n: p.grad.clone() for n, p in model.named_parameters()}
        bufs = list(model.buffers())
        group = dist.group.WORLD
        specs, shards = fsdp.shard_parameters(model, group)
        # every rank holds the same batch: the global token count is world x the local one
        traced = trace_train_step(
            model, functools.partial(loss_fn, dp_group=group), tokens, labels, params=shards,
            param_names=[s.name for s in specs],
            materialize=lambda ps: [fsdp.all_gather_param(p, s, group) for p, s in zip(ps, specs)],
        )
        colls = Counter(
            str(n.target).split(".")[1] for n in traced.gm.graph.nodes if "_c10d_functional" in str(n.target)
        )
        loss, grads = traced(shards, bufs, tokens, labels)
        # bucket_collectives (4 per bucket) on the 2-rank layout: bitwise the same step
        from graph_trainer.compiler.passes.bucket_collectives import bucket_collectives_pass
        from graph_trainer.compiler.passes.overlap_collectives import overlap_collectives_pass

        with torch.no_grad():
            gm = bucket_collectives_pass(overlap_collectives_pass(traced.gm), None, bucket_size=4)
            out = gm(*shards, *bufs, tokens, labels)
        bucketed = (
            sum(1 for n in gm.graph.nodes if "reduce_scatter_tensor" in str(n.target)),
            bool(torch.equal(out[0], loss)) and all(torch.equal(a, b) for a, b in zip(out[1:], grads)),
        )
        max_err = 0.0
        for s, g in zip(specs, grads):
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            full = torch.cat(parts)[: s.numel].view(s.shape)
            max_err = max(max_err, (full - ref[s.name]).abs().max().item())
        for p, g in zip(shards, grads):
            p.grad = g
        norm = fsdp.sharded_grad_norm_(shards, 1e9, group)
        ref_norm = torch.stack([g.double().pow(2).sum() for g in ref.values()]).sum().sqrt()
        with open(f"{result_path}.{rank}", "wb") as f:
            pickle.dump((float(loss), float(ref_loss), max_err, dict(colls), len(specs), float(norm),
                         float(ref_norm), bucketed), f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_trace_matches_unsharded_gloo(tmp_path):
    """2 ranks, same batch on both: in-graph all-gather/reduce-scatter(sum) of the loss over
    the global token count reproduce the unsharded gradients (fp32, up to rounding); with
    bucket_collectives the step is bitwise the unbucketed one."""
    spawn(_worker, (2, str(tmp_path / "store"), str(tmp_path / "result")), 2)  # forked, joined
    results = []
    for rank in range(2):
        with open(tmp_path / f"result.{rank}", "rb") as f:  # written by the rank before it exited
            results.append(pickle.load(f))
    for loss, ref_loss, max_err, colls, n_params, norm, ref_norm, (n_rs_bucketed, same) in results:
        assert n_rs_bucketed == -(-n_params // 4) and same  # bucketed: 4 params per collective, same values
        # forward: gathered params are bitwise the originals; each rank's loss is its half
        # of the global batch's mean (the same batch on both ranks)
        assert loss * 2 == ref_loss
        assert max_err < 1e-6
        # one all-gather per parameter in the forward, one reduce-scatter in the backward
        assert colls["all_gather_into_tensor"] == n_params
        assert colls["reduce_scatter_tensor"] == n_params
        assert colls["all_reduce"] == 1  # the global batch's valid-token count
        assert colls["wait_tensor"] == 2 * n_params + 1
        # fp32 norms of shards vs the fp64 norm of the unsharded grads: same value up to
        # fp32 accumulation order (a few 1e-5 relative on 500k-element tensors)
        assert norm == pytest.approx(ref_norm, rel=1e-4)


@pytest.mark.slow
def test_fake_backend_dry_run_8_ranks_debug_and_8b():
    """COMM_MODE=fake_backend NGPU=8: the debug model and the 8B trace in one process."""
    env = {**os.environ, "COMM_MODE": "fake_backend", "NGPU": "8"}
    r = subprocess.run(["bash", "run_train.sh", "--training.seq_len", "64"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "FSDP8 on 8 fake ranks" in r.stdout
    assert "all_gather_into_tensor: 57 ops" in r.stdout  # debugmodel: 57 parameters
    assert "reduce_scatter_tensor: 57 ops" in r.stdout

    s = dry_run_8b_8_ranks("--compile.sac.save", "recompute", "--compile.fsdp.keep_last_blocks", "0")
    assert s["layout"] == "FSDP8" and s["world_size"] == 8
    n_params = 2 + 32 * 9 + 1  # embedding, output; 9 per block; final norm
    assert s["collectives"]["all_gather_into_tensor"]["count"] == n_params
    assert s["collectives"]["reduce_scatter_tensor"]["count"] == n_params
    # bf16 all-gather of ~8.03 B parameters; fp32 reduce-scatter output = the shard
    assert 14.5 < s["collectives"]["all_gather_into_tensor"]["bytes"] / 2**30 < 15.5
    assert s["param_bytes_per_rank"] == pytest.approx(8.03e9 * 4 / 8, rel=0.01)
    assert s["nodes"] > 10000 and s["nodes_by_phase"]["backward"] > 1000
    # attention traced as a fused op (the math path held 4 GiB of scores per layer: > 300 GiB),
    # and op-level SAC really recomputes (sac_recompute): well under half of the traced peak
    assert "sac_recompute" in s["graph_passes"]
    assert s["peak_graph_bytes_traced"] / 2**30 < 120
    assert s["peak_graph_bytes"] < 0.5 * s["peak_graph_bytes_traced"]


@pytest.mark.slow
def test_fake_backend_dry_run_8b_fsdp4_tp2(dry_run_8b_fsdp4_tp2):
    """The seed layout: Llama3 8B, FSDP4 x TP2 on 8 fake ranks, traced in one process (the
    session's dry run, tests/conftest.py; its collectives are counted as traced)."""
    s, _ = dry_run_8b_fsdp4_tp2
    assert s["layout"] == "FSDP4xTP2"
    # the memory policy's plan for an 80 GB and a 141 GB device: the smaller plans no fatter
    small, large = s["memory_policies"]
    assert small["budget_gib"] < large["budget_gib"]
    assert small["predicted_peak_gib"] <= large["predicted_peak_gib"]
    assert large["predicted_peak_gib"] <= large["budget_gib"]
    assert s["peak_graph_bytes"] <= s["peak_graph_bytes_traced"]
    assert "reshard_after_forward" in s["graph_passes"]
    n_params = 2 + 32 * 9 + 1
    c = s["collectives"]
    # FSDP: one all-gather + one reduce-scatter per parameter; TP (sequence parallel): per
    # block 2 all-gathers (attention / FFN inputs) + 2 reduce-scatters (their outputs) in
    # the forward and the mirrored ones in the backward, plus the output projection's
    assert c["all_gather_into_tensor"]["count"] >= n_params + 2 * 32
    assert c["reduce_scatter_tensor"]["count"] >= n_params + 2 * 32
    assert c["all_reduce"]["count"] >= 2 * 32 + 1  # norm-weight gradients (replicated under TP)
    assert s["param_bytes_per_rank"] == pytest.approx(8.03e9 * 4 / 8, rel=0.01)


def _dry_run_counts(tmp, ngpu: int, *flags) -> dict[str, int]:
    """Collective counts printed by a debug-model dry run (``--comm.mode fake_backend``, what
    ``COMM_MODE=fake_backend`` runs), in a fresh process (forked, tests/_launch.py): DTensor
    caches sharding decisions by mesh, and two TP runs in one process would share them."""
    import re

    from _launch import train_ranks

    r = train_ranks(1, ["--training.seq_len", "64", "--comm.mode", "fake_backend", *flags], tmp,
                    env={"NGPU": str(ngpu)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {k: int(v) for k, v in re.findall(r"  (\w+): (\d+) ops", r.stdout)}


@pytest.mark.slow
def test_fake_backend_dry_run_hsdp_x_tp_adds_one_all_reduce_per_parameter(tmp_path):
    """Replicate 2 x shard 2 x TP2 traces on 8 fake ranks; against FSDP4 x TP2 the graph has
    the same FSDP and TP collectives plus one all-reduce per parameter (its reduce-scattered
    gradient summed over the replicas)."""
    tp = ("--parallelism.tensor_parallel_degree", "2")
    hsdp = _dry_run_counts(tmp_path / "hsdp", 8, *tp, "--parallelism.data_parallel_replicate_degree", "2",
                           "--parallelism.data_parallel_shard_degree", "2")
    fsdp = _dry_run_counts(tmp_path / "fsdp", 8, *tp, "--parallelism.data_parallel_shard_degree", "4")
    n_params = 2 + 6 * 9 + 1  # debugmodel: embedding, output, 9 per block, final norm
    assert hsdp["all_reduce"] == fsdp["all_reduce"] + n_params
    assert hsdp["all_gather_into_tensor"] == fsdp["all_gather_into_tensor"] > n_params
    assert hsdp["reduce_scatter_tensor"] == fsdp["reduce_scatter_tensor"] > n_params


def test_fused_attention_on_meta_traces_one_op_and_restores_sdpa():
    """The dry run's attention: a fused op (no [seq, seq] scores) saved by SAC, GQA heads
    repeated; SDPA and torchtitan's save list are restored afterwards."""
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    from graph_trainer.projection.dry_run import fused_attention_on_meta

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    orig, saved = F.scaled_dot_product_attention, set(_op_sac_save_list)
    q = torch.empty(1, 4, 64, 16, device="meta")
    kv = torch.empty(1, 2, 64, 16, device="meta")

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with fused_attention_on_meta():
        assert op in _op_sac_save_list
        g = make_fx(attn)(q, kv, kv)
    targets = [n.target for n in g.graph.nodes if n.op == "call_function"]
    assert op in targets and not any("softmax" in str(t) for t in targets)
    assert F.scaled_dot_product_attention is orig and set(_op_sac_save_list) == saved
    assert any("softmax" in str(n.target) for n in make_fx(attn)(q, kv, kv).graph.nodes)  # math path outside
