"""The scale projection: cost model, device constants and flags, scripts/cost_constants.py, the dry run's."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.node_meta import tag_for_inductor
from graph_trainer.config import Projection, parse_args
from graph_trainer.errors import UserError
from graph_trainer.metrics import peak_bf16_for_name
from graph_trainer.model import build_model, flavors, loss_fn, model_args
from graph_trainer.projection import cost_model as P, devices as D
from graph_trainer.projection.dry_run import fused_attention_on_meta, fused_rms_norm_on_meta, restore_fused_rms_norm

from _runs import DEBUG, dry_run_in_process  # tests/ is on sys.path
from _scripts import load_script

aten = torch.ops.aten


def _dev(**kw):
    """Round constants for hand arithmetic: 1e15 FLOP/s, 1e12 B/s HBM, NVLink α 0 / 100 GB/s, NIC α 0 / 10 GB/s."""
    base = dict(name="h100", peak_bf16_flops=1e15, matmul_flops=1e15, attention_flops=5e14, hbm_Bps=1e12,
                nvlink=P.Link(0.0, 100e9), nic=P.Link(0.0, 10e9), memory_gib=80.0)
    return P.DeviceConstants(**{**base, **kw})


def _work(colls, matmul_flops=1e12):
    """A GraphWork with one matmul shape of ``matmul_flops`` (1 ms at 1e15 FLOP/s)."""
    return P.GraphWork({(8, 8, 8): matmul_flops}, {}, 0, [P.CollectiveOp(*c) for c in colls])


def test_a_regional_inductor_region_counts_as_one_fused_kernel():
    """``neg(x * 2 + 1)`` of a [256, 256] fp32 x: 3 kernels of 2 x 256 KiB, or in a region x read and the result written
    once; a region's matmul is its own kernel (its FLOPs, input and output outside); a lone tagged cast: a region."""
    gm = make_fx(lambda x, w: (((x * 2 + 1).neg() @ w).to(torch.bfloat16), x.to(torch.bfloat16)))(
        torch.randn(256, 256), torch.randn(256, 256))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target._opname for n in ops] == ["mul", "add", "neg", "mm", "_to_copy", "_to_copy"]
    assert P.graph_work(gm).memory_bytes == (3 * 512 + 384 + 384) * 1024  # KiB; bf16 casts: 256 KiB in, 128 out
    for n, region in zip(ops, ["r"] * 5 + ["cast"]):
        tag_for_inductor(n, {}, region)
    work = P.graph_work(gm)
    # r: x and the mm's output read, neg's output (the mm reads it) and the cast's written; then the lone cast
    assert work.memory_bytes == (256 + 256 + 256 + 128 + 384) * 1024 and work.matmul_flops == 2 * 256**3


def test_collective_costs_links_and_overlap_rule():
    """Ring busbw factors, TP-innermost groups, NVLink or NIC links; what the overlap rule leaves exposed."""
    cases = [("all_gather_into_tensor", 8), ("reduce_scatter_tensor", 2), ("all_reduce", 8), ("all_reduce", 1)]
    assert [P.ring_bytes_on_wire(kind, 800, n) for kind, n in cases] == pytest.approx([700, 400, 1400, 0])
    with pytest.raises(ValueError):
        P.ring_bytes_on_wire("gather", 8, 2)
    link = P.Link(5e-6, 100e9, {"all_reduce": (1e-6, 50e9)})
    assert P.collective_time("all_gather_into_tensor", 1e9, 2, link) == pytest.approx(5e-6 + 0.5e9 / 100e9)
    assert P.collective_time("all_reduce", 1e9, 2, link) == pytest.approx(1e-6 + 1e9 / 50e9)  # per-kind constants
    assert P.collective_time("all_reduce", 1e9, 1, link) == 0
    lay = P.Layout(dp_replicate=2, dp_shard=4, tp=2, gpus_per_node=8)
    assert [lay.group_ranks(d) for d in ("tp", "dp_shard", "dp_replicate", "dp", "dp_shard_tp", "world")] == [
        [0, 1], [0, 2, 4, 6], [0, 8], list(range(0, 16, 2)), list(range(8)), list(range(16))]
    with pytest.raises(KeyError):
        lay.group_ranks("pp")
    assert P.link_for(lay.group_ranks("dp_shard"), 8, dev := _dev()) == ("nvlink", dev.nvlink)
    assert P.link_for(lay.group_ranks("dp_replicate"), 8, dev) == ("network", P.Link(0.0, 10e9))  # 1 GPU per node
    assert P.link_for(lay.group_ranks("dp"), 8, dev)[1].busbw_Bps == 40e9  # 4 GPUs per node
    assert P.link_for(range(64), 8, dev)[1].busbw_Bps == 80e9  # 8 NICs
    assert P.link_for(range(64), 8, _dev(nic=P.Link(0.0, 50e9)))[1].busbw_Bps == 100e9  # capped at NVLink
    assert P.link_for(lay.group_ranks("dp_shard"), 4, dev)[0] == "network"  # nodes of 4 GPUs
    ag, rs, gb = "all_gather_into_tensor", "reduce_scatter_tensor", 10**9  # overlap rule: 0.1 GB, 0.5 ms on 2 ranks
    colls = [(ag, "dp_shard", gb // 10, 0), (ag, "dp_shard", gb // 10, 5), (ag, "tp", gb // 10, 7),
             (rs, "dp_shard", gb // 10, 10), (rs, "dp_shard", gb // 10, 20)]
    lay, kw = P.Layout(dp_shard=2, tp=2), dict(tokens_per_rank=1000, flops_per_token=1e9)
    p = P.project(_work(colls, 2e12), lay, _dev(), **kw)  # compute 2 ms, each collective 0.5 ms
    assert (p.compute_s, p.step_s, p.tps_per_gpu) == pytest.approx((2e-3, 3.5e-3, 1000 / (3.5e-3 * 2)))
    rows = {(c["kind"], c["dim"]): c["exposed_s"] for c in p.comm}  # FSDP's first all-gather only, last RS only
    assert [rows[k] for k in ((ag, "dp_shard"), (rs, "dp_shard"), (ag, "tp"))] == pytest.approx([0.5e-3] * 3)
    assert p.mfu == pytest.approx(100 * 1e9 * p.tps_per_gpu / 1e15)
    # async TP hides the TP all-gather (the middle ones, 1.5 ms, fit under 2 ms); less compute leaves FSDP's showing
    async_tp = P.project(_work(colls, 2e12), lay, _dev(), overlap=P.Overlap(async_tp=True), **kw)
    assert async_tp.step_s == pytest.approx(3e-3)
    short = P.project(_work(colls, 0.4e12), lay, _dev(), **kw)  # compute 0.4 ms < 1.0 ms of middle FSDP
    assert short.exposed_comm_s == pytest.approx(0.5e-3 * 3 + (1.0e-3 - 0.4e-3))
    hsdp = colls + [("all_reduce", "dp_replicate", gb // 20, 15), ("all_reduce", "dp_replicate", gb // 20, 21)]
    h = P.project(_work(hsdp, 2e12), P.Layout(dp_replicate=2, dp_shard=2, tp=2), _dev(), **kw)  # HSDP
    row = {(c["kind"], c["dim"]): c for c in h.comm}[("all_reduce", "dp_replicate")]  # ranks 0 and 4 of one node
    assert row["link"] == "nvlink" and row["exposed_s"] == pytest.approx(0.5e-3)  # the last only, after the last RS
    assert h.step_s == pytest.approx(p.step_s + 0.5e-3)
    with pytest.raises(UserError):
        P.project(_work([("all_reduce", "?", 4, 0)]), lay, _dev(), **kw)


def test_dry_runs_trace_flops_match_torch_flop_counter_and_rms_norm_traced_as_a_gpu_runs_it():
    """The dry run's meta trace: FlopCounterMode's flops (matmuls exact, attention half: causal), CUDA's RMSNorm."""
    args = model_args("debugmodel", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64)
    model = build_model(args, "cpu", seed=0)
    state, tokens = {**dict(model.named_parameters()), **dict(model.named_buffers())}, torch.randint(0, 128, (2, 32))

    def step(state, tokens):
        logits = torch.func.functional_call(model, state, (tokens,))
        return torch.autograd.grad(loss_fn(logits, tokens), [v for v in state.values() if v.requires_grad])

    meta = ({k: v.detach().to("meta").requires_grad_(v.requires_grad) for k, v in state.items()}, tokens.to("meta"))
    op = aten._scaled_dot_product_flash_attention_for_cpu
    orig, saved = F.scaled_dot_product_attention, set(_op_sac_save_list)
    with fused_attention_on_meta():
        assert op.default in _op_sac_save_list
        gm = make_fx(step)(*meta)
    assert F.scaled_dot_product_attention is orig and set(_op_sac_save_list) == saved
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    scores = {aten._safe_softmax.default, aten._softmax.default}  # the math path's, outside the context
    assert op.default in targets and not scores & set(targets)
    assert scores & {n.target for n in make_fx(step)(*meta).graph.nodes}
    work = P.graph_work(gm)
    with FlopCounterMode(display=False) as plain:
        step(state, tokens)
    heads = lambda q, kv: (*kv[:1], q[1], *kv[2:])  # noqa: E731  GQA: k, v at q's heads (torch 2.11 needs it)
    sdpa = {op: lambda q, k, v, *a, **kw: sdpa_flop_count(q, heads(q, k), heads(q, v)),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
                lambda g, q, k, v, *a, **kw: sdpa_backward_flop_count(g, q, heads(q, k), heads(q, v))}
    with FlopCounterMode(display=False, custom_mapping=sdpa) as mapped:
        step(state, tokens)
    counts = plain.get_flop_counts()["Global"]
    assert set(counts) == {aten.mm} and work.matmul_flops == counts[aten.mm] > 0 and op not in flop_registry
    assert sum(mapped.get_flop_counts()["Global"][o] for o in sdpa) == 2 * work.attention_flops > 0
    assert mapped.get_total_flops() == work.matmul_flops + 2 * work.attention_flops
    assert list(work.attention) == [(2, 4, 32, 16)]  # (B, H, S, D) of the query
    assert (64, 64, 128) in work.matmuls  # sorted (M, N, K): the output projection, [64, 64] @ [64, 128]
    assert work.memory_bytes >= 2 * tokens.numel() * 128 * 4  # other ops read inputs, write outputs: the fp32 logits
    views = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.view.default]
    assert views and all(P.memory_op_bytes(n) == 0 for n in views)
    x, w = (torch.empty(*s, dtype=torch.bfloat16, device="meta", requires_grad=True) for s in ((2, 64, 32), (32,)))

    def norm_step(x, w):  # CUDA's fused RMSNorm traced on meta: fewer bytes live, same shapes
        return torch.autograd.grad(F.rms_norm(x, [32], w, 1e-5).float().sum(), (x, w))

    orig = F.rms_norm
    with fused_rms_norm_on_meta():
        gm = make_fx(norm_step)(x, w)
    assert F.rms_norm is orig and restore_fused_rms_norm(gm) == 1
    plain, targets = make_fx(norm_step)(x, w), {n.target for n in gm.graph.nodes}
    assert {aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default} <= targets
    assert aten.rsqrt.default not in targets  # the forward not decomposed
    assert aten._fused_rms_norm_backward.default not in {n.target for n in plain.graph.nodes}
    assert [n.meta["val"].shape for n in gm.graph.find_nodes(op="output")[0].all_input_nodes] == [x.shape, w.shape]
    assert estimate_peak_memory(gm)[0] < estimate_peak_memory(plain)[0]


def test_cost_constants_device_constants_and_flags(tmp_path):
    """scripts/cost_constants.py's α–β fit and TP-split shapes; its measurements applied; the [projection] flags."""
    cc = load_script("cost_constants")
    fit = cc.fit_alpha_beta([(w, 12e-6 + w / 300e9) for w in (2**p for p in range(14, 31))])
    assert fit == pytest.approx((12e-6, 300e9), rel=1e-6)
    assert cc.ring_factor("all_reduce", 4) == 1.5 and cc.ring_factor("all_gather_into_tensor", 4) == 0.75
    shapes = {name: (m, i, o) for name, m, i, o in cc.linear_shapes(["8B"], [1, 2])}
    assert shapes["8B tp1 w1/w3"] == (8192, 4096, 14336) and shapes["8B tp2 w1/w3"] == (8192, 4096, 7168)
    assert len(keys := [tuple(sorted(s)) for s in shapes.values()]) == len(set(keys))  # one row per projection key
    assert "8B tp2 w2" not in shapes and tuple(sorted((8192, 14336 // 2, 4096))) in keys  # w2 under TP2: w1's key
    assert ("8B tp2 b1 s8192", 1, 16, 4, 8192, 128) in cc.attention_shapes(["8B"], [2])
    h100 = D._default_devices()["h100"]
    assert h100.source == "datasheet defaults" and h100.matmul_flops == h100.peak_bf16_flops
    assert h100.peak_bf16_flops == peak_bf16_for_name("NVIDIA H100 80GB HBM3")
    assert h100.hbm_Bps < D._default_devices()["h200"].hbm_Bps
    data = {"device": "NVIDIA H100 80GB HBM3", "matmul_tflops": 700.0, "hbm_gbps": 3000.0, "attention_tflops": 400.0,
            "matmul": [{"m": 8192, "n": 4096, "k": 14336, "tflops": 650.0}],
            "attention": [{"b": 1, "h": 32, "s": 8192, "d": 128, "tflops": 420.0}],
            "nccl": {"all_reduce": {"alpha_us": 20.0, "busbw_gbps": 360.0},
                     "all_gather_into_tensor": {"alpha_us": 10.0, "busbw_gbps": 380.0}}}
    m = D.apply_measurements(D._default_devices()["h100"], data)
    assert m.matmul_flops == 700e12 and m.matmul_by_shape[(4096, 8192, 14336)] == 650e12
    assert m.attention_by_shape[(1, 32, 8192, 128)] == 420e12 and m.hbm_Bps == 3e12
    assert (*m.nvlink.constants("all_reduce"), m.nvlink.busbw_Bps) == pytest.approx((20e-6, 360e9, 370e9))  # 370: mean
    assert m.measured == ("matmul", "attention", "hbm", "nvlink") and "measured" in m.source and m.nic == h100.nic
    net = {"all_gather_into_tensor": {"alpha_us": 30.0, "busbw_gbps": 320.0, "gpus_per_node": 8}}
    nic = D.apply_measurements(h100, {"nccl_network": net}).nic
    assert (nic.alpha_s, nic.busbw_Bps) == pytest.approx((30e-6, 40e9))  # busbw per NIC
    # the [projection] flags -> device constants, node size and overlap; a bad value: one line naming its flag
    dev, gpn, overlap = P.settings(Projection())
    assert (dev.name, gpn, overlap) == ("h100", 8, P.Overlap()) and "measured" in dev.source  # committed h100.json
    (f := tmp_path / "h200.json").write_text('{"device": "NVIDIA H200", "hbm_gbps": 4300}')
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


def test_dry_run_prints_the_projection(log_lines):
    """Debug model, FSDP2 x TP2 on 4 fake ranks, nodes of 2: TP on NVLink, FSDP on the network; consistent figures."""
    seq = 64
    p = dry_run_in_process(4, "--training.seq_len", str(seq), "--compile.sac.save", "all",
                           "--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                           "--projection.device", "h200", "--projection.gpus_per_node", "2")["projection"]
    assert p["device"] == "h200" and p["gpus_per_node"] == 2
    links = {c["dim"]: c["link"] for c in p["comm"] if c["kind"] == "all_gather_into_tensor"}
    assert (links["tp"], links["dp_shard"]) == ("nvlink", "network")
    assert all(c["exposed_ms"] <= c["time_ms"] + 1e-9 for c in p["comm"])
    assert p["step_ms"] == pytest.approx(p["compute_ms"] + p["exposed_comm_ms"], abs=0.02)
    tokens = parse_args(["--job.config_file", DEBUG]).training.local_batch_size * seq
    assert p["tps_per_gpu"] == pytest.approx(tokens / (p["step_ms"] * 1e-3 * 2), rel=2e-2)  # step_ms is rounded
    # no recompute: torchtitan's 6N + 12·L·H·D·S attention (non-causal, 2x backward), halved, FA2's 2.5x backward
    attn = 12 * (f := flavors()["debugmodel"]).n_layers * f.n_heads * (f.dim // f.n_heads) * seq
    assert p["graph_flops_per_token"] == pytest.approx(p["flops_per_token"] - attn + attn / 2 * 3.5 / 3, rel=0.01)
    assert "projection on H200" in "\n".join(log_lines) and "tps/GPU" in "\n".join(log_lines)

