"""scripts/fusion_report.py: one --tiny CPU run and its parsing helpers."""

import json
import math

import pytest
import _early
from _launch import run_script
from _scripts import SCRIPTS, load_script, table

NOMIX = "full, mix_order_reduction=False"
POINTWISE = "regional+rmsnorm+pointwise"
ISOLATED = "full+isolated rmsnorm"
COMPILED = ["full", ISOLATED, "regional+rmsnorm", POINTWISE]
fr = load_script("fusion_report")


@_early.job("fusion_report_tiny")
def _tiny_run(tmp, env):
    out = tmp / "report.json"  # forked from tests/_launch.py's server (its imports done), in the repo root:
    return out, run_script([SCRIPTS / "fusion_report.py", "--tiny", "--json", out], env=env, timeout=900)


@_early.uses("fusion_report_tiny")
def test_tiny_run():
    """The ways and their kernels, each matching the uncompiled numerics; the table matches the JSON."""
    out, proc = _early.result("fusion_report_tiny")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    ways = {w["way"]: w for w in report["ways"]}
    assert [report[k] for k in ("device_type", "n_layers", "seq_len", "batch", "steps")] == ["cpu", 1, 32, 1, 2]
    assert list(ways) == ["none", *COMPILED]  # the Triton knob's way: CUDA only
    assert any(("knob missing" if report["mix_order_reduction"] != "present" else "that way is skipped") in n
               for n in report["notes"])
    assert all(w["status"] == "ok" for w in ways.values()), [w.get("reason") for w in ways.values()]
    none = ways["none"]
    assert none["kernels"] == 0 and none["largest_kernel"] is None and none["rms_norm_bwd_kernels"] == []
    for name in COMPILED + ([NOMIX] if NOMIX in ways else []):
        assert (w := ways[name])["kernels"] >= 1 and len(w["kernel_list"]) == w["kernels"], name
        assert w["origin_comments"] == w["kernels"], f"{name}: kernels without Source Nodes comments"
        assert w["largest_kernel"]["lines"] == max(k["lines"] for k in w["kernel_list"]) > 0
        assert w["rms_norm_bwd_kernels"], f"{name}: no kernel holds the rms_norm backward"
        assert all(k["phase"] in ("forward", "backward", "both") for k in w["kernel_list"])
        assert all(k["phase"] in ("backward", "both") for k in w["kernel_list"] if k["rms_norm_bwd"])
    for name in ("regional+rmsnorm", POINTWISE):  # a region lies in one phase
        assert all(k["phase"] in ("forward", "backward") for k in ways[name]["kernel_list"]), name
        assert all(k["fused_with"] == {} for k in ways[name]["rms_norm_bwd_kernels"])  # the norm backward alone
    assert ways[POINTWISE]["kernels"] > ways["regional+rmsnorm"]["kernels"]  # SwiGLU, adds, loss
    assert ways["regional+rmsnorm"]["fused_with"] == []
    assert ways["regional+rmsnorm"]["pass_stats"]["regions"] >= 6  # 3 norms x (fwd, bwd) for one layer
    assert ways["full"]["fused_with"], ways["full"]["rms_norm_bwd_kernels"]  # forward recompute / adds fused in
    assert (iso := ways[ISOLATED])["pass_stats"]["fusion_groups"] >= 6 and iso["pass_stats"]["fusions_refused"] > 0
    assert len(iso["fused_with"]) < len(ways["full"]["fused_with"]), (iso["fused_with"], ways["full"]["fused_with"])
    ref = none["numerics"]
    assert math.isfinite(ref["loss"]) and ref["max_abs_diff_loss"] == 0 and ref["max_abs_diff_grads"] == 0
    for name, w in ways.items():
        assert (nm := w["numerics"])["ok"] and nm["rel"] <= report["tolerance"], name
        assert abs(nm["loss"] - ref["loss"]) == pytest.approx(nm["max_abs_diff_loss"], abs=1e-6)
        assert nm["max_abs_diff_loss"] < 1e-4 and nm["max_abs_diff_grads"] < 1e-4, name
        assert len(w["step_ms_all"]) == report["steps"] and math.isfinite(w["step_ms"]) and w["step_ms"] > 0, name
        assert w["fwd_ms"] is None and w["bwd_ms"] is None  # not separable on CPU
    header, body = table(proc.stdout)
    assert header == ("| way | kernels | largest kernel lines | kernels with rms_norm bwd | fused with it | "
                      "fwd ms | bwd ms | step ms | max abs diff loss / grads vs none |")
    assert list(body) == list(ways)
    for name, cells in body.items():
        assert cells[0] == str(ways[name]["kernels"]) and cells[2] == str(len(ways[name]["rms_norm_bwd_kernels"]))
        assert cells[4] == cells[5] == "n/a" and float(cells[6]) > 0
    assert "fwd/bwd ms: n/a on CPU" in proc.stdout


def test_parse_kernels_triton_header_and_cpp_call_site():
    src = "\n".join([
        "async_compile = AsyncCompile()", "", "# kernel path: /tmp/x.py",
        "# Topologically Sorted Source Nodes: [mul_9, sum_1], Original ATen: [aten.mul, aten.sum]",
        "# Source node to ATen node mapping:",
        "triton_red_fused_mul_sum_0 = async_compile.triton('triton_red_fused_mul_sum_0', '''",
        "import triton", "@triton.jit", "def triton_(x):", "    pass", "''', device_str='cuda')",
        "cpp_fused_add_1 = async_compile.cpp_pybinding(['float*'], r'''", "extern \"C\" void kernel(float* a) {}",
        "''')", "def call(args):", "    buf0 = empty_strided_cpu((4,), (1,), torch.float32)",
        "    # Topologically Sorted Source Nodes: [add], Original ATen: [aten.add]",
        "    cpp_fused_add_1(buf0)", "    triton_red_fused_mul_sum_0.run(buf0, stream=stream0)",
    ])  # fmt: skip
    kernels = fr.parse_kernels(src)
    assert [(k["name"], k["backend"], k["lines"]) for k in kernels] == [
        ("triton_red_fused_mul_sum_0", "triton", 4), ("cpp_fused_add_1", "cpp_pybinding", 1)]  # fmt: skip
    assert kernels[0]["source_nodes"] == ["mul_9", "sum_1"] and kernels[0]["aten"] == ["aten.mul", "aten.sum"]
    assert kernels[1]["source_nodes"] == ["add"]
    no_comment = src.replace("# Topologically Sorted Source Nodes: [add], Original ATen: [aten.add]", "# other")
    assert fr.parse_kernels(no_comment)[1]["source_nodes"] is None


def test_split_phase_times_marker_and_kernel_phase():
    def launch(corr, ts, name="k", dur=1000.0):
        return [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "args": {"correlation": corr}},
                {"cat": "kernel", "name": name, "ts": ts + 5, "dur": dur, "args": {"correlation": corr}}]  # fmt: skip

    events = [{"cat": "user_annotation", "name": name, "ts": ts, "dur": dur} for name, ts, dur in (
        (f"{fr.STEP_MARKER}0", 0, 100), (fr.MARKER, 50, 0), (f"{fr.STEP_MARKER}1", 200, 100))]
    events += launch(1, 10) + launch(2, 60, dur=3000.0)  # step 0: marker at 50
    events += launch(3, 210, "fwd_k", 2000.0) + launch(4, 250, "bwd_k", 500.0) + launch(5, 260, dur=500.0)
    assert fr.split_phase_times(events, None) == [(1.0, 3.0)]  # step 1 has no boundary
    assert fr.split_phase_times(events, {"fwd_k": "forward", "bwd_k": "backward"}) == [(1.0, 3.0), (2.0, 1.0)]
