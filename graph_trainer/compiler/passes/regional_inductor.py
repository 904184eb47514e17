"""Compile the ``compile_with_inductor``-tagged regions of the graph with Inductor.

Each region becomes a sub-GraphModule compiled by torch's regional Inductor (``standalone_compile``); the rest stays
eager. The tagged nodes of one ``inductor_region`` id (with the ``getitem`` s of their tuple outputs) are one region,
split only to avoid a dependency cycle, never merged across ids (torch's scooper ignores ids); nodes without an id are
partitioned by torch's ``CapabilityBasedPartitioner``. Identical regions share one compile; candidate configs are timed
(:func:`_dedupe_and_select_region_compiles`). The result is called like the input."""

import contextlib
import copy
import time
import timeit
from collections import Counter
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import create_op_support
from torch.fx.passes.regional_inductor import _compile_inductor_marked_regions
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from graph_trainer import NUMERICS_KEY, logger
from graph_trainer.numerics import output_key
from graph_trainer.compiler.graph_values import detect_graph_fake_mode, positions, split_acyclic
from graph_trainer.compiler.node_meta import inductor_tag, is_tagged_for_inductor, set_pass_summary
from graph_trainer.compiler.ops import is_getitem, packet_name
from graph_trainer.compiler.registry import GraphPass
from graph_trainer.compiler.report import REGION_SUBMOD_PREFIX, is_region_call

_DEFAULT_REGION = object()

#: A candidate Inductor config is kept only when it is more than this fraction faster than ``inductor_configs``.
MIN_CANDIDATE_GAIN = 0.02


def _needs_inductor_compile(node: torch.fx.Node) -> bool:
    return node.op not in ("placeholder", "output") and is_tagged_for_inductor(node)


def _region_id(node: torch.fx.Node) -> Any:
    value = inductor_tag(node)
    return value.get("inductor_region", _DEFAULT_REGION) if isinstance(value, dict) else _DEFAULT_REGION


def propose_region_partitions(gm: torch.fx.GraphModule) -> list[dict[torch.fx.Node, None]]:
    """The partitions the tagged top-level nodes of ``gm`` will be cut into (module docstring); reads only."""
    regions: dict[Any, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if _needs_inductor_compile(node):
            regions.setdefault(_region_id(node), []).append(node)
    order = positions(gm.graph)
    partitions: list[dict[torch.fx.Node, None]] = []
    for rid, nodes in regions.items():
        part = dict.fromkeys(nodes)
        for node in nodes:  # getitems of a tuple-producing node belong with it
            if node.users and all(is_getitem(u) for u in node.users):
                part.update((u, None) for u in node.users if not (_needs_inductor_compile(u) and _region_id(u) != rid))
        if rid is _DEFAULT_REGION:
            support = create_op_support(lambda _submodules, n, members=set(part): n in members)
            partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
            partitions.extend(p.nodes for p in partitioner.propose_partitions())
            continue
        layers = split_acyclic(list(part), order)
        if len(layers) > 1:
            logger.debug("inductor region %r is not cycle free as a whole: %d partitions", rid, len(layers))
        partitions.extend(dict.fromkeys(layer) for layer in layers)
    return partitions


def scoop_regions(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """Cut the tagged regions of ``gm`` (and of nested sub-graphs) into ``__marked_inductor_submod*``
    call_module nodes, without compiling them; returns ``(gm, number of top-level regions)``."""
    with torch.fx.traceback.preserve_node_meta(enable=False):
        seen: set[int] = set()
        for node in gm.graph.find_nodes(op="get_attr"):
            sub = getattr(gm, node.target, None)
            # a tagged get_attr is compiled as part of the outer region
            if not _needs_inductor_compile(node) and isinstance(sub, torch.fx.GraphModule) and id(sub) not in seen:
                seen.add(id(sub))
                scoop_regions(sub)
        partitions = propose_region_partitions(gm)
        if not partitions:
            return gm, 0
        gm = fuse_by_partitions(gm, partitions, prefix=REGION_SUBMOD_PREFIX, always_return_tuple=True)
        _carry_output_keys(gm)
        return gm, len(partitions)


def _carry_output_keys(gm: torch.fx.GraphModule) -> None:
    """Give each region output (a getitem of the region call) the ``numerics_key`` of the node it returns."""
    for node in filter(is_region_call, gm.graph.find_nodes(op="call_module")):
        outs = getattr(gm, node.target).graph.output_node().args[0]
        for user in node.users:
            if not (is_getitem(user) and isinstance(user.args[1], int) and user.args[1] < len(outs)):
                continue
            inner = outs[user.args[1]]
            if not isinstance(inner, torch.fx.Node):
                continue
            if NUMERICS_KEY in inner.meta:
                user.meta[NUMERICS_KEY] = inner.meta[NUMERICS_KEY]
            elif is_getitem(inner) and NUMERICS_KEY in inner.args[0].meta:
                user.meta[NUMERICS_KEY] = output_key(inner.args[0].meta[NUMERICS_KEY], inner.args[1])


def _annotation(gm: torch.fx.GraphModule) -> dict:
    """The ``compile_with_inductor`` dict of a region's first annotated call_function (not of a placeholder)."""
    tags = (inductor_tag(n) for n in gm.graph.nodes if n.op == "call_function")
    return next((t for t in tags if isinstance(t, dict)), {})


def region_signature(gm: torch.fx.GraphModule, example_inputs) -> tuple:
    """Structural key of a region: ops, wiring by position, constants, its annotation's configs and the inputs'
    shape / stride / dtype / device (node names ignored)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def enc(a):
        if isinstance(a, torch.fx.Node):
            return ("n", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(enc(x) for x in a)
        return tuple(sorted((k, enc(v)) for k, v in a.items())) if isinstance(a, dict) else repr(a)

    ops = tuple((n.op, str(n.target) if n.op != "placeholder" else "", enc(n.args), enc(n.kwargs)) for n in index)
    cwi = _annotation(gm)
    configs = repr((sorted(cwi.get("inductor_configs", {}).items()),
                    [sorted(c.items()) for c in cwi.get("candidate_inductor_configs", [])]))
    metas = tuple((tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device)) if isinstance(v, torch.Tensor)
                  else repr(v) for v in example_inputs)
    return (ops, configs, metas)


def time_region_ms(fn, inputs) -> float:
    """Median milliseconds of ``fn(*inputs)``: ``triton.testing.do_bench`` on CUDA, else of 10 calls."""
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
        from triton.testing import do_bench

        return float(do_bench(lambda: fn(*inputs), warmup=25, rep=100, return_mode="median"))
    fn(*inputs)
    return sorted(timeit.repeat(lambda: fn(*inputs), number=1, repeat=10))[5] * 1e3


def _shapes(example_inputs) -> str:
    return ", ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                     for v in example_inputs if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def _dedupe_and_select_region_compiles(select_candidates: bool | None = None, timer=None):
    """Patch ``torch._inductor.standalone_compile`` while regions are compiled: memoize by :func:`region_signature`;
    compile a region with ``candidate_inductor_configs`` once per candidate too, time the variants on random inputs
    (``timer(fn, inputs) -> ms``, default :func:`time_region_ms`) and keep the fastest, a candidate only when more
    than :data:`MIN_CANDIDATE_GAIN` faster (``select_candidates=None``: only for CUDA inputs). Yields the stats
    ``{"compiled", "reused", "selections", "compiles"}`` (each selection's timings and choice, each compile's
    region, inputs, ops, seconds and cache outcome)."""
    import torch._inductor as inductor
    import torch._inductor.config as inductor_config
    from torch._dynamo.testing import rand_strided
    from torch._dynamo.utils import counters

    orig = inductor.standalone_compile
    timer = timer or time_region_ms
    cache: dict = {}
    stats: dict = {"compiled": 0, "reused": 0, "selections": [], "compiles": []}

    def timed(gm, example_inputs, *args, **kwargs):
        aot = counters["aot_autograd"]
        before = {k: aot[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass")}
        t0 = time.perf_counter()
        out = orig(gm, example_inputs, *args, **kwargs)
        outcome = [k for k, v in before.items() if aot[f"autograd_cache_{k}"] > v]
        stats["compiled"] += 1
        stats["compiles"].append({
            "region": _annotation(gm).get("inductor_region"), "inputs": _shapes(example_inputs),
            "ops": sorted({packet_name(n) or str(n.target) for n in gm.graph.nodes
                           if n.op == "call_function" and not is_getitem(n)}),
            "s": round(time.perf_counter() - t0, 3), "cache": "/".join(outcome)})
        return out

    def compile_best(gm, example_inputs, *args, **kwargs):
        cwi = _annotation(gm)
        candidates = cwi.get("candidate_inductor_configs") or []
        on_cuda = any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in example_inputs)
        if not candidates or not (on_cuda if select_candidates is None else select_candidates):
            return timed(gm, example_inputs, *args, **kwargs)
        variants = []
        for cand in [{}, *candidates]:
            gm_copy = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
            with inductor_config.patch(cand):
                variants.append(timed(gm_copy, example_inputs, *args, **kwargs))
        inputs = [rand_strided(v.shape, v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else v
                  for v in example_inputs]
        ms = [timer(v, inputs) for v in variants]
        chosen = min(range(len(ms)), key=lambda i: (ms[i], i))
        if ms[chosen] > ms[0] * (1.0 - MIN_CANDIDATE_GAIN):  # noise never picks a candidate
            chosen = 0
        shapes = _shapes(example_inputs)
        stats["selections"].append({"region": cwi.get("inductor_region"), "inputs": shapes, "ms": ms, "chosen": chosen,
                                    "configs": [cwi.get("inductor_configs", {})] + [dict(c) for c in candidates]})
        times = ", ".join(f"{'inductor_configs' if i == 0 else f'candidate {i}'} {t:.4f} ms" for i, t in enumerate(ms))
        logger.info("region %s (%s): %s -> keep %s", cwi.get("inductor_region"), shapes, times,
                    "inductor_configs" if chosen == 0 else f"candidate {chosen} {candidates[chosen - 1]}")
        return variants[chosen]

    def memo(gm, example_inputs, *args, **kwargs):
        try:
            key = region_signature(gm, example_inputs)
        except Exception:  # unexpected input: compile without sharing
            return compile_best(gm, example_inputs, *args, **kwargs)
        if key in cache:
            stats["reused"] += 1
        else:
            cache[key] = compile_best(gm, example_inputs, *args, **kwargs)
        return cache[key]

    with mock.patch.object(inductor, "standalone_compile", memo):
        yield stats


def regional_inductor_pass(gm: torch.fx.GraphModule, example_inputs=None, *, select_candidates: bool | None = None,
                           timer=None) -> torch.fx.GraphModule:
    """Compile each tagged region of ``gm`` with Inductor, keep the rest eager, and return ``gm`` with its original
    calling convention. ``select_candidates`` / ``timer``: see :func:`_dedupe_and_select_region_compiles`. Stats:
    ``regions``, ``tagged_nodes``, ``distinct_compiles``, ``selections``, ``compiles``, ``compile_s``."""
    tagged = sum(1 for n in gm.graph.nodes if _needs_inductor_compile(n))
    if tagged == 0:
        set_pass_summary(gm, "no compile_with_inductor nodes: nothing compiled", regions=0, tagged_nodes=0)
        return gm
    fake_mode = detect_graph_fake_mode(gm, example_inputs) or FakeTensorMode()
    orig_codegen = gm.graph._codegen
    t0 = time.perf_counter()
    with (
        torch._guards.tracing(torch._guards.TracingContext(fake_mode)),
        # a fake mode without a ShapeEnv gets an empty one while compiling (else the caches bypass the graphs)
        mock.patch.object(fake_mode, "shape_env", fake_mode.shape_env or ShapeEnv()),
        _dedupe_and_select_region_compiles(select_candidates, timer) as stats,
    ):
        gm, n_regions = scoop_regions(gm)
        gm = _compile_inductor_marked_regions(gm)
    compile_s = time.perf_counter() - t0
    gm.graph._codegen = orig_codegen
    gm.recompile()

    sel = stats["selections"]
    picked = sum(1 for x in sel if x["chosen"] != 0)
    sel_text = f"; timed {len(sel)} distinct region(s), {picked} took a candidate config" if sel else ""
    compiles = stats["compiles"]
    cache = Counter(c["cache"] or "not counted" for c in compiles)
    slow = max(compiles, key=lambda c: c["s"], default=None)
    slow_text = (f"; cache {', '.join(f'{k} {v}' for k, v in sorted(cache.items()))}; slowest {slow['s']:.1f}s: "
                 f"{'+'.join(slow['ops'])} ({slow['inputs']})") if slow else ""
    set_pass_summary(gm, f"compiled {n_regions} region(s) ({tagged} tagged nodes) with Inductor in {compile_s:.1f}s "
                     f"({stats['compiled']} Inductor compiles, {stats['reused']} regions reused one){sel_text}"
                     f"{slow_text}", regions=n_regions, distinct_compiles=stats["compiled"], selections=sel,
                     tagged_nodes=tagged, compile_s=round(compile_s, 3), compiles=compiles)
    return gm


PASS = GraphPass(name="regional_inductor", fn=regional_inductor_pass, compiles=True, excludes=("full_inductor",),
                 enabled=lambda ctx: ctx.compile_cfg.inductor_compilation == "regional")
