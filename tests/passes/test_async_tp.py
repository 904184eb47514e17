"""async_tp_pass: the matching on hand-built and traced TP graphs (fake 2- and 8-rank process
groups, one process), what Inductor's own micro_pipeline_tp_pass misses on them, the
pipeline and config wiring, the CPU run on 2 gloo ranks (the pass
skips, the step stays bitwise; with reference kernels for the fused ops the rewritten step
equals the traced one), and the 8B FSDP4 x TP2 dry run listing the fused ops."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from graph_trainer.compiler.passes.async_tp import async_tp_pass, find_async_tp_matches
from graph_trainer.compiler.common import (
    RESHAPE_OPS,
    collective_kind,
    detect_graph_fake_mode,
    is_collective,
    phase_of,
    placeholder_vals,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")  # funcol's old names (torch 2.11 too)

aten = torch.ops.aten
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUSED_AG = "fused_all_gather_matmul"
FUSED_RS = "fused_matmul_reduce_scatter"
SAC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")


@contextlib.contextmanager
def fake_group(world: int):
    """A fake process group of ``world`` ranks (rank 0) for the duration of the block."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"

    dist.init_process_group("fake", rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _kinds(gm) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if (k := collective_kind(n)) is not None:
            out[k] = out.get(k, 0) + 1
    return out


def _stats(gm) -> dict:
    return gm.meta["graph_trainer_pass_stats"]


def _summary(gm) -> str:
    return gm.meta["graph_trainer_pass_summary"]


def _refake(gm):
    """Propagate fresh fake values through ``gm`` (the rewritten graph is valid and its ops
    have fake kernels); returns the output values."""
    mode = detect_graph_fake_mode(gm)
    vals = placeholder_vals(gm)
    return FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)


# --------------------------------------------------------------------------- collective kinds


def test_fused_ops_are_collectives_with_a_kind():
    """The dry run counts collectives by collective_kind: the fused ops are counted, are
    collectives (never dead code, recomputed or put in a region) and have no wait."""
    import torch.distributed._symmetric_memory  # noqa: F401  defines the ops

    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    ag = g.call_function(torch.ops.symm_mem.fused_all_gather_matmul.default, (a, [b], 0, "0"))
    rs = g.call_function(torch.ops.symm_mem.fused_matmul_reduce_scatter.default, (a, b, "sum", 0, "0"))
    g.output((ag, rs))
    assert [collective_kind(ag), collective_kind(rs)] == [FUSED_AG, FUSED_RS]
    assert is_collective(ag) and is_collective(rs)


# --------------------------------------------------------------------------- hand-built graphs


def _trace(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])


def _block(gather_dim: int, batch: int):
    """A sequence-parallel block on the world group: all-gather x on ``gather_dim``, q and k
    projections, their sum projected back and reduce-scattered on ``gather_dim``."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    def f(x, wq, wk):
        a = funcol.all_gather_tensor(torch.relu(x), gather_dim, group)  # an activation, not a shard
        q = torch.mm(a.reshape(-1, a.shape[-1]), wq).view(*a.shape[:-1], -1)
        k = torch.mm(a.reshape(-1, a.shape[-1]), wk).view(*a.shape[:-1], -1)
        o = torch.mm((q + k).reshape(-1, q.shape[-1]), wq.t()).view(*a.shape[:-1], -1)
        return funcol.reduce_scatter_tensor(o, "sum", gather_dim, group), a

    shard = [batch, 8, 16] if gather_dim == 1 else [8, 16]
    return _trace(f, shard, (16, 12), (16, 12))


@pytest.mark.parametrize("gather_dim, batch, copies", [(1, 2, 3), (1, 1, 0), (0, 1, 0)])
def test_block_fuses_gather_and_scatter(gather_dim, batch, copies):
    """split/getitem/cat (batch 2), the view shortcut (batch 1) and the 2-D gather on dim 0:
    one fused all-gather with both projections, one fused reduce-scatter; the gathered
    tensor stays an output (return_A); permuted layouts get contiguous copies."""
    with fake_group(2):
        gm = _block(gather_dim, batch)
        before = _refake(gm)
        plan = find_async_tp_matches(gm)
        (ag,), (rs,) = plan.all_gathers, plan.reduce_scatters
        assert (ag.reason, ag.gather_dim, len(ag.matmuls)) == (None, gather_dim, 2)
        assert (rs.reason, rs.scatter_dim) == (None, gather_dim)
        gm = async_tp_pass(gm, None)
        assert _kinds(gm) == {FUSED_AG: 1, FUSED_RS: 1}
        assert _stats(gm)["restrided"] == copies and "fake process group" in _summary(gm)
        fused = next(n for n in gm.graph.nodes if collective_kind(n) == FUSED_AG)
        assert fused.args[2] == gather_dim and fused.kwargs.get("return_A", True)
        assert sum(n.target is aten.mm.default for n in gm.graph.nodes) == 0
        after = _refake(gm)
        for x, y in zip(after, before):
            assert x.shape == y.shape and x.is_contiguous()


def test_last_dim_sums_other_users_and_phases_stay():
    """Left as traced, with the reason: a gather on the last dimension, a reduce-scatter of a
    sum of matmuls, a matmul whose output is read elsewhere; a matmul of another phase is
    left out of the fused all-gather."""
    import torch.distributed._functional_collectives as funcol

    with fake_group(2):
        group = dist.group.WORLD

        def last(x, w):
            return torch.mm(funcol.all_gather_tensor(torch.relu(x), 1, group), w)

        gm = _trace(last, (8, 16), (32, 4))
        assert find_async_tp_matches(gm).all_gathers[0].reason == "gather on the last dimension"

        def sums(x, w, v):
            s = torch.mm(x, w) + torch.mm(x, v)
            y = torch.mm(x, w)
            return funcol.reduce_scatter_tensor(s, "sum", 0, group), funcol.reduce_scatter_tensor(y, "sum", 0, group), y

        gm = _trace(sums, (8, 16), (16, 4), (16, 4))
        reasons = [m.reason for m in find_async_tp_matches(gm, "0").reduce_scatters]
        assert reasons == ["the reduce-scatter input is a sum of matmul outputs", "the matmul output has other users"]

        gm = _block(1, 2)
        mms = [n for n in gm.graph.nodes if n.target is aten.mm.default]
        mms[1].meta["custom"] = {"phase": "backward"}  # as sac_recompute's copies
        (ag,) = find_async_tp_matches(gm).all_gathers
        assert len(ag.matmuls) == 1 and ag.other_phase == 1
        gm = async_tp_pass(gm, None)
        assert sum(n.target is aten.mm.default for n in gm.graph.nodes) == 1  # the backward one stays
        _refake(gm)


def test_group_inference_fuse_option_and_modes():
    """Only the TP group (the group of the activation all-gathers) is matched: an FSDP-like
    all-gather of a parameter shard on another group feeds the matmul's right operand and
    stays. ``fuse`` picks the kinds; ``rewrite=False`` only counts; a wrong group or a
    graph without TP changes nothing."""
    import torch.distributed._functional_collectives as funcol

    with fake_group(8):
        tp = dist.new_group([0, 1])
        fsdp = dist.new_group([0, 2, 4, 6])

        def f(x, w_shard):
            w = funcol.all_gather_tensor(w_shard.to(torch.bfloat16), 0, fsdp)  # a parameter shard
            a = funcol.all_gather_tensor(torch.nn.functional.silu(x).to(torch.bfloat16), 0, tp)  # an activation
            return funcol.reduce_scatter_tensor(torch.mm(a, w.t()), "sum", 0, tp)

        gm = _trace(f, (8, 16), (2, 16))
        plan = find_async_tp_matches(gm)
        assert plan.group_name == tp.group_name and len(plan.all_gathers) == 1
        code = gm.code
        async_tp_pass(gm, None, rewrite=False)
        assert gm.code == code and "would fuse 1 all-gather->matmul" in _summary(gm)
        async_tp_pass(gm, None, tp_group_name=fsdp.group_name)
        assert gm.code == code and "nothing to fuse" in _summary(gm)
        gm = async_tp_pass(gm, None, fuse="matmul_reduce_scatter")
        assert _kinds(gm) == {"all_gather_into_tensor": 2, FUSED_RS: 1}
        _refake(gm)
        with pytest.raises(ValueError, match="fuse must be one of"):
            async_tp_pass(gm, None, fuse="both")
        gm = async_tp_pass(_trace(f, (8, 16), (2, 16)), None)  # the matmul goes with its all-gather
        assert _kinds(gm) == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, FUSED_AG: 1}
        assert "1: its matmul is fused with the all-gather of its input" in _summary(gm)
        _refake(gm)

        gm = _trace(lambda w: funcol.all_gather_tensor(w.to(torch.bfloat16), 0, fsdp).sum(), (2, 16))
        async_tp_pass(gm, None)
        assert _summary(gm).startswith("skipped: no all-gather of activations")


# --------------------------------------------------------------------------- traced TP graphs


def _traced_tp(world: int, shard: int, batch: int = 2, *flags):
    """Trace the tiny Llama (2 blocks) under FSDP ``shard`` x TP ``world // shard`` on the
    current (fake) process group; ``(graph after the passes before async_tp, TraceParallel)``."""
    from graph_trainer.config import parse_args
    from graph_trainer.model import build_model, loss_fn, model_args
    from graph_trainer.distributed.parallelize import _patch_torchtitan_device_type, build_parallel_dims, distribute_for_trace
    from graph_trainer.compiler.pipeline import run_pipeline

    _patch_torchtitan_device_type("cpu")
    cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
                      "--parallelism.tensor_parallel_degree", str(world // shard),
                      "--parallelism.data_parallel_shard_degree", str(shard), *flags])
    args = model_args("debugmodel", n_layers=2, dim=64, n_heads=4, vocab_size=64)
    model = build_model(args, seed=0)
    pdims = build_parallel_dims(cfg, world, args.n_heads, args.n_kv_heads)
    tpar = distribute_for_trace(model, cfg, pdims, torch.device("cpu"), 0, world)
    tokens = torch.randint(0, 64, (batch, 16))
    traced = tpar.trace(model, functools.partial(loss_fn, dp_group=tpar.dp_group), tokens, tokens, torch.bfloat16)
    gm = run_pipeline(traced.gm, None, ["remove_dead_code", "remove_noop_views", "sac_recompute",
                                        "reshard_after_forward"], quiet=True)
    return gm, tpar


def _group_kinds(gm, group_name) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        k = collective_kind(n)
        if k is not None and group_name in n.args:
            out[k] = out.get(k, 0) + 1
    return out


@pytest.mark.parametrize("world, shard, flags", [(2, 1, ()), (8, 4, SAC_OP)], ids=["tp2", "fsdp4xtp2_op_sac"])
def test_traced_llama_blocks(world, shard, flags):
    """Per block (L = 2): the attention and FFN input all-gathers with their 3 / 2
    projections and the wo / w2 reduce-scatters in the forward, the all-gathers of the wo /
    w2 output gradients with their input-gradient matmul in the backward, plus the output
    projection's all-gather and its input gradient's reduce-scatter. Left: the embedding's
    reduce-scatter and its backward all-gather, and the backward reduce-scatters of the
    q/k/v and w1/w3 input gradients (sums of matmuls). FSDP's collectives are untouched;
    under op-level SAC the recomputed projections stay plain matmuls of the backward."""
    layers = 2
    with fake_group(world):
        gm, tpar = _traced_tp(world, shard, 2, *flags)
        tp = tpar.tp_mesh.get_group().group_name
        fsdp_before = _group_kinds(gm, tpar.fsdp_group.group_name) if tpar.fsdp_group is not None else {}
        mms_before = sum(n.target is aten.mm.default for n in gm.graph.nodes)
        before = _refake(gm)
        gm = async_tp_pass(gm, None)
        s = _stats(gm)
        assert (s["all_gather_fused"], s["matmuls_fused"], s["reduce_scatter_fused"]) == (
            4 * layers + 1, 7 * layers + 1, 2 * layers + 1)
        assert (s["all_gather_left"], s["reduce_scatter_left"]) == (1, 2 * layers + 1)
        assert "the reduce-scatter input is a sum of matmul outputs" in _summary(gm)
        kinds = _group_kinds(gm, tp)
        assert (kinds["all_gather_into_tensor"], kinds["reduce_scatter_tensor"]) == (1, 2 * layers + 1)
        assert (kinds[FUSED_AG], kinds[FUSED_RS]) == (4 * layers + 1, 2 * layers + 1)
        if tpar.fsdp_group is not None:
            assert _group_kinds(gm, tpar.fsdp_group.group_name) == fsdp_before
        assert sum(n.target is aten.mm.default for n in gm.graph.nodes) == mms_before - s["matmuls_fused"] - (
            2 * layers + 1)
        fused_phases = [phase_of(n) for n in gm.graph.nodes if collective_kind(n) == FUSED_AG]
        assert fused_phases.count("forward") == 2 * layers + 1
        after = _refake(gm)
        assert [tuple(x.shape) for x in after] == [tuple(x.shape) for x in before]


# --------------------------------------------------------------------------- Inductor's own pass


def _as_reshapes(gm):
    """``gm`` with every ``view`` / ``_unsafe_view`` retargeted to ``aten.reshape`` (the op of
    Inductor's post-grad graph that its matmul patterns look for; same values)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in RESHAPE_OPS:
            n.target = aten.reshape.default
    gm.recompile()
    return gm


def _inductor_pass(gm, group_name):
    """Run Inductor's ``micro_pipeline_tp_pass`` on ``gm`` as on a CUDA host with symmetric
    memory enabled for ``group_name`` only (NCCL reported available, torch's symmetric-memory
    test mode): ``(all-gathers fused, matmuls in them, reduce-scatters fused, fused nodes)``."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch._inductor.fx_passes.micro_pipeline_tp import micro_pipeline_tp_pass

    with mock.patch.object(dist, "is_nccl_available", lambda: True), symm_mem._test_mode({group_name}):
        micro_pipeline_tp_pass(gm.graph)
    gm.recompile()
    fused = [n for n in gm.graph.nodes if collective_kind(n) in (FUSED_AG, FUSED_RS)]
    ags = [n for n in fused if collective_kind(n) == FUSED_AG]
    return len(ags), sum(len(n.args[1]) for n in ags), len(fused) - len(ags), fused


@pytest.mark.parametrize("world, shard, batch, flags, inductor, misread", [
    (2, 1, 2, (), (9, 15, 5), 0),
    (2, 1, 1, (), (0, 0, 5), 10),
    (8, 4, 2, SAC_OP, (5, 5, 5), 4),
], ids=["tp2", "tp2_batch1", "fsdp4xtp2_op_sac"])
def test_inductor_micro_pipeline_tp_on_traced_graphs(world, shard, batch, flags, inductor, misread):
    """Why the all-gather side is ours, not Inductor's ``micro_pipeline_tp_pass`` (L = 2; ours
    fuses 4L+1 all-gathers with 7L+1 matmuls and 2L+1 reduce-scatters on each graph). On the
    graph as traced it fuses nothing: it finds matmuls through ``aten.reshape``, make_fx
    records ``view`` / ``_unsafe_view``. With those retargeted to ``reshape`` it fuses what
    ours fuses at batch 2, but at batch 1 (funcol's one-``view`` layout; Llama3 8B's batch)
    no all-gather, and under op-level SAC only the all-gathers whose layout SAC did not copy
    into the backward: ``misread`` all-gathers it takes for gathers on dim 0 of the
    rank-major buffer, read by no matmul. Its fused nodes carry no fake value."""
    from torch._inductor.fx_passes.micro_pipeline_tp import find_all_gather_patterns

    layers = 2
    with fake_group(world):
        gm, tpar = _traced_tp(world, shard, batch, *flags)
        tp = tpar.tp_mesh.get_group().group_name
        plan = find_async_tp_matches(gm, tp)
        assert (len(plan.fusible_all_gathers), sum(len(m.matmuls) for m in plan.fusible_all_gathers),
                len(plan.fusible_reduce_scatters)) == (4 * layers + 1, 7 * layers + 1, 2 * layers + 1)
        assert _inductor_pass(copy.deepcopy(gm), tp)[:3] == (0, 0, 0)
        ours = {m.ag: m.gather_dim for m in plan.all_gathers}
        theirs = [a for a in find_all_gather_patterns(gm.graph) if a.group_name == tp]
        assert len(theirs) == len(ours) and sum(a.gather_dim != ours[a.ag_node] for a in theirs) == misread
        *counts, fused = _inductor_pass(_as_reshapes(gm), tp)
        assert tuple(counts) == inductor
        assert fused and all("val" not in n.meta for n in fused)


def test_inductor_micro_pipeline_tp_other_phase_and_chunk_order():
    """The two other rules ours adds to Inductor's: a matmul of another phase (SAC's recomputed
    projection in the backward) stays out of the forward's fused all-gather, where
    Inductor's pass fuses it too; a reduce-scatter of chunks concatenated out of rank order
    is not a scatter of the matmul, where Inductor's finder (which ours reuses) takes it for
    one on dimension 1."""
    import torch.distributed._functional_collectives as funcol
    from torch._inductor.fx_passes.micro_pipeline_tp import find_reduce_scatter_patterns

    with fake_group(2):
        group = dist.group.WORLD
        gm = _block(1, 2)
        mms = [n for n in gm.graph.nodes if n.target is aten.mm.default]
        mms[1].meta["custom"] = {"phase": "backward"}
        assert len(find_async_tp_matches(gm).all_gathers[0].matmuls) == 1
        assert _inductor_pass(_as_reshapes(gm), group.group_name)[:2] == (1, 2)

        def unordered(x, w):
            a, b = torch.split(torch.mm(x, w), 4, 1)
            return funcol.reduce_scatter_tensor(torch.cat([b, a]), "sum", 0, group)

        gm = _trace(unordered, (8, 16), (16, 8))
        assert [m.scatter_dim for m in find_reduce_scatter_patterns(gm.graph)] == [1]
        (rs,) = find_async_tp_matches(gm, group.group_name).reduce_scatters
        assert rs.reason == "reduce-scatter input not recognised (chunks out of rank order)"


# --------------------------------------------------------------------------- pipeline and config


def test_pipeline_place_options_and_flag():
    """Opt-in by name (alias micro_pipeline_tp), after sac_recompute / reshard_after_forward
    and before overlap / bucketing and the Inductor passes; build_pipeline hands it
    --compile.async_tp.fuse and the TP group name."""
    from graph_trainer.config import parse_args
    from graph_trainer.compiler.pipeline import build_pipeline
    from graph_trainer.compiler.registry import PassContext, registry, resolve

    order = list(registry())
    i = order.index("async_tp")
    assert order.index("reshard_after_forward") < i < order.index("overlap_collectives")
    cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml")])
    assert "async_tp" not in resolve(PassContext(cfg.compile))
    cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
                      "--compile.passes", "micro_pipeline_tp", "--compile.async_tp.fuse", "all_gather_matmul",
                      "--compile.inductor_compilation", "full"])
    steps = build_pipeline(cfg.compile, tp_group_name="7")
    names = [s.name for s in steps]
    assert names.index("sac_recompute") < names.index("async_tp") < names.index("overlap_collectives") \
        < names.index("full_inductor")
    assert steps[names.index("async_tp")].options == {"fuse": "all_gather_matmul", "tp_group_name": "7"}


# --------------------------------------------------------------------------- gloo: the CPU run


def _gloo_worker(rank, world, store_path, q, reference_kernels):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        import copy

        from graph_trainer.compiler.pipeline import run_pipeline
        from graph_trainer.compiler.registry import PipelineStep, pass_step

        gm, tpar = _traced_tp_real(world)
        inputs = tpar.inputs
        rec: list = []
        with torch.no_grad():
            ref = gm(*inputs)
            auto = run_pipeline(copy.deepcopy(gm), None, ["async_tp"], quiet=True, records=rec)
            same_code, out = auto.code == gm.code, auto(*inputs)
            skipped = (rec[-1]["summary"], all(torch.equal(a, b) for a, b in zip(out, ref)), same_code)
            if reference_kernels:  # the CPU kernel of each fused op: torch's reference (Meta) implementation
                import torch.distributed._symmetric_memory as symm_mem

                lib = torch.library.Library("symm_mem", "IMPL")
                lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback, "CPU")
                lib.impl("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback, "CPU")
            fused = run_pipeline(copy.deepcopy(gm), None, [PipelineStep("async_tp", pass_step("async_tp").fn,
                                                                        {"rewrite": True})], quiet=True, records=rec)
            out = fused(*inputs)
            rewritten = (rec[-1]["summary"], _kinds(fused), [torch.equal(a, b) for a, b in zip(out, ref)],
                         max(float((a - b).abs().max()) for a, b in zip(out, ref)))
        q.put((rank, skipped, rewritten))
    finally:
        dist.destroy_process_group()


def _traced_tp_real(world: int):
    """The tiny Llama traced under TP ``world`` on the current gloo group (fp32, batch 2,
    the passes before async_tp); the TraceParallel gets ``inputs``: the step's real inputs."""
    from graph_trainer.config import parse_args
    from graph_trainer.model import build_model, loss_fn, model_args
    from graph_trainer.distributed.parallelize import _patch_torchtitan_device_type, build_parallel_dims, distribute_for_trace
    from graph_trainer.compiler.pipeline import run_pipeline

    _patch_torchtitan_device_type("cpu")
    cfg = parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
                      "--parallelism.tensor_parallel_degree", str(world), "--parallelism.data_parallel_shard_degree", "1"])
    args = model_args("debugmodel", n_layers=1, dim=64, n_heads=4, vocab_size=64)
    model = build_model(args, seed=0)
    pdims = build_parallel_dims(cfg, world, args.n_heads, args.n_kv_heads)
    tpar = distribute_for_trace(model, cfg, pdims, torch.device("cpu"), dist.get_rank(), world)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    traced = tpar.trace(model, functools.partial(loss_fn, dp_group=tpar.dp_group), tokens, tokens, None)
    tpar.inputs = (*tpar.params, *model.buffers(), tokens, tokens)
    gm = run_pipeline(traced.gm, None, ["remove_dead_code", "remove_noop_views", "sac_recompute",
                                        "reshard_after_forward"], quiet=True)
    return gm, tpar


def _run_gloo(reference_kernels: bool, tmp_path):
    from _launch import queue, spawn  # tests/ is on sys.path

    q = queue()
    spawn(_gloo_worker, (2, str(tmp_path / "store"), q, reference_kernels), 2)  # forked from its server
    return [q.get(timeout=60) for _ in range(2)]


@pytest.mark.slow
def test_cpu_run_skips_bitwise_and_rewrite_matches_reference_gloo(tmp_path):
    """TP2 on 2 gloo ranks, debug Llama: the pass (default options) skips on CPU with a
    summary, graph and step outputs (loss, gradients) bitwise unchanged. Forced to rewrite,
    with torch's reference implementation of the fused ops as their CPU kernel, the
    rewritten step equals the traced one bitwise: the rewiring, gather / scatter dimensions
    and layouts are right (the CUDA kernels' chunked matmuls are what may differ)."""
    for rank, (summary, bitwise, same_code), (fused_summary, kinds, equal, maxdiff) in _run_gloo(True, tmp_path):
        assert summary.startswith("skipped: device cpu (the symm_mem fused ops are CUDA-only); would fuse 5 ")
        assert bitwise and same_code
        assert fused_summary.startswith("fused 5 all-gather->matmul (8 matmuls) and 3 matmul->reduce-scatter")
        assert kinds[FUSED_AG] == 5 and kinds[FUSED_RS] == 3
        assert all(equal), (rank, maxdiff)


def test_fused_ops_end_to_end_on_gloo(tmp_path):
    """The fused ops themselves on 2 gloo ranks: they have CUDA and Meta kernels only."""
    import torch.distributed._symmetric_memory  # noqa: F401

    for op in (torch.ops.symm_mem.fused_all_gather_matmul.default, torch.ops.symm_mem.fused_matmul_reduce_scatter.default):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"):
            pytest.skip(f"{op.name()} has no CPU kernel (CUDA and Meta only): the fused ops cannot run on gloo; "
                        "the CPU run of the pass skips (test_cpu_run_skips_bitwise_and_rewrite_matches_reference_gloo)")
    for rank, _, (summary, kinds, equal, maxdiff) in _run_gloo(False, tmp_path):  # pragma: no cover - no CPU kernel today
        assert kinds[FUSED_AG] == 5 and maxdiff < 1e-5, (rank, summary)


# --------------------------------------------------------------------------- the 8B dry run


@pytest.mark.slow
def test_dry_run_8b_fsdp4_tp2_lists_fused_ops(dry_run_8b_fsdp4_tp2):
    """COMM_MODE=fake_backend NGPU=8, Llama3 8B, FSDP4 x TP2, --compile.passes async_tp (the
    session's dry run, tests/conftest.py): the pass rewrites on the fake group; the fused ops
    are in the graph the dry run summarises."""
    s, messages = dry_run_8b_fsdp4_tp2
    (line,) = [m for m in messages if m.startswith("graph pass async_tp")]
    # per block: 2 forward all-gathers (3 + 2 projections), 2 backward ones (1 matmul each),
    # 2 forward reduce-scatters; plus the output projection's all-gather and the
    # reduce-scatter of its input gradient. Left: the embedding's pair, 64 sums of matmuls.
    layers = 32
    assert f"fused {4 * layers + 1} all-gather->matmul ({7 * layers + 1} matmuls) and {2 * layers + 1} " \
           f"matmul->reduce-scatter on TP group" in line, line
    assert f"left 1 all-gather (1: no matmul reads the gathered tensor as its left operand), {2 * layers + 1} " \
           f"reduce-scatters" in line, line
    assert "async_tp" in s["graph_passes"]
    # the projection sees the fused ops: their TP collectives counted, as overlapped
    fused = {c["kind"]: c["ops"] for c in s["projection"]["comm"] if c["async_tp"]}
    assert fused == {"all_gather_into_tensor": 4 * layers + 1, "reduce_scatter_tensor": 2 * layers + 1}, fused
