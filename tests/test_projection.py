"""The scale projection's cost model (graph_trainer/projection/cost_model.py), its device constants
(graph_trainer/projection/devices.py) and ``[projection]`` flags, its constants script's fit
(scripts/cost_constants.py) and the dry run's projection (CPU, fake process group)."""

import importlib.util
import os

import pytest
import torch

from graph_trainer.config import Projection
from graph_trainer.errors import UserError
from graph_trainer.projection import cost_model as P
from graph_trainer.projection import devices as D

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dev(**kw):
    """Round constants for hand arithmetic: 1e15 FLOP/s, 1e12 B/s HBM, NVLink α 0 / 100 GB/s, NIC α 0 / 10 GB/s."""
    base = dict(name="h100", peak_bf16_flops=1e15, matmul_flops=1e15, attention_flops=5e14, hbm_Bps=1e12,
                nvlink=P.Link(0.0, 100e9), nic=P.Link(0.0, 10e9), memory_gib=80.0)
    return P.DeviceConstants(**{**base, **kw})


def test_ring_bytes_on_wire_follow_nccl_busbw_factors():
    assert P.ring_bytes_on_wire("all_gather_into_tensor", 800, 8) == pytest.approx(700)
    assert P.ring_bytes_on_wire("reduce_scatter_tensor", 800, 2) == pytest.approx(400)
    assert P.ring_bytes_on_wire("all_reduce", 800, 8) == pytest.approx(1400)
    assert P.ring_bytes_on_wire("all_reduce", 800, 1) == 0
    with pytest.raises(ValueError):
        P.ring_bytes_on_wire("gather", 8, 2)
    link = P.Link(5e-6, 100e9, {"all_reduce": (1e-6, 50e9)})
    assert P.collective_time("all_gather_into_tensor", 1e9, 2, link) == pytest.approx(5e-6 + 0.5e9 / 100e9)
    assert P.collective_time("all_reduce", 1e9, 2, link) == pytest.approx(1e-6 + 1e9 / 50e9)  # per-kind constants
    assert P.collective_time("all_reduce", 1e9, 1, link) == 0


def test_group_ranks_and_link_selection_intra_vs_inter_node():
    """Mesh order (dp_replicate, dp_shard, tp), TP innermost; NVLink inside a node, else the
    NICs of the group's GPUs per node (capped at NVLink)."""
    lay = P.Layout(dp_replicate=2, dp_shard=4, tp=2, gpus_per_node=8)
    assert lay.world == 16 and lay.degree("dp") == 8 and lay.degree("dp_shard_tp") == 8
    assert lay.group_ranks("tp") == [0, 1]
    assert lay.group_ranks("dp_shard") == [0, 2, 4, 6]
    assert lay.group_ranks("dp_replicate") == [0, 8]
    assert lay.group_ranks("dp") == [0, 2, 4, 6, 8, 10, 12, 14]
    assert lay.group_ranks("world") == list(range(16))
    with pytest.raises(KeyError):
        lay.group_ranks("pp")
    dev = _dev()
    assert P.link_for(lay.group_ranks("dp_shard"), 8, dev) == ("nvlink", dev.nvlink)
    name, link = P.link_for(lay.group_ranks("dp_replicate"), 8, dev)  # 1 GPU per node: one NIC
    assert name == "network" and link.busbw_Bps == 10e9
    assert P.link_for(lay.group_ranks("dp"), 8, dev)[1].busbw_Bps == 40e9  # 4 GPUs per node
    assert P.link_for(range(64), 8, dev)[1].busbw_Bps == 80e9  # 8 NICs
    assert P.link_for(range(64), 8, _dev(nic=P.Link(0.0, 50e9)))[1].busbw_Bps == 100e9  # capped at NVLink
    assert P.link_for(lay.group_ranks("dp_shard"), 4, dev)[0] == "network"  # nodes of 4 GPUs


def _work(colls, matmul_flops=1e12):
    """A GraphWork with one matmul shape of ``matmul_flops`` (1 ms at 1e15 FLOP/s)."""
    return P.GraphWork({(8, 8, 8): matmul_flops}, {}, 0, [P.CollectiveOp(*c) for c in colls])


def test_overlap_rule_first_gather_last_reduction_and_excess_exposed():
    """FSDP collectives hide under compute except the first all-gather and the last
    reduction; what exceeds compute shows; TP is exposed unless async TP."""
    gb = 10**9
    colls = [("all_gather_into_tensor", "dp_shard", gb // 10, 0),  # 1.0 ms each on 2 ranks at 100 GB/s / 2
             ("all_gather_into_tensor", "dp_shard", gb // 10, 5),
             ("all_gather_into_tensor", "tp", gb // 10, 7),
             ("reduce_scatter_tensor", "dp_shard", gb // 10, 10),
             ("reduce_scatter_tensor", "dp_shard", gb // 10, 20)]
    lay = P.Layout(dp_shard=2, tp=2)
    kw = dict(tokens_per_rank=1000, flops_per_token=1e9)
    p = P.project(_work(colls, 2e12), lay, _dev(), **kw)  # compute 2 ms, each collective 0.5 ms
    assert p.compute_s == pytest.approx(2e-3)
    rows = {(c["kind"], c["dim"]): c for c in p.comm}
    assert rows[("all_gather_into_tensor", "dp_shard")]["exposed_s"] == pytest.approx(0.5e-3)  # the first only
    assert rows[("reduce_scatter_tensor", "dp_shard")]["exposed_s"] == pytest.approx(0.5e-3)  # the last only
    assert rows[("all_gather_into_tensor", "tp")]["exposed_s"] == pytest.approx(0.5e-3)
    assert p.step_s == pytest.approx(3.5e-3)
    assert p.tps_per_gpu == pytest.approx(1000 / (3.5e-3 * 2))
    assert p.mfu == pytest.approx(100 * 1e9 * p.tps_per_gpu / 1e15)
    # async TP hides the TP all-gather (the middle ones, 1.5 ms, fit under 2 ms of compute);
    # less compute leaves the middle FSDP ones partly exposed
    async_tp = P.project(_work(colls, 2e12), lay, _dev(), overlap=P.Overlap(async_tp=True), **kw)
    assert async_tp.step_s == pytest.approx(3e-3)
    short = P.project(_work(colls, 0.4e12), lay, _dev(), **kw)  # compute 0.4 ms < 1.0 ms of middle FSDP
    assert short.exposed_comm_s == pytest.approx(0.5e-3 * 3 + (1.0e-3 - 0.4e-3))
    # HSDP: the last reduce-scatter and the last replica all-reduce after it are both exposed
    hsdp = colls + [("all_reduce", "dp_replicate", gb // 20, 15), ("all_reduce", "dp_replicate", gb // 20, 21)]
    h = P.project(_work(hsdp, 2e12), P.Layout(dp_replicate=2, dp_shard=2, tp=2), _dev(), **kw)
    rows = {(c["kind"], c["dim"]): c for c in h.comm}
    assert rows[("all_reduce", "dp_replicate")]["link"] == "nvlink"  # ranks 0 and 4 of one node
    assert rows[("all_reduce", "dp_replicate")]["exposed_s"] == pytest.approx(0.5e-3)  # the last only
    assert h.step_s == pytest.approx(p.step_s + 0.5e-3)
    with pytest.raises(UserError):
        P.project(_work([("all_reduce", "?", 4, 0)]), lay, _dev(), **kw)


def test_flops_and_bytes_of_a_traced_attention_step_match_hand_count():
    """make_fx of q/k/v projections + causal fused SDPA + its backward on meta tensors:
    matmul 2·M·N·K per product, attention 4·B·H·S²·D·½ forward and 2.5x that backward."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.projection.dry_run import fused_attention_on_meta

    B, S, H, D = 2, 64, 4, 16
    E = H * D

    def step(x, w):
        q, k, v = (x @ w.t()).view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out.float().square().sum(), w)

    x = torch.empty(B * S, E, device="meta")
    w = torch.empty(3 * E, E, device="meta", requires_grad=True)
    with fused_attention_on_meta():
        gm = make_fx(step)(x, w)
    work = P.graph_work(gm)
    mm = 2 * (B * S) * (3 * E) * E
    assert work.matmul_flops == 2 * mm  # forward + weight gradient (x needs no gradient)
    fwd = 4 * B * H * S * S * D / 2
    assert work.attention_flops == pytest.approx(fwd * 3.5)
    assert list(work.attention) == [(B, H, S, D)]
    assert sum(work.matmuls.values()) == work.matmul_flops and tuple(sorted((B * S, 3 * E, E))) in work.matmuls
    # every other op reads its inputs and writes its output: at least the fp32 cast and square
    assert work.memory_bytes >= 2 * (B * H * S * D * 4)
    views = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.view.default]
    assert views and all(P.memory_op_bytes(n) == 0 for n in views)
    # the dry run's CPU flash op has no formula in torch's registry: counted by the GPU flash op's
    from torch.utils.flop_counter import flop_registry

    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu not in flop_registry


def test_graph_flops_match_torch_flop_counter_on_a_real_model_step():
    """The graph's FLOPs (graph_work on make_fx's trace) against FlopCounterMode on the same step
    of a small Llama3 run eagerly on CPU: matmuls exactly; attention half of torch's count
    (torch counts the whole S x S scores; here causal), with torch's SDPA formulas mapped onto
    the CPU flash op, which torch's registry lacks (it counts no attention FLOPs there)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from graph_trainer.model import build_model, loss_fn, model_args

    aten = torch.ops.aten
    args = model_args("debugmodel", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64)
    model = build_model(args, "cpu", seed=0)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    tokens = torch.randint(0, 128, (2, 32))

    def step(state, tokens):
        logits = torch.func.functional_call(model, state, (tokens,))
        return torch.autograd.grad(loss_fn(logits, tokens), [v for v in state.values() if v.requires_grad])

    work = P.graph_work(make_fx(step, tracing_mode="fake")(state, tokens))
    with FlopCounterMode(display=False) as plain:
        step(state, tokens)
    sdpa = {aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, **kw: sdpa_flop_count(q, k, v),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
                lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g, q, k, v)}
    with FlopCounterMode(display=False, custom_mapping=sdpa) as mapped:
        step(state, tokens)
    counts = plain.get_flop_counts()["Global"]
    assert set(counts) == {aten.mm} and work.matmul_flops == counts[aten.mm] > 0
    assert sum(mapped.get_flop_counts()["Global"][op] for op in sdpa) == 2 * work.attention_flops > 0
    assert mapped.get_total_flops() == work.matmul_flops + 2 * work.attention_flops


def test_device_constants_defaults_measurements_and_errors(tmp_path):
    from graph_trainer.metrics import peak_bf16_for_name

    h100 = D._default_devices()["h100"]
    assert h100.source == "datasheet defaults" and h100.matmul_flops == h100.peak_bf16_flops
    assert h100.peak_bf16_flops == peak_bf16_for_name("NVIDIA H100 80GB HBM3")
    assert h100.hbm_Bps < D._default_devices()["h200"].hbm_Bps
    data = {"device": "NVIDIA H100 80GB HBM3", "matmul_tflops": 700.0,
            "matmul": [{"m": 8192, "n": 4096, "k": 14336, "tflops": 650.0}],
            "attention_tflops": 400.0, "attention": [{"b": 1, "h": 32, "s": 8192, "d": 128, "tflops": 420.0}],
            "hbm_gbps": 3000.0,
            "nccl": {"all_reduce": {"alpha_us": 20.0, "busbw_gbps": 360.0},
                     "all_gather_into_tensor": {"alpha_us": 10.0, "busbw_gbps": 380.0}}}
    m = P.apply_measurements(D._default_devices()["h100"], data)
    assert m.matmul_flops == 700e12 and m.matmul_by_shape[(4096, 8192, 14336)] == 650e12
    assert m.attention_by_shape[(1, 32, 8192, 128)] == 420e12 and m.hbm_Bps == 3e12
    assert m.nvlink.constants("all_reduce") == pytest.approx((20e-6, 360e9))
    assert m.nvlink.busbw_Bps == pytest.approx(370e9)  # kinds not measured: the mean
    assert m.measured == ("matmul", "attention", "hbm", "nvlink") and "measured" in m.source
    assert m.nic == h100.nic  # not measured: the datasheet default stays
    net = {"all_gather_into_tensor": {"alpha_us": 30.0, "busbw_gbps": 320.0, "gpus_per_node": 8}}
    nic = P.apply_measurements(h100, {"nccl_network": net}).nic
    assert (nic.alpha_s, nic.busbw_Bps) == pytest.approx((30e-6, 40e9))  # busbw per NIC
    f = tmp_path / "c.json"
    f.write_text('{"device": "NVIDIA H200", "hbm_gbps": 4300}')
    with pytest.raises(UserError, match="--projection.cost_constants"):
        P.device_constants("h100", str(f))
    assert P.device_constants("h200", str(f)).hbm_Bps == 4.3e12
    with pytest.raises(UserError, match="--projection.device"):
        P.device_constants("a100")


def test_projection_flags_to_settings_and_one_line_errors(tmp_path):
    """``[projection]`` (graph_trainer.config.Projection) -> device constants, node size and
    overlap; every bad value is a one-line UserError naming its flag."""
    dev, gpn, overlap = P.settings(Projection())
    assert (dev.name, gpn, overlap) == ("h100", 8, P.Overlap())
    assert "measured" in dev.source  # the committed cost_constants/h100.json
    f = tmp_path / "h200.json"
    f.write_text('{"device": "NVIDIA H200", "hbm_gbps": 4300}')
    dev, gpn, overlap = P.settings(Projection(device="h200", gpus_per_node=4, async_tp=True, cost_constants=str(f)))
    assert (dev.name, dev.hbm_Bps, dev.measured, gpn) == ("h200", 4.3e12, ("hbm",), 4)
    assert overlap.async_tp and "tp" in overlap.dims()
    bad = [({"device": "a100"}, "--projection.device"), ({"gpus_per_node": 0}, "--projection.gpus_per_node"),
           ({"cost_constants": str(tmp_path / "none.json")}, "--projection.cost_constants"),
           ({"cost_constants": str(f)}, "--projection.cost_constants")]  # an H200 file for an H100
    for kw, flag in bad:
        with pytest.raises(UserError, match=flag) as e:
            P.settings(Projection(**kw))
        assert "\n" not in str(e.value)


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cost_constants_fit_and_shapes():
    """The α–β fit recovers the constants of synthetic points; the shapes are TP-split."""
    cc = _load_script("cost_constants")
    alpha, beta = 12e-6, 300e9
    pts = [(w, alpha + w / beta) for w in (2**p for p in range(14, 31))]
    a, b = cc.fit_alpha_beta(pts)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    assert cc.ring_factor("all_reduce", 4) == 1.5 and cc.ring_factor("all_gather_into_tensor", 4) == 0.75
    shapes = {name: (m, i, o) for name, m, i, o in cc.linear_shapes(["8B"], [1, 2])}
    assert shapes["8B tp1 w1/w3"] == (8192, 4096, 14336) and shapes["8B tp2 w1/w3"] == (8192, 4096, 7168)
    keys = [tuple(sorted(s)) for s in shapes.values()]
    assert len(keys) == len(set(keys))  # one row per projection key (w2 under TP2 = w1's key)
    assert "8B tp2 w2" not in shapes and tuple(sorted((8192, 14336 // 2, 4096))) in keys
    assert ("8B tp2 b1 s8192", 1, 16, 4, 8192, 128) in cc.attention_shapes(["8B"], [2])


def test_dry_run_prints_the_projection(monkeypatch, caplog):
    """Debug model, FSDP2 x TP2 on 4 fake ranks with nodes of 2 GPUs: TP inside a node on
    NVLink, FSDP across nodes on the network; the projection's figures are consistent."""
    import logging

    import torch.distributed as dist

    from graph_trainer.config import parse_args
    from graph_trainer.projection.dry_run import dry_run
    from graph_trainer.model import flavors

    monkeypatch.setenv("NGPU", "4")
    seq = 64
    cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
                      "--training.seq_len", str(seq), "--parallelism.data_parallel_shard_degree", "2",
                      "--parallelism.tensor_parallel_degree", "2", "--compile.sac.save", "all",
                      "--projection.device", "h200", "--projection.gpus_per_node", "2"])
    try:
        with caplog.at_level(logging.INFO, logger="graph_trainer"):
            s = dry_run(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    p = s["projection"]
    assert p["device"] == "h200" and p["gpus_per_node"] == 2
    links = {(c["kind"], c["dim"]): c["link"] for c in p["comm"]}
    assert links[("all_gather_into_tensor", "tp")] == "nvlink"
    assert links[("all_gather_into_tensor", "dp_shard")] == "network"
    assert all(c["exposed_ms"] <= c["time_ms"] + 1e-9 for c in p["comm"])
    assert p["step_ms"] == pytest.approx(p["compute_ms"] + p["exposed_comm_ms"], abs=0.02)
    tokens = cfg.training.local_batch_size * seq
    assert p["tps_per_gpu"] == pytest.approx(tokens / (p["step_ms"] * 1e-3 * 2), rel=2e-2)  # step_ms is rounded
    # no recompute: graph FLOPs = torchtitan's 6N + its attention term 12·L·H·D·S (forward
    # + 2x backward, non-causal) halved for causality and with FlashAttention-2's 2.5x backward
    f = flavors()["debugmodel"]
    attn = 12 * f.n_layers * f.n_heads * (f.dim // f.n_heads) * seq
    assert p["graph_flops_per_token"] == pytest.approx(p["flops_per_token"] - attn + attn / 2 * 3.5 / 3, rel=0.01)
    assert "projection on H200" in caplog.text and "tps/GPU" in caplog.text


def test_async_tp_fused_ops_count_matmul_flops_and_an_overlapped_collective():
    """The async-TP pass's symm_mem ops: their matmuls are matmul FLOPs, their collective is
    attributed to TP and hidden under compute (not an edge, not exposed)."""
    import torch.distributed._symmetric_memory  # noqa: F401  defines torch.ops.symm_mem
    from torch.utils.flop_counter import flop_registry

    # no formula in torch's registry: fused_tp_work maps them onto aten.mm's
    assert not {torch.ops.symm_mem.fused_all_gather_matmul, torch.ops.symm_mem.fused_matmul_reduce_scatter} & set(
        flop_registry)
    g = torch.fx.Graph()
    M, K, N, tp = 64, 32, 48, 2

    def ph(name, shape):
        n = g.placeholder(name)
        n.meta["val"] = torch.empty(shape, device="meta", dtype=torch.bfloat16)
        return n

    a_shard, b, w2 = ph("a", (M // tp, K)), ph("b", (K, N)), ph("w2", (N, K))
    ag = g.call_function(torch.ops.symm_mem.fused_all_gather_matmul.default, (a_shard, [b], 0, "tp_group"))
    ag.meta["val"] = (None, [torch.empty(M, N, device="meta", dtype=torch.bfloat16)])
    h = g.call_function(__import__("operator").getitem, (ag, 1))
    h.meta["val"] = ag.meta["val"][1]
    h0 = g.call_function(__import__("operator").getitem, (h, 0))
    h0.meta["val"] = h.meta["val"][0]
    rs = g.call_function(torch.ops.symm_mem.fused_matmul_reduce_scatter.default, (h0, w2, "sum", 0, "tp_group"))
    rs.meta["val"] = torch.empty(M // tp, K, device="meta", dtype=torch.bfloat16)
    g.output(rs)
    work = P.graph_work(torch.fx.GraphModule(torch.nn.Module(), g), {"tp_group": "tp"})
    assert work.matmul_flops == 2 * M * K * N * 2 and work.memory_bytes == 0
    assert [(c.kind, c.dim, c.size_bytes, c.fused) for c in work.collectives] == [
        ("all_gather_into_tensor", "tp", M * K * 2, True), ("reduce_scatter_tensor", "tp", M * K * 2, True)]
    p = P.project(work, P.Layout(dp_shard=1, tp=tp), _dev(matmul_flops=1e6), tokens_per_rank=M, flops_per_token=1.0)
    assert p.exposed_comm_s == 0 and all(c["async_tp"] for c in p.comm)
