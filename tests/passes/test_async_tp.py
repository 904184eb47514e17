"""async_tp_pass on TP graphs of fake groups against Inductor's micro_pipeline_tp_pass, on gloo, in the 8B dry run."""

import copy
import dataclasses
import functools
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed._symmetric_memory as symm_mem
from torch._inductor.fx_passes.micro_pipeline_tp import (
    find_all_gather_patterns, find_reduce_scatter_patterns, micro_pipeline_tp_pass)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import _early  # tests/ is on sys.path
from _launch import queue, spawn
from _runs import DEBUG
from graph_trainer.compiler.collectives import collective_kind
from graph_trainer.compiler.graph_values import detect_graph_fake_mode, placeholder_vals
from graph_trainer.compiler.node_meta import phase_of
from graph_trainer.compiler.ops import RESHAPE_OPS
from graph_trainer.compiler.passes.async_tp import async_tp_pass, find_async_tp_matches
from graph_trainer.compiler.pipeline import build_pipeline, run_pipeline
from graph_trainer.compiler.registry import PipelineStep
from graph_trainer.config import parse_args
from graph_trainer.distributed import fake_pg, parallelize
from graph_trainer.model import build_model, loss_fn, model_args
from graph_trainer.projection import cost_model as P
from graph_trainer.projection.devices import _default_devices

from .conftest import AG, RS, aten, stats

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")  # funcol's old names

FUSED_AG, FUSED_RS = "fused_all_gather_matmul", "fused_matmul_reduce_scatter"
SUMMARY = "graph_trainer_pass_summary"  # the pass's gm.meta key
SAC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
L = 2  # blocks of the traced tiny Llama


def _kinds(gm, group_name=None) -> Counter:
    """``gm``'s collectives by kind: ``group_name``'s, or all and the matmuls ("mm")."""
    kinds = Counter("mm" for n in gm.graph.nodes if group_name is None and n.target is aten.mm.default)
    return kinds + Counter(k for n in gm.graph.nodes if (k := collective_kind(n)) and group_name in (None, *n.args))


def _refake(gm):
    """Fresh fake values through ``gm`` (the rewritten graph is valid, its ops have fake kernels)."""
    return FakeTensorProp(gm, detect_graph_fake_mode(gm)).propagate_dont_convert_inputs(*placeholder_vals(gm))


def _trace(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])


def _block(gather_dim: int, batch: int):
    """All-gather x on ``gather_dim``, q and k projections, their sum projected back and reduce-scattered."""
    def f(x, wq, wk):
        a = funcol.all_gather_tensor(torch.relu(x), gather_dim, dist.group.WORLD)  # an activation, not a shard
        q = torch.mm(a.reshape(-1, a.shape[-1]), wq).view(*a.shape[:-1], -1)
        k = torch.mm(a.reshape(-1, a.shape[-1]), wk).view(*a.shape[:-1], -1)
        o = torch.mm((q + k).reshape(-1, q.shape[-1]), wq.t()).view(*a.shape[:-1], -1)
        return funcol.reduce_scatter_tensor(o, "sum", gather_dim, dist.group.WORLD), a

    return _trace(f, [batch, 8, 16] if gather_dim == 1 else [8, 16], (16, 12), (16, 12))


def _inductor_pass(gm, group_name, as_reshapes=True):
    """Inductor's pass on a copy (views as reshapes), as on CUDA: ``(AGs fused, their matmuls, RSs fused, nodes)``."""
    gm = copy.deepcopy(gm)
    for n in gm.graph.nodes:
        if as_reshapes and n.op == "call_function" and n.target in RESHAPE_OPS:
            n.target = aten.reshape.default
    with mock.patch.object(dist, "is_nccl_available", lambda: True), symm_mem._test_mode({group_name}):
        micro_pipeline_tp_pass(gm.graph)
    fused = [n for n in gm.graph.nodes if collective_kind(n) in (FUSED_AG, FUSED_RS)]
    ags = [n for n in fused if collective_kind(n) == FUSED_AG]
    return len(ags), sum(len(n.args[1]) for n in ags), len(fused) - len(ags), fused


@pytest.mark.parametrize("gather_dim, batch, copies", [(1, 2, 3), (1, 1, 0), (0, 1, 0)])
def test_block_fuses_gather_and_scatter(gather_dim, batch, copies, fake_group):
    """split/getitem/cat (batch 2), the view (batch 1), 2-D on dim 0: both matmuls fused; the projection's view."""
    fake_group(2)
    gm = _block(gather_dim, batch)
    before, dims = _refake(gm), {dist.group.WORLD.group_name: "tp"}
    work, plan = P.graph_work(gm, dims), find_async_tp_matches(gm)
    (ag,), (rs,) = plan.all_gathers, plan.reduce_scatters
    assert (ag.reason, ag.gather_dim, len(ag.matmuls)) == (None, gather_dim, 2)
    assert (rs.reason, rs.scatter_dim) == (None, gather_dim)
    gm = async_tp_pass(gm, None)
    assert _kinds(gm) == {FUSED_AG: 1, FUSED_RS: 1}  # no matmul left
    assert stats(gm)["restrided"] == copies and "fake process group" in gm.meta[SUMMARY]
    fused = next(n for n in gm.graph.nodes if collective_kind(n) == FUSED_AG)
    assert fused.args[2] == gather_dim and fused.kwargs["return_A"]
    assert all(x.shape == y.shape and x.is_contiguous() for x, y in zip(_refake(gm), before))
    # the fused ops: aten.mm's FLOPs, their collectives on TP as sized before, fused and hidden under compute
    after = P.graph_work(gm, dims)
    assert after.matmul_flops == work.matmul_flops == 3 * 2 * (16 * batch) * 16 * 12
    assert [c.kind for c in work.collectives] == [AG, RS]
    assert [(c.kind, c.dim, c.size_bytes, c.fused) for c in after.collectives] == [
        (c.kind, "tp", c.size_bytes, True) for c in work.collectives]
    dev = dataclasses.replace(_default_devices()["h100"], matmul_flops=1e6)
    p = P.project(after, P.Layout(tp=2), dev, tokens_per_rank=16, flops_per_token=1.0)
    assert p.exposed_comm_s == 0 and all(c["async_tp"] for c in p.comm)


def test_left_unfused_with_a_reason_and_where_inductor_differs(fake_group):
    """Gather on the last dim, sums of matmuls, shared matmuls, chunks out of rank order; another phase's matmul."""
    fake_group(2)
    group = dist.group.WORLD
    gm = _trace(lambda x, w: torch.mm(funcol.all_gather_tensor(torch.relu(x), 1, group), w), (8, 16), (32, 4))
    assert find_async_tp_matches(gm).all_gathers[0].reason == "gather on the last dimension"

    def sums(x, w, v):
        s, y, u = torch.mm(x, w) + torch.mm(x, v), torch.mm(x, w), torch.mm(x, v) + x[:, :4]
        return [funcol.reduce_scatter_tensor(t, "sum", 0, group) for t in (s, y, u)], y

    gm = _trace(sums, (8, 16), (16, 4), (16, 4))
    sum_rs, other = "the reduce-scatter input is a sum of matmul outputs", "the matmul output has other users"
    assert [m.reason for m in find_async_tp_matches(gm, "0").reduce_scatters] == [sum_rs, other, sum_rs]
    code = gm.code
    async_tp_pass(gm, None, tp_group_name="0")
    assert gm.code == code and gm.meta[SUMMARY] == (
        f"nothing to fuse on TP group '0'; left 3 reduce-scatters (2: {sum_rs}; 1: {other})")

    def unordered(x, w):
        a, b = torch.split(torch.mm(x, w), 4, 1)
        return funcol.reduce_scatter_tensor(torch.cat([b, a]), "sum", 0, group)

    gm = _trace(unordered, (8, 16), (16, 8))
    assert [m.scatter_dim for m in find_reduce_scatter_patterns(gm.graph)] == [1]  # Inductor's, which ours reuses
    (rs,) = find_async_tp_matches(gm, group.group_name).reduce_scatters
    assert rs.reason == "reduce-scatter input not recognised (chunks out of rank order)"
    gm = _block(1, 2)  # a matmul of another phase (SAC's recompute) stays out
    [n for n in gm.graph.nodes if n.target is aten.mm.default][1].meta["custom"] = {"phase": "backward"}
    (ag,) = find_async_tp_matches(gm).all_gathers
    assert len(ag.matmuls) == 1 and ag.other_phase == 1
    assert _inductor_pass(gm, group.group_name)[:2] == (1, 2)  # Inductor's fuses SAC's recompute too
    gm = async_tp_pass(gm, None)
    assert _kinds(gm)["mm"] == 1  # the backward one stays
    _refake(gm)


def test_group_inference_fuse_option_and_modes(fake_group):
    """The TP group is that of the activation all-gathers (not a parameter shard's); fuse, rewrite, wrong groups."""
    fake_group(8)
    tp, fsdp = dist.new_group([0, 1]), dist.new_group([0, 2, 4, 6])

    def f(x, w_shard):
        w = funcol.all_gather_tensor(w_shard.to(torch.bfloat16), 0, fsdp)  # a parameter shard
        a = funcol.all_gather_tensor(torch.nn.functional.silu(x).to(torch.bfloat16), 0, tp)  # an activation
        return funcol.reduce_scatter_tensor(torch.mm(a, w.t()), "sum", 0, tp)

    gm = _trace(f, (8, 16), (2, 16))
    plan = find_async_tp_matches(gm)
    assert plan.group_name == tp.group_name and len(plan.all_gathers) == 1
    code = gm.code
    async_tp_pass(gm, None, rewrite=False)
    assert gm.code == code and "would fuse 1 all-gather->matmul" in gm.meta[SUMMARY]
    async_tp_pass(gm, None, tp_group_name=fsdp.group_name)
    assert gm.code == code and "nothing to fuse" in gm.meta[SUMMARY]
    gm = async_tp_pass(gm, None, fuse="matmul_reduce_scatter")
    assert _kinds(gm) == {AG: 2, FUSED_RS: 1}
    _refake(gm)
    with pytest.raises(ValueError, match="fuse must be one of"):
        async_tp_pass(gm, None, fuse="both")
    gm = async_tp_pass(_trace(f, (8, 16), (2, 16)), None)  # the matmul goes with its all-gather
    assert _kinds(gm) == {AG: 1, RS: 1, FUSED_AG: 1}
    assert "1: its matmul is fused with the all-gather of its input" in gm.meta[SUMMARY]
    _refake(gm)
    gm = async_tp_pass(_trace(lambda w: funcol.all_gather_tensor(w.to(torch.bfloat16), 0, fsdp).sum(), (2, 16)))
    assert gm.meta[SUMMARY].startswith("skipped: no all-gather of activations")


def test_fake_collectives_skip():
    """Rank 0 alone (``COMM_MODE=fake_collectives``) has no TP peers: skipped, not rewritten, whatever the device."""
    fake_pg.init(2)
    try:
        gm = _block(1, 2)
        code = gm.code
        async_tp_pass(gm, None)
        assert gm.code == code and gm.meta[SUMMARY].startswith("skipped: fake collectives"), gm.meta[SUMMARY]
    finally:
        dist.destroy_process_group()


def _traced_tp(world: int, shard: int, batch: int = 2, *flags, layers: int = L, dtype=torch.bfloat16):
    """FSDP ``shard`` x TP, traced, through the passes before async_tp: ``(gm, TraceParallel, real inputs)``."""
    parallelize._patch_torchtitan_device_type("cpu")
    cfg = parse_args(["--job.config_file", DEBUG, "--parallelism.tensor_parallel_degree", str(world // shard),
                      "--parallelism.data_parallel_shard_degree", str(shard), *flags])
    args = model_args("debugmodel", n_layers=layers, dim=64, n_heads=4, vocab_size=64)
    model = build_model(args, seed=0)
    pdims = parallelize.build_parallel_dims(cfg, world, args.n_heads, args.n_kv_heads)
    tpar = parallelize.distribute_for_trace(model, cfg, pdims, torch.device("cpu"), dist.get_rank(), world)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (batch, 16))
    traced = tpar.trace(model, functools.partial(loss_fn, dp_group=tpar.dp_group), tokens, tokens, dtype)
    gm = run_pipeline(traced.gm, None, ["remove_dead_code", "remove_noop_views", "sac_recompute",
                                        "reshard_after_forward"], quiet=True)
    return gm, tpar, (*tpar.params, *model.buffers(), tokens, tokens)


@pytest.mark.parametrize("world, shard, batch, flags, inductor, misread", [
    (2, 1, 2, (), (9, 15, 5), 0),
    (2, 1, 1, (), (0, 0, 0), 10),  # batch 1: Inductor's sees neither funcol's one view nor remove_noop_views' one
    (8, 4, 2, SAC_OP, (5, 5, 5), 4),
], ids=["tp2", "tp2_batch1", "fsdp4xtp2_op_sac"])
def test_traced_llama_and_inductors_pass(world, shard, batch, flags, inductor, misread, fake_group):
    """Per block: attention / FFN inputs' AGs, wo / w2 RSs, their gradients' AGs; the output's. Inductor's too."""
    fake_group(world)
    gm, tpar, _ = _traced_tp(world, shard, batch, *flags)
    tp = tpar.tp_mesh.get_group().group_name
    assert _inductor_pass(gm, tp, as_reshapes=False)[:3] == (0, 0, 0)
    ours = {m.ag: m.gather_dim for m in find_async_tp_matches(gm, tp).all_gathers}
    theirs = [a for a in find_all_gather_patterns(gm.graph) if a.group_name == tp]
    assert len(theirs) == len(ours) and sum(a.gather_dim != ours[a.ag_node] for a in theirs) == misread
    *counts, fused = _inductor_pass(gm, tp)
    assert tuple(counts) == inductor and (fused or not any(inductor)) and all("val" not in n.meta for n in fused)
    fsdp_before = _kinds(gm, tpar.fsdp_group.group_name) if tpar.fsdp_group is not None else None
    mms_before, before = _kinds(gm)["mm"], _refake(gm)
    key = ("all_gather_fused", "matmuls_fused", "reduce_scatter_fused", "all_gather_left", "reduce_scatter_left")
    off = stats(async_tp_pass(gm, None, rewrite=False))
    gm = async_tp_pass(gm, None)
    s = stats(gm)  # reduce-scatters: wo / w2, the output; left: the input gradients' sums
    assert tuple(off[k] for k in key) == tuple(s[k] for k in key) == (4 * L + 1, 7 * L + 1, 2 * L + 1, 1, 2 * L + 1)
    kinds = _kinds(gm, tp)  # left, then fused
    assert (kinds[AG], kinds[RS], kinds[FUSED_AG], kinds[FUSED_RS]) == (1, 2 * L + 1, 4 * L + 1, 2 * L + 1)
    assert fsdp_before is None or _kinds(gm, tpar.fsdp_group.group_name) == fsdp_before
    assert _kinds(gm)["mm"] == mms_before - s["matmuls_fused"] - (2 * L + 1)
    assert [phase_of(n) for n in gm.graph.nodes if collective_kind(n) == FUSED_AG].count("forward") == 2 * L + 1
    assert [tuple(x.shape) for x in _refake(gm)] == [tuple(x.shape) for x in before]


def test_pipeline_place_options_and_flag():
    """On by default on CUDA (regional, full Inductor), else opt-in (micro_pipeline_tp); flags and TP group reach it."""
    def options(*flags, device_type="cuda", **kw):  # async_tp's options; None: it does not run
        cfg = parse_args(["--job.config_file", DEBUG, *flags]).compile
        return {s.name: s.options for s in build_pipeline(cfg, device_type=device_type, **kw)}.get("async_tp")

    full = ("--compile.inductor_compilation", "full")
    assert options(device_type="cpu") is None and options(*full, device_type="cpu") is None
    assert options() is not None and options(*full) is not None
    assert options(*full, "--compile.disable_passes", "async_tp") is None
    assert options("--compile.passes", "micro_pipeline_tp", *full, "--compile.async_tp.fuse", "all_gather_matmul",
                   device_type=None, tp_group_name="7") == {"fuse": "all_gather_matmul", "tp_group_name": "7"}


def _gloo_worker(rank, world, store_path, q):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        gm, _, inputs = _traced_tp(world, 1, 2, layers=1, dtype=None)
        rec: list = []
        with torch.no_grad():
            ref = gm(*inputs)
            step = functools.partial(PipelineStep, "async_tp", async_tp_pass)
            auto = run_pipeline(copy.deepcopy(gm), None, [step({})], quiet=True, records=rec)
            skipped = (rec[-1]["summary"], all(map(torch.equal, auto(*inputs), ref)), auto.code == gm.code)
            lib = torch.library.Library("symm_mem", "IMPL")  # CPU kernels: torch's reference implementations
            lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback, "CPU")
            lib.impl("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback, "CPU")
            fused = run_pipeline(copy.deepcopy(gm), None, [step({"rewrite": True})], quiet=True, records=rec)
            rewritten = (rec[-1]["summary"], _kinds(fused), all(map(torch.equal, fused(*inputs), ref)))
        q.put((rank, skipped, rewritten))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_cpu_run_skips_bitwise_and_rewrite_matches_reference_gloo(tmp_path):
    """TP2 on gloo: skipped on CPU; forced, torch's reference kernels: bitwise."""
    q = queue()
    spawn(_gloo_worker, (2, str(tmp_path / "store"), q), 2)
    for rank, (summary, bitwise, same_code), (fused, kinds, fused_bitwise) in [q.get(timeout=60) for _ in range(2)]:
        assert summary.startswith("skipped: device cpu (the symm_mem fused ops are CUDA-only); would fuse 5 "
                                  "all-gather->matmul (8 matmuls) and 3 matmul->reduce-scatter on")
        assert bitwise and same_code
        assert fused.startswith("fused 5 all-gather->matmul (8 matmuls) and 3 matmul->reduce-scatter on")
        assert kinds[FUSED_AG] == 5 and kinds[FUSED_RS] == 3 and fused_bitwise, rank


@pytest.mark.slow
@_early.uses("dry_runs_8b")
def test_dry_run_8b_fsdp4_tp2_lists_fused_ops():
    """The session's 8B FSDP4 x TP2 dry run (tests/conftest.py): rewritten on the fake group, projected as fused."""
    s, messages = _early.result("dry_runs_8b")["fsdp4_tp2"]
    (line,) = [m for m in messages if m.startswith("graph pass async_tp")]
    ag, rs = 4 * 32 + 1, 2 * 32 + 1  # 32 blocks; rs: wo / w2 and the output
    assert f"fused {ag} all-gather->matmul ({7 * 32 + 1} matmuls) and {rs} matmul->reduce-scatter on TP group" in line
    # left: one all-gather and the 64 that all_but_cheap gathers again for the weight gradients' right operands; the
    # reduce-scatter of the (row-wise sharded) embedding's output, the sums of q/k/v's and w1/w3's input gradients
    assert ("left 65 all-gathers (65: no matmul reads the gathered tensor as its left operand), 65 reduce-scatters "
            "(1: the reduce-scatter input is not a matmul output; 64: the reduce-scatter input is a sum of matmul "
            "outputs)") in line
    assert {c["kind"]: c["ops"] for c in s["projection"]["comm"] if c["async_tp"]} == {AG: ag, RS: rs}
