#!/usr/bin/env python3
"""Fusion report: what Inductor generates for the traced Llama3 training step.

Builds the model of one config (``graph_trainer.model``), traces forward + loss +
backward once (``graph_trainer.trace.trace_train_step`` with ``graph_trainer.model.loss_fn``;
parameters cast to bf16 inside the graph on CUDA, fp32 on CPU) and runs copies
of the traced graph in these ways:

``none``                  the traced graph, uncompiled (the numerics reference).
``full``                  ``full_inductor_pass``: the whole graph through Inductor.
``full+isolated rmsnorm`` ``isolate_rmsnorm_pass`` + ``full``: each norm's ops fused only among
                          themselves (``--compile.passes isolate_rmsnorm`` under full).
``regional+rmsnorm``      ``annotate_rmsnorm_for_regional_inductor_pass`` (Inductor
                          defaults, no candidate configs) + ``regional_inductor_pass``.
``regional+rmsnorm+pointwise``  also ``annotate_pointwise_for_regional_inductor_pass``
                          (``--compile.passes annotate_pointwise``: SwiGLU, residual-gradient
                          adds, loss as regions of one module and phase each).
``full, mix_order_reduction=False``  ``full`` with that Triton knob off; only on CUDA and
                          when ``torch._inductor.config.triton`` has it (the output says so).

Generated kernels: every way compiles (and runs once) in a fresh
``TORCHINDUCTOR_CACHE_DIR`` with ``force_disable_caches``, so all the code Inductor
writes for it lands in one folder. Output-code (wrapper) modules are the ``.py``
files there with ``async_compile = AsyncCompile()``; each ``<name> = async_compile.<x>(``
definition in them is one generated kernel (Triton on CUDA, C++ on CPU). Extern
calls (cuBLAS / oneDNN matmuls, attention) are not counted, and identical regions
share one compile, so ``kernels`` counts distinct generated kernels, not launches.
``largest kernel lines``: source lines of the largest one.

Origins: Inductor writes ``# Topologically Sorted Source Nodes: [...], Original ATen:
[...]`` above each Triton kernel; its C++ backend writes none, so while compiling
this script makes ``CppScheduling.codegen_comment`` write the same line (from
``torch._inductor.utils.get_kernel_metadata``) above each C++ kernel call. Source
Nodes are node names of the traced graph. Rule: a kernel contains the rms_norm
backward if one of its Source Nodes belongs to a ``kind == "backward"`` instance of
``graph_trainer.compiler.matching.find_rmsnorm_instances(traced graph)`` (the fused
``_fused_rms_norm_backward`` on CUDA, the decomposed mul/sum/pow/div group on CPU);
without origin comments, if its name contains ``rms_norm_backward``. ``fused with
it``: its other Source Nodes (views dropped) as ``module_fqn phase[ops]``, with
``layers.N`` written ``layers.*`` and ``<top>`` for nodes outside any module.

Times: ``step ms`` is the median wall time of ``--steps`` steps (CUDA: synchronized).
``fwd ms`` / ``bwd ms`` (CUDA only, n/a on CPU): GPU kernel time of a step from
``torch.profiler``, median over ``--steps``; kernels launched before the
forward/backward boundary are forward. Boundary: a ``record_function`` marker
inserted before the first ``node.meta["custom"]["phase"] == "backward"`` node
(``none`` and the regional ways), or the launch of the first generated kernel with a
backward source node (``full`` ways, whose graph is opaque); no split when a generated
kernel mixes forward and backward ops (its ``phase`` is ``both``).

Numerics: loss and grads of each way on the same batch vs ``none``; ``ok`` when
``max(|dloss|/|loss|, max|dgrad| / max|grad|) <= --tolerance``.
Exit status 1 when a way fails or does not match.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # allow running without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT))

from graph_trainer.compiler.node_meta import module_fqn_of, phase_of  # noqa: E402

NOMIX = "full, mix_order_reduction=False"
POINTWISE = "regional+rmsnorm+pointwise"
ISOLATED = "full+isolated rmsnorm"
MARKER, STEP_MARKER = "fusion_report::backward", "fusion_report::step"
KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.(\w+)\(")
ORIGINS = re.compile(r"Source Nodes: \[(.*?)\], Original ATen: \[(.*?)\]")
PHASES = {"forward": "fwd", "backward": "bwd"}
VIEW_OPS = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "permute", "detach", "alias",
            "squeeze", "unsqueeze", "slice", "select", "getitem", "_conj", "view_as_real", "view_as_complex"}  # fmt: skip


# --------------------------------------------------------------------------- build + trace


def build_traced_step(args, extra_argv: list[str] = ()) -> dict[str, Any]:
    """Parse the TOML (+ ``extra_argv`` overrides), build the model on ``args.device``
    and trace one step. Returns ``{"cfg", "traced", "inputs" (flat real inputs),
    "param_dtype", "model_args"}``."""
    from graph_trainer.distributed import parallelize
    from graph_trainer.config import parse_args
    from graph_trainer.model import build_model, build_model_args, build_tokenizer, loss_fn
    from graph_trainer.trace import trace_train_step

    argv = ["--job.config_file", str(args.config_file), *extra_argv]
    argv += ["--training.seq_len", str(args.seq_len)] if args.seq_len else []
    argv += ["--training.local_batch_size", str(args.batch)] if args.batch else []
    cfg = parse_args(argv)
    model_args = build_model_args(cfg, build_tokenizer(cfg))
    if args.layers:
        model_args.n_layers = args.layers
    device = torch.device(args.device)
    model = build_model(model_args, device, seed=0)
    parallelize.apply_ac_for_trace(model, cfg)
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, model_args.vocab_size, shape, generator=gen).to(device) for _ in range(2))
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    traced = trace_train_step(model, loss_fn, tokens, labels, param_dtype=param_dtype if device.type == "cuda" else None)
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    inputs = params + [b for _, b in model.named_buffers()] + [tokens, labels]
    return {"cfg": cfg, "traced": traced, "inputs": inputs, "param_dtype": param_dtype, "model_args": model_args}


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (node meta shallow-copied,
    same codegen), so a pass may modify it without touching ``gm``."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph._codegen = gm.graph._codegen
    return torch.fx.GraphModule(gm, graph)


def compile_way(name: str, gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Apply way ``name`` to a copy of ``gm``; the result is called like ``gm``."""
    from graph_trainer.compiler.passes.annotate_pointwise import annotate_pointwise_for_regional_inductor_pass
    from graph_trainer.compiler.passes.annotate_rmsnorm import annotate_rmsnorm_for_regional_inductor_pass
    from graph_trainer.compiler.passes.full_inductor import full_inductor_pass
    from graph_trainer.compiler.passes.isolate_rmsnorm import isolate_rmsnorm_pass
    from graph_trainer.compiler.passes.regional_inductor import regional_inductor_pass

    gm = copy_graph_module(gm)
    if name == "none":
        return gm
    if name == ISOLATED:
        gm = isolate_rmsnorm_pass(gm, example_inputs)
    if name.startswith("full"):
        return full_inductor_pass(gm, example_inputs)
    gm = annotate_rmsnorm_for_regional_inductor_pass(gm, example_inputs, {})
    if name == POINTWISE:
        gm = annotate_pointwise_for_regional_inductor_pass(gm, example_inputs)
    return regional_inductor_pass(gm, example_inputs)


# --------------------------------------------------------------------------- generated code


@contextlib.contextmanager
def _cpp_origin_comments():
    """Make Inductor's C++ backend write the Source Nodes / Original ATen comment that
    Triton kernels get, above each C++ kernel call (no-op if those internals moved)."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
        from torch._inductor.utils import get_kernel_metadata
        from torch._inductor.virtualized import V

        orig = CppScheduling.codegen_comment
    except (ImportError, AttributeError):
        yield
        return

    def codegen_comment(self, node_schedule, *a, **kw):
        with contextlib.suppress(Exception):  # never break compilation for a comment
            origins, _ = get_kernel_metadata(node_schedule, V.graph.wrapper_code)
            if origins:
                getattr(V.graph.wrapper_code, "make_comment", V.graph.wrapper_code.writeline)(origins)
        return orig(self, node_schedule, *a, **kw)

    CppScheduling.codegen_comment = codegen_comment
    try:
        yield
    finally:
        CppScheduling.codegen_comment = orig


def _clear_inductor_caches() -> None:
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:  # pragma: no cover - older torch
        return
    clear_caches()


@contextlib.contextmanager
def capture_generated_code(directory: Path, patch: dict[str, Any] | None = None, force_disable: bool = True):
    """Compile inside: ``TORCHINDUCTOR_CACHE_DIR=directory``, dynamo reset, the FX
    graph / AOTAutograd / autotune caches off (and ``force_disable_caches`` where it
    exists, unless ``force_disable=False``), C++ origin comments on, and
    ``torch._inductor.config.patch(patch)``. Yields a dict whose
    ``kernels_generated`` (Inductor's codegen counter) is set on exit."""
    import torch._functorch.config as fc
    import torch._inductor.config as ic
    from torch._inductor import metrics

    directory.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    torch._dynamo.reset()
    _clear_inductor_caches()
    caches = {k: False for k in ("fx_graph_cache", "autotune_local_cache") if hasattr(ic, k)}
    if force_disable and hasattr(ic, "force_disable_caches"):
        caches["force_disable_caches"] = True
    aot = {"enable_autograd_cache": False} if hasattr(fc, "enable_autograd_cache") else {}
    info, before = {}, metrics.generated_kernel_count
    try:
        with ic.patch(caches), fc.patch(aot), ic.patch(dict(patch or {})), _cpp_origin_comments():
            yield info
        info["kernels_generated"] = metrics.generated_kernel_count - before
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
        _clear_inductor_caches()


def parse_kernels(src: str, path: str = "") -> list[dict[str, Any]]:
    """Generated kernels defined in one output-code module: ``name``, ``backend``,
    ``lines`` (source lines), ``source_nodes`` / ``aten`` (None without a comment)."""
    lines = src.splitlines()
    kernels = []
    for i, line in enumerate(lines):
        m = KERNEL_DEF.match(line)
        if not m:
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("'''")), len(lines))
        above = []  # comment block above the definition (Triton), else above the first call (C++)
        k = i - 1
        while k >= 0 and lines[k].startswith("#"):
            above.append(lines[k])
            k -= 1
        call = re.compile(rf"^\s+{m.group(1)}(\.run)?\(")
        j = next((j for j in range(end, len(lines)) if call.match(lines[j])), None)
        while j is not None and j > end and lines[j - 1].strip().startswith("#"):
            above.append(lines[j - 1])
            j -= 1
        origin = next((o for o in map(ORIGINS.search, above) if o), None)
        kernels.append({
            "name": m.group(1), "backend": m.group(2), "lines": end - i - 1, "file": path,
            "source_nodes": [s for s in origin.group(1).split(", ") if s] if origin else None,
            "aten": [a for a in origin.group(2).split(", ") if a] if origin else None,
        })  # fmt: skip
    return kernels


def collect_kernels(directory: Path) -> list[dict[str, Any]]:
    """Kernels of every output-code module written under ``directory``."""
    out = []
    for f in sorted(directory.rglob("*.py")):
        src = f.read_text(errors="replace")
        if "async_compile = AsyncCompile()" in src:  # a wrapper, not a standalone kernel file
            out.extend(parse_kernels(src, str(f.relative_to(directory))))
    return out


def _op(node: torch.fx.Node) -> str:
    t = node.target
    return getattr(t, "_opname", None) or getattr(t, "__name__", None) or str(t)


def analyse_kernels(kernels: list[dict[str, Any]], graph: torch.fx.Graph) -> dict[str, Any]:
    """Tag each kernel with ``phase`` (forward / backward / both: it fuses ops of the two) and ``rms_norm_bwd`` (rule: module docstring) and
    ``fused_with``; return the way's summary (counts, largest, norm-bwd kernels)."""
    from graph_trainer.compiler.matching import find_rmsnorm_instances

    nodes = {n.name: n for n in graph.nodes}
    norm_bwd = {n.name for i in find_rmsnorm_instances(graph) if i["kind"] == "backward" for n in i["nodes"]}
    for k in kernels:
        src = [nodes[s] for s in k["source_nodes"] or () if s in nodes]
        phases = {"backward" if phase_of(n) == "backward" else "forward" for n in src}
        k["phase"] = (phases.pop() if len(phases) == 1 else "both") if src else None
        if k["source_nodes"] is None:
            k["rms_norm_bwd"] = "rms_norm_backward" in k["name"]
        else:
            k["rms_norm_bwd"] = any(n.name in norm_bwd for n in src)
        k["fused_with"] = groups = {}  # "module_fqn phase" -> ops
        for n in src if k["rms_norm_bwd"] else ():
            if n.name not in norm_bwd and _op(n) not in VIEW_OPS:
                fqn = re.sub(r"layers\.\d+", "layers.*", module_fqn_of(n) or "<top>")
                ops = groups.setdefault(f"{fqn} {PHASES.get(phase_of(n), '?')}", [])
                ops += [] if _op(n) in ops else [_op(n)]
    largest = max(kernels, key=lambda k: k["lines"], default=None)
    norm_kernels = [k for k in kernels if k["rms_norm_bwd"]]
    merged: dict[str, dict[str, None]] = {}
    for k in norm_kernels:
        for group, ops in k["fused_with"].items():
            merged.setdefault(group, {}).update(dict.fromkeys(ops))
    return {
        "kernels": len(kernels),
        "largest_kernel": {"name": largest["name"], "lines": largest["lines"]} if largest else None,
        "rms_norm_bwd_kernels": [{"name": k["name"], "lines": k["lines"], "fused_with": k["fused_with"]} for k in norm_kernels],
        "fused_with": [f"{group}[{','.join(ops)}]" for group, ops in merged.items()],
        "origin_comments": sum(k["source_nodes"] is not None for k in kernels),
    }


# --------------------------------------------------------------------------- timing + numerics


def _backward_marker() -> None:
    with torch.profiler.record_function(MARKER):
        pass


def insert_backward_marker(gm: torch.fx.GraphModule) -> bool:
    """Insert a profiler marker before the first backward-phase node of ``gm``."""
    first = next((n for n in gm.graph.nodes if phase_of(n) == "backward"), None)
    if first is None:
        return False
    with gm.graph.inserting_before(first):
        gm.graph.call_function(_backward_marker, ())
    gm.recompile()
    return True


def split_phase_times(events: list[dict], kernel_phase: dict[str, str] | None = None) -> list[tuple[float, float]]:
    """(fwd ms, bwd ms) of GPU kernel time per profiled step from chrome-trace
    ``events``: steps are ``fusion_report::step*`` ranges, a kernel belongs to the step
    its launch (runtime/driver event, same correlation id) falls in; boundary = the
    ``fusion_report::backward`` marker, else the launch of the first kernel that
    ``kernel_phase`` calls backward. Steps without a boundary are skipped."""
    notes = [e for e in events if e.get("cat") == "user_annotation"]  # CPU-side record_function ranges
    steps = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in notes if str(e.get("name")).startswith(STEP_MARKER))
    markers = sorted(e["ts"] for e in notes if e.get("name") == MARKER)
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
    kernels = sorted((launch[c], e["name"], e.get("dur", 0.0)) for e in events
                     if e.get("cat") == "kernel" and (c := e.get("args", {}).get("correlation")) in launch)  # fmt: skip
    out = []
    for t0, t1 in steps:
        ks = [k for k in kernels if t0 <= k[0] <= t1]
        bound = next((m for m in markers if t0 <= m <= t1), None)
        if bound is None and kernel_phase:
            bound = next((ts for ts, name, _ in ks if kernel_phase.get(name) == "backward"), None)
        if bound is not None:
            out.append((sum(d for ts, _, d in ks if ts < bound) / 1e3, sum(d for ts, _, d in ks if ts >= bound) / 1e3))
    return out


def profile_phase_ms(step: Callable[[], Any], steps: int, kernel_phase=None) -> tuple[float | None, float | None]:
    """Median (fwd ms, bwd ms) of GPU kernel time over ``steps`` profiled CUDA steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"{STEP_MARKER}{i}"):
                step()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(os.path.join(d, "trace.json"))
        events = json.loads(Path(d, "trace.json").read_text())["traceEvents"]
    split = split_phase_times(events, kernel_phase)
    if not split:
        return None, None
    return statistics.median(f for f, _ in split), statistics.median(b for _, b in split)


def time_steps_ms(step: Callable[[], Any], steps: int, device: torch.device) -> list[float]:
    """Wall time of each of ``steps`` calls, ms (CUDA synchronized)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def compare_outputs(out, ref) -> dict[str, float]:
    """``(loss, *grads)`` vs the reference: loss values, max |diff| of loss and of all
    grads, ``rel`` = max(|dloss| / |loss|, max |dgrad| / max |grad|)."""
    loss, ref_loss = float(out[0]), float(ref[0])
    dg = max(((g.float() - r.float()).abs().max().item() for g, r in zip(out[1:], ref[1:])), default=0.0)
    scale = max((r.float().abs().max().item() for r in ref[1:]), default=0.0)
    dl = abs(loss - ref_loss)
    rel = max(dl / abs(ref_loss) if ref_loss else dl, dg / scale if scale else dg)
    return {"loss": loss, "max_abs_diff_loss": dl, "max_abs_diff_grads": dg, "rel": rel}


# --------------------------------------------------------------------------- driver


def run_way(name: str, built: dict[str, Any], directory: Path, args, ref) -> dict[str, Any]:
    """Compile way ``name``, capture its kernels, check numerics, time it."""
    traced, inputs, device = built["traced"], built["inputs"], torch.device(args.device)
    patch = {"triton.mix_order_reduction": False} if name == NOMIX else {}
    t0 = time.perf_counter()
    with capture_generated_code(directory, patch):
        gm = compile_way(name, traced.gm, traced.example_inputs)
        compile_s = time.perf_counter() - t0
        with torch.no_grad():
            out = gm(*inputs)  # first call under the same settings (lazy compile / autotune)
    res: dict[str, Any] = {"compile_s": round(compile_s, 2)}
    kernels = collect_kernels(directory)
    res.update(analyse_kernels(kernels, traced.gm.graph))
    res["kernel_list"] = [{k: v for k, v in kern.items() if k != "source_nodes"} for kern in kernels]
    res["numerics"] = compare_outputs(out, ref if ref is not None else out)  # none: itself
    has_ref = ref is not None or name == "none"
    res["numerics"]["ok"] = has_ref and bool(res["numerics"]["rel"] <= args.tolerance)
    res["_out"] = out
    stats = getattr(gm, "meta", {}).get("graph_trainer_pass_stats", {})
    res["pass_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}

    def step():
        with torch.no_grad():
            gm(*inputs)

    step()  # warmup
    times = time_steps_ms(step, args.steps, device)
    res.update(step_ms=statistics.median(times), step_ms_all=[round(t, 3) for t in times], fwd_ms=None, bwd_ms=None)
    if device.type == "cuda":
        try:
            marked = name in ("none", "regional+rmsnorm", POINTWISE) and insert_backward_marker(gm)
            mixed = [k["name"] for k in kernels if k["phase"] == "both"]
            if marked or not mixed:
                phases = None if marked else {k["name"]: k["phase"] for k in kernels if k["phase"]}
                res["fwd_ms"], res["bwd_ms"] = profile_phase_ms(step, args.steps, phases)
            else:  # one kernel computes forward and backward ops: no boundary between the phases
                res["phase_split_error"] = f"{len(mixed)} kernel(s) mix forward and backward ops"

        except Exception as e:  # profiling is best effort: keep the step time
            res["phase_split_error"] = f"{type(e).__name__}: {e}"
    return res


def run(args, extra_argv: list[str]) -> dict[str, Any]:
    """All ways for one config; returns the JSON report."""
    import torch._inductor.config as ic

    built = build_traced_step(args, extra_argv)
    has_mix = hasattr(ic, "triton") and hasattr(ic.triton, "mix_order_reduction")
    cuda = torch.device(args.device).type == "cuda"
    ways = ["none", "full", ISOLATED, "regional+rmsnorm", POINTWISE] + ([NOMIX] if has_mix and cuda else [])
    root = Path(args.code_dir) if args.code_dir else Path(tempfile.mkdtemp(prefix="fusion_report_"))
    results, ref = [], None
    for i, name in enumerate(ways):
        print(f"[fusion_report] {name} ...", file=sys.stderr, flush=True)
        res: dict[str, Any] = {"way": name, "status": "ok"}
        try:
            res.update(run_way(name, built, root / f"{i}_{re.sub(r'[^a-z]+', '_', name.lower())}", args, ref))
            out = res.pop("_out")
            ref = out if name == "none" else ref
        except Exception as e:
            res.update(status="failed", reason=f"{type(e).__name__}: {e}")
            traceback.print_exc()
        results.append(res)
    if not args.code_dir:
        shutil.rmtree(root, ignore_errors=True)
    notes = [] if has_mix else ["torch._inductor.config.triton.mix_order_reduction: knob missing in this torch; that way is skipped"]
    if not cuda:
        notes.append("C++ backend: triton.* knobs such as mix_order_reduction do not change its code; "
                     "that way is skipped") if has_mix else None
        notes.append("fwd/bwd ms: n/a on CPU (no GPU kernel timeline); step ms is wall time of the whole step")
    cfg, margs = built["cfg"], built["model_args"]
    return {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or "cpu"),
        "device_type": torch.device(args.device).type, "torch": torch.__version__, "config_file": str(args.config_file),
        "flavor": cfg.model.flavor, "n_layers": margs.n_layers, "dim": margs.dim, "seq_len": cfg.training.seq_len,
        "batch": cfg.training.local_batch_size, "param_dtype": str(built["param_dtype"]).replace("torch.", ""),
        "steps": args.steps, "tolerance": args.tolerance, "cpu_threads": torch.get_num_threads(),
        "mix_order_reduction": "present" if has_mix else "knob missing",
        "trace_time_s": round(built["traced"].trace_time_s, 3), "notes": notes, "ways": results,
    }  # fmt: skip


def markdown_table(report: dict[str, Any]) -> str:
    """The report as a markdown table (one row per way) plus notes."""
    def ms(v):
        return "n/a" if v is None else f"{v:.2f}"

    lines = [
        f"Fusion report: {Path(report['config_file']).name} (flavor {report['flavor']}, {report['n_layers']} layers, "
        f"seq {report['seq_len']} x batch {report['batch']}, {report['param_dtype']}) on {report['device']}, "
        f"torch {report['torch']}; median of {report['steps']} steps",
        "",
        "| way | kernels | largest kernel lines | kernels with rms_norm bwd | fused with it | fwd ms | bwd ms | step ms | max abs diff loss / grads vs none |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]  # fmt: skip
    for r in report["ways"]:
        if r["status"] != "ok":
            lines.append(f"| {r['way']} | {r['status']}: {r.get('reason', '')[:150]} | | | | | | | |")
            continue
        big = r["largest_kernel"]
        nm = r["numerics"]
        lines.append(
            f"| {r['way']} | {r['kernels']} | {big['lines'] if big else 0} | {len(r['rms_norm_bwd_kernels'])} | "
            f"{'; '.join(r['fused_with']) or '-'} | {ms(r['fwd_ms'])} | {ms(r['bwd_ms'])} | {ms(r['step_ms'])} | "
            f"{nm['max_abs_diff_loss']:.1e} / {nm['max_abs_diff_grads']:.1e}{'' if nm['ok'] else ' MISMATCH'} |"
        )
    lines += [""] + [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def add_step_args(ap: argparse.ArgumentParser, tiny_help: str) -> None:
    """The arguments of a traced-step script: config,
    shape overrides, device, CPU threads, ``--tiny`` and ``--json``."""
    ap.add_argument("--config-file", type=Path, default=REPO_ROOT / "train_configs" / "debug_model.toml")
    ap.add_argument("--seq-len", type=int, default=None, help="override training.seq_len (tokens)")
    ap.add_argument("--batch", type=int, default=None, help="override training.local_batch_size")
    ap.add_argument("--layers", type=int, default=None, help="override the flavor's n_layers")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads (default: torch's; 1 with --tiny: CPU timings are noisy otherwise)")
    ap.add_argument("--tiny", action="store_true", help=tiny_help)
    ap.add_argument("--json", type=Path, default=None, help="write the full report here")


def resolve_step_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the defaults of :func:`add_step_args` in place: ``--tiny`` means CPU, 1 layer,
    seq 32, batch 1; the device defaults to CUDA when available; CPU threads are set
    here, before any compile (Inductor's C++ kernels bake the count in). Exits through
    ``ap.error`` for ``--device cuda`` without CUDA."""
    if args.tiny:
        args.device = args.device or "cpu"
        args.layers, args.seq_len, args.batch = args.layers or 1, args.seq_len or 32, args.batch or 1
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads or (args.tiny and args.device == "cpu"):
        torch.set_num_threads(args.threads or 1)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")


def run_and_print(run_report: Callable[[], dict[str, Any]], table: Callable[[dict], str], json_path: Path | None):
    """Run ``run_report``, print ``table(report)`` and write the report as JSON to
    ``json_path`` (if given). Returns the report, or exit status 2 after printing a
    ``UserError`` (bad config / flags)."""
    from graph_trainer.errors import UserError

    try:
        report = run_report()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(report))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"\nwrote {json_path}", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1] + "\nOther --section.key value flags go to graph_trainer.config.parse_args.")  # fmt: skip
    add_step_args(ap, "CI mode: CPU, debug model, 1 layer, seq 32, batch 1, 2 steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5, 2 with --tiny)")
    ap.add_argument("--tolerance", type=float, default=None, help="max rel diff vs none (default 1e-3 fp32, 5e-2 bf16)")
    ap.add_argument("--code-dir", default=None, help="keep the generated code here (default: a temp dir, removed)")
    args, extra = ap.parse_known_args(argv)
    resolve_step_args(ap, args)
    args.steps = args.steps or (2 if args.tiny else 5)
    if args.tolerance is None:
        args.tolerance = 5e-2 if args.device == "cuda" else 1e-3

    report = run_and_print(lambda: run(args, extra), markdown_table, args.json)
    if isinstance(report, int):
        return report
    bad = [f"{r['way']}: {r.get('reason', 'numerics mismatch')}" for r in report["ways"]
           if r["status"] != "ok" or not r["numerics"]["ok"]]  # fmt: skip
    if bad:
        print("failed ways: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
