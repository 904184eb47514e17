"""The per-pass report (graph_trainer.compiler.report): records, the table, dumps and diffs, tlparse artifacts."""

import json
import logging
import operator
import os
import shutil
import subprocess
from unittest import mock

import pytest
import torch
from torch._logging._internal import trace_log

import _early  # tests/ is on sys.path
from _runs import SMALL, run_debug
from passes.conftest import fused_norm_graph, tagged_nodes

from graph_trainer import COMPILE_WITH_INDUCTOR_KEY
from graph_trainer.compiler import report
from graph_trainer.compiler.collectives import hold
from graph_trainer.compiler.memory_estimate import estimate_peak_memory
from graph_trainer.compiler.pipeline import run_pipeline
from graph_trainer.compiler.registry import PipelineStep, registry
from graph_trainer.metrics import read_metrics

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ANNOTATE = "annotate_rmsnorm_for_regional_inductor"


def test_node_kinds_and_regions_of_a_hand_built_graph():
    g = torch.fx.Graph()  # every node kind
    x, w = g.placeholder("x"), g.placeholder("w")
    mm = g.call_function(aten.mm.default, (x, w))
    v = g.call_function(aten.view.default, (g.call_function(aten.t.default, (mm,)), [16]))
    ar = g.call_function(c10d.all_reduce.default, (v, "sum", "0"))
    held = g.call_function(hold, (g.call_function(c10d.wait_tensor.default, (ar,)), ar))
    out = g.call_function(operator.getitem, (g.call_function(aten._fused_rms_norm.default, (x, [4], w, 1e-6)), 0))
    tagged = [g.call_function(op, args) for op, args in ((aten.mul.Tensor, (out, 2.0)), (aten.add.Tensor, (out, 1.0)),
                                                         (aten.neg.default, (out,)))]
    for node, region in zip(tagged, ({"inductor_region": "r1"}, {"inductor_region": "r1"}, {})):
        node.meta["custom"] = {"phase": "forward", COMPILE_WITH_INDUCTOR_KEY: {"inductor_configs": {}, **region}}
    g.output((held, *tagged))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    # compute: mm, norm; views: t, view; regions: mul, add (r1), neg (no id); other: x, w, hold, output
    assert report.kind_counts(gm) == {"compute": 2, "collective": 1, "wait": 1, "view": 2, "getitem": 1,
                                      "region": 3, "other": 4, "total": 14}
    assert report.count_regions(gm) == 2  # r1 and the tagged nodes without an id
    targets = report.call_targets(gm)  # call_function nodes only
    assert targets["aten.mm.default"] == targets["_operator.getitem"] == 1 and "placeholder" not in targets
    assert report.peak_memory_bytes(gm) is None  # no fake values to estimate from
    assert report.kind_counts(lambda *a: a) is None and report.peak_memory_bytes(lambda *a: a) is None


def test_records_table_dumps_and_trace_artifacts(tmp_path, log_lines):
    """fused_norm_graph(2) (15 nodes, the second norm's rstd getitem dead) through 3 passes, a quiet run after."""
    gm, fakes = fused_norm_graph(n_norms=2)
    mem_in = estimate_peak_memory(gm)[0]
    configs = {"max_autotune": False, "coordinate_descent_tuning": False}
    annotate = PipelineStep(ANNOTATE, registry()[ANNOTATE].fn, {"inductor_configs": configs})
    passes = ["remove_noop_views", "remove_dead_code", ANNOTATE]
    records, quiet, emitted = [], [], []
    capture = logging.Handler()  # on torch's structured-trace logger, as TORCH_TRACE installs one
    capture.emit = emitted.append
    # alone: torch's LazyTraceHandler removes itself on the first record, and logging then skips the next handler
    with mock.patch.object(trace_log, "handlers", [capture]):
        assert report.trace_enabled()
        gm = run_pipeline(gm, fakes, [*passes[:2], annotate], dump_folder=str(tmp_path), records=records)
        run_pipeline(*fused_norm_graph(n_norms=1), ["remove_dead_code"], quiet=True, records=quiet)
    assert sum(line.startswith("graph pass") for line in log_lines) == 3  # quiet: no log lines
    noop, dce, ann = records
    assert dce["pass"] == "remove_dead_code" and dce["index"] == 2 and dce["time_s"] >= 0
    assert dce["kinds_before"] == {"compute": 5, "collective": 0, "wait": 0, "view": 0, "getitem": 6,
                                   "region": 0, "other": 4, "total": 15}
    assert (dce["nodes_before"], dce["nodes_after"]) == (15, 14)
    assert dce["ops_removed"] == {"_operator.getitem": 1} and dce["ops_added"] == {}
    assert ann["kinds_after"] == {"compute": 2, "collective": 0, "wait": 0, "view": 0, "getitem": 0,
                                  "region": 8, "other": 4, "total": 14}  # only tags: norms, live getitems: regions
    assert ann["ops_added"] == ann["ops_removed"] == {} and (ann["regions_before"], ann["regions_after"]) == (0, 3)
    assert ann["stats"]["regions"] == 3 and ann["summary"]
    assert noop["memory_before_bytes"] == mem_in > 0 and ann["memory_after_bytes"] == estimate_peak_memory(gm)[0]
    assert quiet[0]["memory_before_bytes"] is None and quiet[0]["nodes_after"] == 11  # quiet: no memory estimates
    lines = report.format_pass_table(records).splitlines()
    assert len(lines) == 2 + 1 + len(records)  # header, rule, (input), one per pass
    assert len({len(line) for line in lines}) == 1  # fixed width
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:4] == ["#", "pass", "time_s", "nodes"] and header[4:11] == list(report.NODE_KINDS)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert rows[0][:4] == ["0", "(input)", "", "15"]
    assert rows[2][header.index("nodes")] == "14 (-1)" and rows[2][-1] == "-1 _operator.getitem"
    assert rows[3][1] == ANNOTATE and rows[3][header.index("region")] == "8 (+8)"
    assert rows[3][header.index("regions")] == "3 (+3)" and report.format_pass_table([]) == ""
    graphs = tmp_path / "graphs"  # the dumps: empty diffs for unchanged graphs
    assert (graphs / "01_remove_noop_views.diff").read_text() == ""
    dce_diff = (graphs / "02_remove_dead_code.diff").read_text()
    assert dce_diff.startswith("--- 01_remove_noop_views.py\n+++ 02_remove_dead_code.py\n")
    assert any(line.startswith("-") and "getitem_3" in line for line in dce_diff.splitlines())
    diff = (graphs / f"03_{ANNOTATE}.diff").read_text()
    assert "+        # custom: " in diff and "'inductor_region': 'rmsnorm_forward_0'" in diff
    text = (graphs / f"03_{ANNOTATE}.py").read_text()  # whole custom dicts: torch's ``# Annotation:`` cuts at 40
    for custom in (node.meta["custom"] for node in tagged_nodes(gm)):
        assert len(str(custom[COMPILE_WITH_INDUCTOR_KEY])) > 40 and f"# custom: {custom}" in text
    summary = json.loads((graphs / "summary.json").read_text())
    assert [r["pass"] for r in summary] == ["input", *passes]
    assert summary[3]["kinds_after"]["region"] == 8 and summary[3]["ops"]["aten._fused_rms_norm.default"] == 2
    artifacts = [(r.metadata["artifact"]["name"], r.metadata["artifact"]["encoding"], r.payload) for r in emitted
                 if "artifact" in getattr(r, "metadata", {})]  # the trace artifacts, none from the quiet run
    assert [name for name, _, _ in artifacts] == ["graph_before_passes", *[f"{kind}_{p}" for p in passes for kind in (
        "graph_after", "graph_diff", "pass_record")], "pass_table", "pass_records"]
    artifacts = {name: (enc, payload) for name, enc, payload in artifacts}
    enc, payload = artifacts[f"pass_record_{ANNOTATE}"]
    assert enc == "json" and json.loads(payload)["regions_after"] == 3 and "| (input)" in artifacts["pass_table"][1]
    assert "'inductor_region': 'rmsnorm_forward_0'" in artifacts[f"graph_after_{ANNOTATE}"][1]


@_early.job("tlparse_traced_run")
def _traced_run(tmp, env):
    if shutil.which("tlparse") is None:
        return None
    return tmp, run_debug(tmp / "run", SMALL, "--compile.numerics_changing_optim", "--compile.dump_graphs", steps=2,
                          direct=True,  # the trainer's entry point, without run_train.sh's pre-check and torchrun
                          env={**env, "TORCH_TRACE": str(tmp / "trace")})


@_early.uses("tlparse_traced_run")
def test_tlparse_lists_one_artifact_per_pass(tmp_path):
    tlparse = shutil.which("tlparse") or pytest.skip("the tlparse binary is not installed (pip install tlparse)")
    run_tmp, r = _early.result("tlparse_traced_run")
    trace_dir = run_tmp / "trace"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Per-pass report" in r.stdout and "| (input)" in r.stdout
    summary = read_metrics(run_tmp / "run" / "metrics.jsonl")[1]
    assert (passes := [p["pass"] for p in summary["passes"]])[-2:] == [ANNOTATE, "regional_inductor"]
    assert summary["passes"][-1]["regions_after"] == summary["passes"][-1]["stats"]["regions"] > 0
    assert (run_tmp / "run" / "graphs" / f"{len(passes):02d}_regional_inductor.diff").read_text()
    (log,) = os.listdir(trace_dir)
    out = tmp_path / "tl_out"
    p = subprocess.run([tlparse, str(trace_dir / log), "-o", str(out), "--overwrite", "--no-browser"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # compile_directory.json: {compile id: {"artifacts": [{"name": "<name>_<n>.<ext>", ...}]}}; ours under "[-/-]"
    directory = json.loads((out / "compile_directory.json").read_text())
    names = [a["name"].rsplit("_", 1)[0] for entry in directory.values() for a in entry["artifacts"]]
    assert all(names.count(f"{kind}_{name}") == 1 for name in passes for kind in ("graph_after", "pass_record")), names
    assert {"graph_before_passes", "pass_table", "pass_records"} <= set(names)
    assert any(n.startswith("inductor_output_code") for n in names)  # Inductor's region compiles
    assert all(f"graph_after_{name}_" in (out / "index.html").read_text() for name in passes)
