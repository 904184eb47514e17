"""Compile the ``compile_with_inductor``-tagged regions of the graph with Inductor.

Matches: every node (except placeholders / output) whose
``meta["custom"]`` contains ``"compile_with_inductor"`` (set by the annotation
passes or by ``fx.traceback.annotate`` at trace time).

Changes: each region is cut out into a sub-GraphModule and replaced by a call
to its Inductor-compiled code (``torch._inductor.standalone_compile`` via
``torch.fx.passes.regional_inductor``); the rest of the graph stays eager.

Regions: tagged nodes are grouped by the optional
``compile_with_inductor["inductor_region"]`` id. Nodes with an id form exactly
one partition per id (all of them, plus ``getitem`` users of their tuple
outputs), provided that fusing them creates no dependency cycle; otherwise (and
for nodes without an id, which share one default group) torch's
``CapabilityBasedPartitioner`` splits the group as ``regional_inductor`` does.
Partitions are never merged across ids. This is done here rather than by
``regional_inductor`` itself because torch 2.11 ignores ``inductor_region``
(it partitions all tagged nodes together and may merge independent norms), and
newer torch (2.13) runs one full-graph ``CapabilityBasedPartitioner`` (quadratic
dependency analysis) per region id. The scooped regions are then compiled with
torch's own ``_compile_inductor_marked_regions`` (same function on 2.11 and
2.13); if that private API is missing we fall back to the public
``regional_inductor`` (whose own partitioning then applies).

Compilation runs under a ``torch._guards.TracingContext`` built from the fake
mode of the placeholders' ``meta["val"]`` (``detect_fake_mode``), which
``standalone_compile(dynamic_shapes="from_tracing_context")`` requires.

Calling convention: ``regional_inductor`` switches the graph to the *boxed*
convention (``gm([args])``, list cleared). This pass restores the graph's
original codegen afterwards, so the returned module is called exactly like the
input one (e.g. ``gm(*flat_inputs)`` or ``gm(params, buffers, tokens, labels)``
for a make_fx graph with pytree codegen). On CPU Inductor uses its C++ backend.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from typing import Any

import torch
import torch.fx

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY, NUMERICS_KEY
from graph_trainer.numerics import output_key
from graph_trainer.compiler.common import (
    custom_meta,
    detect_graph_fake_mode,
    is_getitem,
    set_pass_summary,
    split_acyclic,
)
from graph_trainer.compiler.registry import GraphPass

logger = logging.getLogger("graph_trainer")

REGION_PREFIX = "__marked_inductor_submod"
_DEFAULT_REGION = object()


def _needs_inductor_compile(node: torch.fx.Node) -> bool:
    return node.op not in ("placeholder", "output") and COMPILE_WITH_INDUCTOR_KEY in custom_meta(node)


def _region_id(node: torch.fx.Node) -> Any:
    value = custom_meta(node)[COMPILE_WITH_INDUCTOR_KEY]
    if isinstance(value, dict) and "inductor_region" in value:
        return value["inductor_region"]
    return _DEFAULT_REGION


def count_tagged(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if _needs_inductor_compile(n))


def propose_region_partitions(gm: torch.fx.GraphModule) -> list[dict[torch.fx.Node, None]]:
    """The partitions the tagged nodes of ``gm`` (top level) will be cut into.

    Nodes with an ``inductor_region`` id: one partition per id (plus the
    ``getitem`` users of its tuple outputs) when that is cycle free, else the
    fewest cycle-free layers (:func:`split_acyclic`). Nodes without an id: the
    ``CapabilityBasedPartitioner`` partitions of that group, as torch's
    ``regional_inductor`` does. Pure analysis: ``gm`` is not modified.
    """
    regions: dict[Any, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if _needs_inductor_compile(node):
            regions.setdefault(_region_id(node), []).append(node)
    if not regions:
        return []

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    partitioner = None
    partitions: list[dict[torch.fx.Node, None]] = []
    for rid, nodes in regions.items():
        part = dict.fromkeys(nodes)
        # getitems of a tuple-producing node belong with it (as the partitioner does).
        for node in nodes:
            if node.users and all(is_getitem(u) for u in node.users):
                for u in node.users:
                    if u not in part and not (_needs_inductor_compile(u) and _region_id(u) != rid):
                        part[u] = None
        if rid is _DEFAULT_REGION:
            partitioner = _propose_with_capability_partitioner(gm, set(part), partitioner)
            partitions.extend(p.nodes for p in partitioner.last_partitions)  # type: ignore[attr-defined]
            continue
        layers = split_acyclic(list(part), order)
        if len(layers) > 1:
            logger.debug("inductor region %r is not cycle free as a whole: %d partitions", rid, len(layers))
        partitions.extend(dict.fromkeys(layer) for layer in layers)
    return partitions


def _propose_with_capability_partitioner(gm, region_nodes: set, partitioner=None):
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
    from torch.fx.passes.operator_support import create_op_support

    support = create_op_support(lambda _submodules, node: node in region_nodes)
    if partitioner is None:  # build the (quadratic) dependency viewer once per graph
        partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    else:
        partitioner.operator_support = support
    partitioner.last_partitions = partitioner.propose_partitions()
    return partitioner


def scoop_regions(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """Cut the tagged regions of ``gm`` (and of nested sub-graphs) into
    ``__marked_inductor_submod*`` call_module nodes, without compiling them.

    Returns ``(gm, number of regions at top level)``.
    """
    from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    with torch.fx.traceback.preserve_node_meta(enable=False):
        seen: set[int] = set()
        for node in gm.graph.find_nodes(op="get_attr"):
            if _needs_inductor_compile(node):
                continue  # compiled as part of the outer region
            sub = getattr(gm, node.target, None)
            if isinstance(sub, torch.fx.GraphModule) and id(sub) not in seen:
                seen.add(id(sub))
                scoop_regions(sub)
        partitions = propose_region_partitions(gm)
        if not partitions:
            return gm, 0
        gm = fuse_by_partitions(gm, partitions, prefix=REGION_PREFIX, always_return_tuple=True)
        _carry_output_keys(gm)
        return gm, len(partitions)


def _carry_output_keys(gm: torch.fx.GraphModule) -> None:
    """Give each region output (a getitem of the region call) the ``numerics_key`` of the
    node inside the region whose value it returns, or of output ``i`` of the multi-output
    op when that node is its ``getitem`` (graph_trainer.numerics)."""
    for node in gm.graph.find_nodes(op="call_module"):
        if not str(node.target).startswith(REGION_PREFIX):
            continue
        outs = getattr(gm, node.target).graph.output_node().args[0]
        for user in node.users:
            if is_getitem(user) and isinstance(user.args[1], int) and user.args[1] < len(outs):
                inner = outs[user.args[1]]
                if not isinstance(inner, torch.fx.Node):
                    continue
                if NUMERICS_KEY in inner.meta:
                    user.meta[NUMERICS_KEY] = inner.meta[NUMERICS_KEY]
                elif is_getitem(inner) and NUMERICS_KEY in inner.args[0].meta:  # output i of a multi-output op
                    user.meta[NUMERICS_KEY] = output_key(inner.args[0].meta[NUMERICS_KEY], inner.args[1])


def _annotation(gm: torch.fx.GraphModule) -> dict:
    """The ``compile_with_inductor`` dict of the first annotated op of a region.

    Placeholders are skipped: they can carry the metadata of the node that produced the
    value in the outer graph (the ``rstd`` getitem of a forward norm feeding a backward
    region), which would name the wrong region."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        cwi = custom_meta(n).get(COMPILE_WITH_INDUCTOR_KEY)
        if isinstance(cwi, dict):
            return cwi
    return {}


def region_signature(gm: torch.fx.GraphModule, example_inputs) -> tuple:
    """Structural key of a region: ops, wiring (by position, not by name), constants,
    the inductor configs (and candidate configs) of its annotation, and the inputs'
    shape/stride/dtype/device.

    Two norm instances of the same shape have the same signature and can share one
    compiled artifact, although their node names differ (which defeats Inductor's own
    FX graph cache)."""
    index: dict[torch.fx.Node, int] = {}
    ops = []

    def enc(a):
        if isinstance(a, torch.fx.Node):
            return ("n", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(enc(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, enc(v)) for k, v in a.items()))
        return repr(a)

    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        ops.append((n.op, str(n.target) if n.op != "placeholder" else "", enc(n.args), enc(n.kwargs)))
    cwi = _annotation(gm)
    configs = repr(
        (sorted(cwi.get("inductor_configs", {}).items()), [sorted(c.items()) for c in cwi.get("candidate_inductor_configs", [])])
    )
    metas = tuple(
        (tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device)) if isinstance(v, torch.Tensor) else repr(v)
        for v in example_inputs
    )
    return (tuple(ops), configs, metas)


def random_inputs(example_inputs) -> list:
    """Real tensors with the shape, stride, dtype and device of each fake input
    (floating: standard normal; integer / bool: zeros); non-tensors pass through."""
    out = []
    for v in example_inputs:
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        t = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
        if t.is_floating_point():
            t.normal_()
        else:
            t.zero_()
        out.append(t)
    return out


def time_region_ms(fn, inputs) -> float:
    """Median milliseconds of ``fn(*inputs)``. CUDA: ``triton.testing.do_bench``
    (CUDA events, L2 flushed between calls); CPU: ``time.perf_counter`` over 10 calls."""
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
        from triton.testing import do_bench

        return float(do_bench(lambda: fn(*inputs), warmup=25, rep=100, return_mode="median"))
    fn(*inputs)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        fn(*inputs)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


#: A candidate Inductor config is kept only when it is more than this fraction faster
#: than the region's own ``inductor_configs`` (above the noise between do_bench medians
#: of two identical kernels).
MIN_CANDIDATE_GAIN = 0.02


@contextlib.contextmanager
def _dedupe_and_select_region_compiles(select_candidates: bool | None = None, timer=None):
    """Patch ``torch._inductor.standalone_compile`` while regions are compiled:

    * memoize by :func:`region_signature`, so N identical norms cost one Inductor
      compile (and one autotuning) instead of N;
    * for a region whose annotation has ``candidate_inductor_configs``: compile the
      region with each candidate too (patched over its ``inductor_configs``), time
      every variant on random inputs of the region's shapes (``timer(fn, inputs) ->
      ms``, default :func:`time_region_ms`) and keep the fastest -- but a candidate
      only when it is more than ``MIN_CANDIDATE_GAIN`` faster than the annotation's
      own ``inductor_configs``, which otherwise win (a guard against timing noise).
      ``select_candidates=None`` selects only when the region's inputs live on CUDA
      (CPU timings of Triton knobs mean nothing).

    Yields stats ``{"compiled", "reused", "selections": [...]}``; each selection is
    ``{"region", "inputs", "ms": [per variant], "chosen": index (0 = inductor_configs)}``.
    """
    import torch._inductor as inductor
    import torch._inductor.config as inductor_config

    orig = inductor.standalone_compile
    timer = timer or time_region_ms
    cache: dict = {}
    stats: dict = {"compiled": 0, "reused": 0, "selections": []}

    def compile_best(gm, example_inputs, *args, **kwargs):
        cwi = _annotation(gm)
        candidates = cwi.get("candidate_inductor_configs") or []
        on_cuda = any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in example_inputs)
        select = on_cuda if select_candidates is None else select_candidates
        if not candidates or not select:
            stats["compiled"] += 1
            return orig(gm, example_inputs, *args, **kwargs)
        variants = []
        for cand in [{}] + list(candidates):
            copy_gm = torch.fx.GraphModule(gm, _copy_graph(gm.graph))
            with inductor_config.patch(cand):
                variants.append(orig(copy_gm, example_inputs, *args, **kwargs))
            stats["compiled"] += 1
        inputs = random_inputs(example_inputs)
        ms = [timer(v, inputs) for v in variants]
        chosen = min(range(len(ms)), key=lambda i: (ms[i], i))
        if ms[chosen] > ms[0] * (1.0 - MIN_CANDIDATE_GAIN):  # guard: noise never picks a candidate
            chosen = 0
        shapes = ", ".join(
            f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}" for v in example_inputs if isinstance(v, torch.Tensor)
        )
        stats["selections"].append(
            {"region": cwi.get("inductor_region"), "inputs": shapes, "ms": ms, "chosen": chosen,
             "configs": [cwi.get("inductor_configs", {})] + [dict(c) for c in candidates]}
        )
        logger.info(
            "region %s (%s): %s -> keep %s",
            cwi.get("inductor_region"), shapes,
            ", ".join(f"{'inductor_configs' if i == 0 else f'candidate {i}'} {t:.4f} ms" for i, t in enumerate(ms)),
            "inductor_configs" if chosen == 0 else f"candidate {chosen} {candidates[chosen - 1]}",
        )
        return variants[chosen]

    def memo(gm, example_inputs, *args, **kwargs):
        try:
            key = region_signature(gm, example_inputs)
        except Exception:  # unexpected input: compile without sharing
            return compile_best(gm, example_inputs, *args, **kwargs)
        if key in cache:
            stats["reused"] += 1
            return cache[key]
        cache[key] = compile_best(gm, example_inputs, *args, **kwargs)
        return cache[key]

    inductor.standalone_compile = memo
    try:
        yield stats
    finally:
        inductor.standalone_compile = orig


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _supports_region_ids() -> bool:
    try:
        from torch.fx.passes.regional_inductor import _RegionScooper

        return "inductor_region" in inspect.getsource(_RegionScooper)
    except Exception:
        return False


def regional_inductor_pass(
    gm: torch.fx.GraphModule,
    example_inputs=None,
    *,
    select_candidates: bool | None = None,
    timer=None,
) -> torch.fx.GraphModule:
    """Compile each tagged region of ``gm`` with Inductor (one compiled callable
    per region), keep the rest eager, and return ``gm`` with its original
    calling convention.

    Identical regions (same ops and input shapes/dtypes, e.g. the attention / FFN
    norms of every block) are compiled once and share the artifact. Regions with
    ``candidate_inductor_configs`` are compiled once per candidate and the fastest
    measured variant is kept (see :func:`_dedupe_and_select_region_compiles`;
    ``select_candidates`` / ``timer`` are passed through).

    Stats: ``regions``, ``tagged_nodes``, ``distinct_compiles`` (Inductor compiles
    run), ``selections``, ``compile_s``."""
    tagged = count_tagged(gm)
    if tagged == 0:
        set_pass_summary(gm, "no compile_with_inductor nodes: nothing compiled", regions=0, tagged_nodes=0)
        return gm

    fake_mode = detect_graph_fake_mode(gm, example_inputs)
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
        logger.warning("regional_inductor_pass: no fake mode found on the graph; using a fresh one")

    from torch.fx.passes import regional_inductor as ri

    orig_codegen = gm.graph._codegen
    t0 = time.perf_counter()
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)), _dedupe_and_select_region_compiles(select_candidates, timer) as stats:
        compile_regions = getattr(ri, "_compile_inductor_marked_regions", None)
        if compile_regions is not None:
            gm, n_regions = scoop_regions(gm)
            gm = compile_regions(gm)
        else:  # pragma: no cover - private API moved: let torch partition
            logger.warning(
                "torch.fx.passes.regional_inductor._compile_inductor_marked_regions not found; "
                "using regional_inductor() partitioning (inductor_region ids %s honoured)",
                "are" if _supports_region_ids() else "are NOT",
            )
            n_regions = len(propose_region_partitions(gm))
            gm = ri.regional_inductor(gm)
    compile_s = time.perf_counter() - t0

    if isinstance(gm, torch.fx.GraphModule):
        gm.graph._codegen = orig_codegen
        gm.recompile()
    sel = stats["selections"]
    picked = sum(1 for x in sel if x["chosen"] != 0)
    sel_text = f"; timed {len(sel)} distinct region(s), {picked} took a candidate config" if sel else ""
    set_pass_summary(
        gm,
        f"compiled {n_regions} region(s) ({tagged} tagged nodes) with Inductor in {compile_s:.1f}s "
        f"({stats['compiled']} Inductor compiles, {stats['reused']} regions reused one){sel_text}",
        regions=n_regions,
        distinct_compiles=stats["compiled"],
        selections=sel,
        tagged_nodes=tagged,
        compile_s=round(compile_s, 3),
    )
    return gm


PASS = GraphPass(
    name="regional_inductor", fn=regional_inductor_pass, compiles=True, excludes=("full_inductor",),
    enabled=lambda ctx: ctx.compile_cfg.inductor_compilation == "regional",
)
