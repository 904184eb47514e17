"""``COMM_MODE=fake_collectives``: rank 0 of an NGPU-rank layout in one process, collectives local copies."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from graph_trainer.distributed.parallelize import materialize_meta_shards
from graph_trainer.metrics import read_metrics

import _early  # tests/ is on sys.path
from _launch import fork_call
from _runs import REPO, SMALL, launch_env, run_debug


@_early.job("fake_collectives_fsdp32_tp2")
def _fake_collectives_run(tmp, env):
    """COMM_MODE=fake_collectives NGPU=64 ./run_train.sh, FSDP32 x TP2: ``(its dump folder, its result)``."""
    d = tmp / "out"
    return d, run_debug(d, SMALL, "--compile.inductor_compilation", "none", "--parallelism.data_parallel_shard_degree",
                        "32", "--parallelism.tensor_parallel_degree", "2", steps=3, ngpu=64,
                        env=launch_env(env, COMM_MODE="fake_collectives"))


@_early.uses("fake_collectives_fsdp32_tp2")
def test_fake_collectives_trains_rank0_of_fsdp32_x_tp2_in_one_process():
    """NGPU=64, FSDP32xTP2 in one process: meta model, rank 0's shards, 64 ranks' collectives, finite losses."""
    dump, r = _early.result("fake_collectives_fsdp32_tp2")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "COMM_MODE=fake_collectives: rank 0 of 64 ranks on cpu" in out and "[rank0]" not in out
    assert "Model built on the meta device; rank 0's shards are allocated on cpu" in out
    rows, summary = read_metrics(str(dump / "metrics.jsonl"))
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert all(math.isfinite(x["loss"]) and math.isfinite(x["grad_norm"]) for x in rows), rows  # defined data
    assert summary["comm_mode"] == "fake_collectives" and summary["tps"] > 0
    table = [line for line in out.splitlines() if line.startswith("| 0 | (input)")]  # the pass table's input row
    assert table and int(table[0].split("|")[6]) > 0, out[-3000:]  # its collectives


def _local_copy_semantics():  # forked: its own process group
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from graph_trainer.distributed import fake_pg

    fake_pg.init(4)
    f, x, y, world = torch.ops._c10d_functional, torch.arange(3.0), torch.arange(8.0), dist.group.WORLD.group_name
    assert dist.get_world_size() == 4 and dist.get_rank() == 0
    assert f.wait_tensor(f.all_gather_into_tensor(x, 4, world)).tolist() == [0, 1, 2] * 4
    assert f.wait_tensor(f.reduce_scatter_tensor(y, "sum", 4, world)).tolist() == [0, 1]
    assert f.wait_tensor(f.all_reduce(y, "sum", world)).tolist() == y.tolist()
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")).get_group("tp")
    assert tp.size() == 2 and tp.group_name != world
    assert f.wait_tensor(f.reduce_scatter_tensor(y, "sum", 2, tp.group_name)).tolist() == [0, 1, 2, 3]
    out = torch.full((2,), -1.0)
    dist.scatter(out, [torch.tensor([5.0, 6.0]), torch.zeros(2), torch.zeros(2), torch.zeros(2)], src=0)
    assert out.tolist() == [5, 6]
    dist.barrier()
    return "ok"


def test_local_copy_process_group_semantics():
    """4 ranks, a 2 x 2 mesh: all-gather, reduce-scatter, all-reduce and scatter as rank 0 sees them."""
    assert fork_call(_local_copy_semantics, timeout=300)() == "ok"


@pytest.mark.gpu
def test_local_copy_process_group_copies_on_a_side_stream():
    """CUDA: the copies are ordered on the side stream, also inside a replayed CUDA graph reusing freed blocks."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from graph_trainer.distributed import fake_pg
        fake_pg.init(4)
        f, world = torch.ops._c10d_functional, dist.group.WORLD.group_name
        x = torch.zeros(1 << 24, device="cuda")
        torch.cuda._sleep(100_000_000)  # the caller's stream busy before x is written
        x.fill_(3.0)
        y = f.wait_tensor(f.all_gather_into_tensor(x, 4, world)) * 2
        z = f.wait_tensor(f.reduce_scatter_tensor(y, "sum", 4, world)) + 1
        assert y.shape == (4 << 24,) and y.eq(6.0).all().item() and z.eq(7.0).all().item()
        assert list(fake_pg.SIDE_STREAMS) == [x.device]
        static = torch.zeros(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up before the capture, as torch's docs ask
            f.wait_tensor(f.all_gather_into_tensor(static + 1, 4, world))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = f.wait_tensor(f.all_gather_into_tensor(static + 1, 4, world)) * 2
        static.fill_(5.0)
        graph.replay()
        assert out.shape == (4 << 20,) and out.eq(12.0).all().item()
        reserved, mib16 = torch.cuda.memory_reserved(), 4 << 22  # one all-gather's output: 16 MiB
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # 20 all-gathers in a row, each output dropped after its use
            acc = static.clone()
            for _ in range(20):
                acc = acc + f.wait_tensor(f.all_gather_into_tensor(acc, 4, world)).view(4, -1)[3]
        graph.replay()
        assert acc.eq(5.0 * 2 ** 20).all().item()
        assert torch.cuda.memory_reserved() - reserved < 8 * mib16, "the capture kept freed blocks from reuse"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-3000:]


def test_materialize_meta_shards_norms_ones_others_normal():
    """Meta shards become fp32: norm weights ones, others N(0, 0.02); an allocated shard is kept."""
    names = ["layers.0.attention_norm.weight", "layers.0.attention.wq.weight", "norm.weight", "output.weight"]
    kept = torch.nn.Parameter(torch.full((4,), 3.0))
    shards = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in (8, 4096, 8)] + [kept]
    out = materialize_meta_shards(names, shards, torch.device("cpu"))
    assert all(isinstance(p, torch.nn.Parameter) and p.device.type == "cpu" and p.requires_grad for p in out)
    assert out[0].tolist() == [1.0] * 8 and out[2].tolist() == [1.0] * 8 and out[3] is kept
    assert torch.isfinite(out[1]).all() and 0.015 < out[1].std().item() < 0.025
