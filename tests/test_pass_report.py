"""The per-pass report of the pipeline (graph_trainer.compiler.report): node kinds, op
changes, regions and memory per pass, the table, the readable dumps with their diffs, and
the structured-trace artifacts that tlparse lists."""

import json
import logging
import operator
import os
import shutil
import subprocess

import pytest
import torch
import torch.fx
from passes.conftest import fused_norm_graph, tagged_nodes, trace_step  # tests/ is on sys.path

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY
from graph_trainer.compiler import report
from graph_trainer.compiler.common import hold
from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.pipeline import run_pipeline
from graph_trainer.compiler.registry import PipelineStep, registry

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ANNOTATE = "annotate_rmsnorm_for_regional_inductor"


def _annotate(configs=None):
    return PipelineStep(ANNOTATE, registry()[ANNOTATE].fn, {"inductor_configs": configs or {}})


def _hand_built():
    """A graph with every node kind; the expected counts are written out in the test."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(aten.mm.default, (x, w))
    t = g.call_function(aten.t.default, (mm,))
    v = g.call_function(aten.view.default, (t, [16]))
    ar = g.call_function(c10d.all_reduce.default, (v, "sum", "0"))
    wait = g.call_function(c10d.wait_tensor.default, (ar,))
    held = g.call_function(hold, (wait, ar))
    norm = g.call_function(aten._fused_rms_norm.default, (x, [4], w, 1e-6))
    out = g.call_function(operator.getitem, (norm, 0))
    tagged = [g.call_function(aten.mul.Tensor, (out, 2.0)), g.call_function(aten.add.Tensor, (out, 1.0)),
              g.call_function(aten.neg.default, (out,))]
    for node, region in zip(tagged, ("r1", "r1", None)):
        tag = {"inductor_configs": {}} if region is None else {"inductor_configs": {}, "inductor_region": region}
        node.meta["custom"] = {"phase": "forward", COMPILE_WITH_INDUCTOR_KEY: tag}
    g.output((held, *tagged))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_node_kinds_and_regions_of_a_hand_built_graph():
    gm = _hand_built()
    assert report.kind_counts(gm) == {
        "compute": 2,     # mm, _fused_rms_norm
        "collective": 1,  # all_reduce
        "wait": 1,        # wait_tensor
        "view": 2,        # t, view
        "getitem": 1,
        "region": 3,      # mul, add (region r1), neg (no region id)
        "other": 4,       # x, w, hold, output
        "total": 14,
    }
    assert report.count_regions(gm) == 2  # r1 and the tagged nodes without an id
    assert report.call_targets(gm)["aten.mm.default"] == 1
    assert report.call_targets(gm)["_operator.getitem"] == 1
    assert "placeholder" not in report.call_targets(gm)  # call_function nodes only
    assert report.peak_memory_bytes(gm) is None  # no fake values to estimate from
    assert report.kind_counts(lambda *a: a) is None and report.peak_memory_bytes(lambda *a: a) is None


def test_records_count_nodes_ops_regions_and_memory_per_pass():
    """fused_norm_graph(2): 3 placeholders + output, 3 norms (2 forward, 1 backward) with
    2 getitems each, 2 muls. The second forward norm's rstd getitem is dead."""
    gm, fakes = fused_norm_graph(n_norms=2)
    mem_in = estimate_peak_memory(gm)[0]
    records = []
    gm = run_pipeline(gm, fakes, ["remove_dead_code", _annotate()], records=records)
    dce, annotate = records
    assert dce["pass"] == "remove_dead_code" and dce["index"] == 1 and dce["time_s"] >= 0
    assert dce["kinds_before"] == {"compute": 5, "collective": 0, "wait": 0, "view": 0, "getitem": 6,
                                   "region": 0, "other": 4, "total": 15}
    assert (dce["nodes_before"], dce["nodes_after"]) == (15, 14)
    assert dce["ops_removed"] == {"_operator.getitem": 1} and dce["ops_added"] == {}
    # the annotation only tags: every norm and its live getitems become region nodes
    assert annotate["kinds_after"] == {"compute": 2, "collective": 0, "wait": 0, "view": 0, "getitem": 0,
                                       "region": 8, "other": 4, "total": 14}
    assert annotate["ops_added"] == annotate["ops_removed"] == {}
    assert (annotate["regions_before"], annotate["regions_after"]) == (0, 3)
    assert annotate["stats"]["regions"] == 3 and annotate["summary"]
    assert dce["memory_before_bytes"] == mem_in > 0
    assert annotate["memory_after_bytes"] == estimate_peak_memory(gm)[0]
    json.dumps(records)  # JSON-able as they are
    # quiet (the memory policy's trial runs): records without memory estimates
    quiet = []
    run_pipeline(fused_norm_graph(n_norms=1)[0], None, ["remove_dead_code"], quiet=True, records=quiet)
    assert quiet[0]["memory_before_bytes"] is None and quiet[0]["nodes_after"] == 11


def test_remove_noop_views_removes_the_detaches_of_the_traced_model(tiny_llama):
    gm, example_inputs, _ = trace_step(tiny_llama(2))
    detaches = sum(1 for n in gm.graph.nodes if n.target is aten.detach.default)
    assert detaches > 0
    records = []
    run_pipeline(gm, example_inputs, ["remove_noop_views"], records=records)
    (rec,) = records
    assert rec["ops_removed"] == {"aten.detach.default": detaches} and rec["ops_added"] == {}
    assert rec["kinds_before"]["compute"] - rec["kinds_after"]["compute"] == detaches
    assert rec["nodes_before"] - rec["nodes_after"] == detaches
    assert rec["kinds_after"]["view"] == sum(1 for n in gm.graph.nodes if report.node_kind(n) == "view") > 0
    table = report.format_pass_table(records)
    assert f"-{detaches} aten.detach.default" in table and f"(-{detaches})" in table


def test_format_pass_table():
    gm, fakes = fused_norm_graph(n_norms=2)
    records = []
    run_pipeline(gm, fakes, ["remove_dead_code", _annotate()], records=records)
    lines = report.format_pass_table(records).splitlines()
    assert len(lines) == 2 + 1 + len(records)  # header, rule, (input), one per pass
    assert len({len(line) for line in lines}) == 1  # fixed width
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:4] == ["#", "pass", "time_s", "nodes"] and header[4:11] == list(report.NODE_KINDS)
    row = [c.strip() for c in lines[4].strip("|").split("|")]
    assert row[1] == ANNOTATE and row[header.index("region")] == "8 (+8)" and row[header.index("regions")] == "3 (+3)"
    assert report.format_pass_table([]) == ""


def test_dumps_have_diffs_and_full_annotations(tmp_path):
    """Torch's ``# Annotation:`` comment cuts every value at 40 characters; the dump has
    each node's whole ``custom`` dict. A pass that changes nothing writes an empty diff."""
    gm, fakes = fused_norm_graph(n_norms=2)
    configs = {"max_autotune": False, "coordinate_descent_tuning": False}
    gm = run_pipeline(gm, fakes, ["remove_noop_views", "remove_dead_code", _annotate(configs)], dump_folder=str(tmp_path))
    graphs = tmp_path / "graphs"
    assert (graphs / "01_remove_noop_views.diff").read_text() == ""
    dce = (graphs / "02_remove_dead_code.diff").read_text()
    assert dce.startswith("--- 01_remove_noop_views.py\n+++ 02_remove_dead_code.py\n")
    assert any(line.startswith("-") and "getitem_3" in line for line in dce.splitlines())
    diff = (graphs / f"03_{ANNOTATE}.diff").read_text()
    assert diff and "+        # custom: " in diff and "'inductor_region': 'rmsnorm_forward_0'" in diff
    text = (graphs / f"03_{ANNOTATE}.py").read_text()
    for node in tagged_nodes(gm):
        full = str(node.meta["custom"])
        assert len(str(node.meta["custom"][COMPILE_WITH_INDUCTOR_KEY])) > 40 and f"# custom: {full}" in text
    summary = json.loads((graphs / "summary.json").read_text())
    assert [r["pass"] for r in summary] == ["input", "remove_noop_views", "remove_dead_code", ANNOTATE]
    assert summary[3]["kinds_after"]["region"] == 8 and summary[3]["ops"]["aten._fused_rms_norm.default"] == 2


class _Capture(logging.Handler):
    """A handler on torch's structured-trace logger (as TORCH_TRACE installs one)."""

    def __init__(self):
        super().__init__()
        self.artifacts = []

    def emit(self, record):
        meta = getattr(record, "metadata", {})
        if "artifact" in meta:
            self.artifacts.append((meta["artifact"]["name"], meta["artifact"]["encoding"], record.payload))


def test_trace_artifacts_in_process():
    from torch._logging._internal import trace_log

    gm, fakes = fused_norm_graph(n_norms=2)
    capture = _Capture()
    trace_log.addHandler(capture)
    try:
        assert report.trace_enabled()
        run_pipeline(gm, fakes, ["remove_dead_code", _annotate()])
        run_pipeline(gm, fakes, ["remove_dead_code"], quiet=True)  # quiet: no artifacts
    finally:
        trace_log.removeHandler(capture)
    names = [name for name, _, _ in capture.artifacts]
    assert names == [
        "graph_before_passes",
        "graph_after_remove_dead_code", "graph_diff_remove_dead_code", "pass_record_remove_dead_code",
        f"graph_after_{ANNOTATE}", f"graph_diff_{ANNOTATE}", f"pass_record_{ANNOTATE}",
        "pass_table", "pass_records",
    ]
    by_name = {name: (enc, payload) for name, enc, payload in capture.artifacts}
    enc, payload = by_name[f"pass_record_{ANNOTATE}"]
    assert enc == "json" and json.loads(payload)["regions_after"] == 3
    assert "| (input)" in by_name["pass_table"][1]
    assert "'inductor_region': 'rmsnorm_forward_0'" in by_name[f"graph_after_{ANNOTATE}"][1]


@pytest.mark.slow
def test_tlparse_lists_one_artifact_per_pass(tmp_path, monkeypatch):
    """A 2-step debug run with TORCH_TRACE (one process: one trace file) and the RMSNorm
    regions compiled by Inductor; tlparse lists our artifacts for every pass of the run
    (the passes named in the run summary) and Inductor's own for the region compiles."""
    from _runs import run_debug

    tlparse = shutil.which("tlparse")
    if tlparse is None:
        pytest.skip("the tlparse binary is not installed (pip install tlparse, in the test extra)")
    trace_dir = tmp_path / "trace"
    monkeypatch.setenv("TORCH_TRACE", str(trace_dir))
    small = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
    r = run_debug(tmp_path / "run", small, "--compile.numerics_changing_optim", "--compile.dump_graphs", steps=2,
                  direct=True)  # the trainer's entry point, without run_train.sh's pre-check and torchrun
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Per-pass report" in r.stdout and "| (input)" in r.stdout

    summary = [json.loads(line)["summary"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if '"summary"' in line][-1]
    passes = [p["pass"] for p in summary["passes"]]
    assert passes[-2:] == [ANNOTATE, "regional_inductor"]
    assert summary["passes"][-1]["regions_after"] == summary["passes"][-1]["stats"]["regions"] > 0
    assert (tmp_path / "run" / "graphs" / f"{len(passes):02d}_regional_inductor.diff").read_text()

    (log,) = os.listdir(trace_dir)
    out = tmp_path / "tl_out"
    p = subprocess.run([tlparse, str(trace_dir / log), "-o", str(out), "--overwrite", "--no-browser"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # compile_directory.json: {compile id: {"artifacts": [{"name": "<name>_<n>.<ext>", ...}]}};
    # ours carry no compile id and are listed under "[-/-]"
    directory = json.loads((out / "compile_directory.json").read_text())
    names = [a["name"].rsplit("_", 1)[0] for entry in directory.values() for a in entry["artifacts"]]
    for name in passes:
        assert names.count(f"graph_after_{name}") == 1, name
        assert names.count(f"pass_record_{name}") == 1, name
    assert {"graph_before_passes", "pass_table", "pass_records"} <= set(names)
    assert any(n.startswith("inductor_output_code") for n in names)  # Inductor's region compiles
    index = (out / "index.html").read_text()
    assert all(f"graph_after_{name}_" in index for name in passes)
