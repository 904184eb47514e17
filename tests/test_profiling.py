"""--profiling.enable_profiling (graph_trainer/tools/profiling.py) and the step timeline (tools/timeline.py)."""

import json
import struct
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest
import torch

from graph_trainer.tools.profiling import (_events_of, _intervals_of, _json_text, _launches_of, _write_picture,
                                           collective_label, kernel_category, summarize_events, summary_markdown)
from graph_trainer.tools.timeline import (collective_breakdown, device_steps, draw_timeline, idle_causes, pack_step,
                                          read_step, timeline_a_vs_b, timeline_breakdown, unpack_step)

SUM_KEYS = ("wall_ms", "compute_ms", "exposed_comm_ms", "idle_ms")
# 0..100 us: a CPU-like nest (matmul in an eager op), communication partly overlapped; copy, last comm clipped
HAND = [(0, 40, "eager pointwise / reduction"), (5, 35, "matmul"), (30, 60, "communication"),
        (70, 80, "inductor triton"), (85, 95, "communication"), (-10, 2, "copy"), (98, 130, "communication")]


def _check_png(path, min_size=(800, 200)):  # a PNG of at least min_size pixels: (width, height)
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) > 5000
    width, height = struct.unpack(">II", data[16:24])
    assert width >= min_size[0] and height >= min_size[1]
    return width, height


def _assert_ranges(actual, expected):  # flattened: pytest.approx compares no nested sequences
    assert len(actual) == len(expected), (actual, expected)
    assert [x for r in actual for x in r] == pytest.approx([x for r in expected for x in r]), (actual, expected)


@pytest.mark.parametrize("name, category", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "eager pointwise / reduction"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_3", "inductor triton"), ("some_kernel", "other"),
    ("triton_red_fused__fused_rms_norm_add_all_gather_into_tensor_21", "inductor triton"), ("aten::mm", "matmul"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float4, 128>", "copy"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", "attention"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"), ("aten::view", "view / metadata (CPU)"),
    ("triton_poi_fused_add_reduce_scatter_tensor_view_36", "inductor triton"), ("gloo:all_gather", "communication"),
    ("triton_red_fused__fused_rms_norm_backward_0", "inductor triton"), ("Memcpy DtoD (Device -> Device)", "copy"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopB_TNT", "matmul"), ("triton_tem_fused_flex_attention_0", "attention"),
])
def test_kernel_category(name, category):
    assert kernel_category(name) == category


def test_summarize_events_per_step_and_shares():
    events = [("nvjet_gemm", 6000.0, 30), ("triton_poi_fused_add_0", 2000.0, 20),
              ("ncclDevKernel_AllGather", 2000.0, 4), ("aten::idle_zero", 0.0, 1)]
    s = summarize_events(events, steps=2, top=2)
    assert s["steps"] == 2 and s["total_ms"] == pytest.approx(5.0)  # 10 ms over 2 steps
    assert list(cats := s["categories"])[0] == "matmul" and cats["matmul"]["ms"] == pytest.approx(3.0)
    assert cats["matmul"]["calls"] == 15 and cats["communication"]["share"] == pytest.approx(0.2)
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert [r["name"] for r in s["top"]] == ["nvjet_gemm", "triton_poi_fused_add_0"]
    assert "| matmul | 3.00 | 60.0 % | 15 |" in (md := summary_markdown(s)) and "`nvjet_gemm`" in md


def test_timeline_breakdown_splits_wall_into_compute_exposed_comm_and_idle():
    # step 1: comm 30-60 (10 under the gemm, 20 exposed), idle 20 us; step 2: comm hidden, a kernel past it clipped
    kernels = [(0, 40, "matmul"), (30, 60, "communication"), (70, 80, "inductor triton"),
               (100, 200, "matmul"), (120, 140, "communication"), (190, 250, "copy")]
    t = timeline_breakdown(kernels, [(0, 100), (100, 200)])
    assert [t[k] for k in ("wall_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "idle_ms")] == pytest.approx(
        [0.1, (50 + 100) / 2 / 1e3, (30 + 20) / 2 / 1e3, 20 / 2 / 1e3, 30 / 2 / 1e3])
    assert t["exposed_tail_ms"] == pytest.approx(20 / 2 / 1e3) and t["exposed_head_ms"] == 0  # after step 1's gemm
    assert timeline_breakdown(kernels, [])["wall_ms"] == 0
    # exposed before the first matmul (0-10), between matmuls (30-35), after the last one (60-70)
    t2 = timeline_breakdown([(0, 10, "communication"), (10, 30, "matmul"), (30, 35, "communication"),
                            (35, 60, "matmul"), (55, 70, "communication")], [(0, 70)])
    assert (t2["exposed_head_ms"], t2["exposed_comm_ms"], t2["exposed_tail_ms"]) == pytest.approx((0.01, 0.025, 0.01))
    md = summary_markdown({**summarize_events([("nvjet_gemm", 150.0, 2)], steps=2), "timeline": t})
    assert "| only communication running | 0.01 | 10.0 % |" in md and "| nothing running | 0.01 | 15.0 % |" in md
    assert "| (of it: after the last matmul) | 0.01 | 10.0 % |" in md


def _evt(name, a, b, dev="CPU", ann=False, thread=1, stream=7, id=0, parent=None):
    return NS(name=name, time_range=NS(start=a, end=b), device_type=getattr(torch.autograd.DeviceType, dev),
              is_user_annotation=ann, thread=thread, device_resource_id=stream, id=id, cpu_parent=parent,
              self_device_time_total=b - a)


def test_profiler_events_to_intervals_on_cuda_and_cpu():
    """Two profiled steps; prof.events() names each step's host range and device annotations ``ProfilerStep*``."""
    cuda = [_evt("ProfilerStep*", 0, 1000, ann=True), _evt("ProfilerStep*", 100, 900, "CUDA", ann=True),
            _evt("ProfilerStep*", 150, 500, "CUDA", ann=True),  # a nested device annotation of the same step
            _evt("nccl:all_gather", 100, 400, "CUDA", ann=True), _evt("nvjet_gemm", 200, 600, "CUDA"),
            _evt("ncclDevKernel_AllGather", 100, 400, "CUDA"), _evt("ProfilerStep*", 1000, 1900, ann=True),
            _evt("ProfilerStep*", 1000, 1500, "CUDA", ann=True), _evt("nvjet_gemm", 1050, 1500, "CUDA")]
    kernels, steps, collectives = _intervals_of(NS(events=lambda: cuda), on_device=True)
    assert steps == [(100, 900), (1000, 1500)]
    t = timeline_breakdown(kernels, steps[:1])
    assert [t[k] for k in SUM_KEYS] == pytest.approx([0.8, 0.4, 0.1, 0.3])  # wall: the step's device annotation
    assert collectives == [(100, 400, "AllGather")]
    cpu = [_evt("ProfilerStep*", 0, 1000, ann=True), _evt("aten::mm", 0, 300),
           _evt("_c10d_functional::wait_tensor", 300, 700), _evt("gloo:all_gather", 250, 650, ann=True, thread=2),
           _evt("aten::copy_", 600, 650, thread=2), _evt("aten::add", 700, 800), _evt("ProfilerStep*", 1000, 1200)]
    kernels, steps, collectives = _intervals_of(NS(events=lambda: cpu), on_device=False)
    assert steps == [(0, 1000), (1000, 1200)] and collectives == [(250, 650, "all_gather")]
    assert sorted(kernels) == [(0, 300, "matmul"), (250, 650, "communication"),
                               (700, 800, "eager pointwise / reduction")]
    t = timeline_breakdown(kernels, steps[:1])
    assert t["exposed_comm_ms"] == pytest.approx(0.35) and t["idle_ms"] == pytest.approx(0.25)


def test_torchs_own_profiler_events_give_one_window_a_step():
    """Two recorded steps of torch.profiler on CPU (its events name every step ``ProfilerStep*``), one mm each."""
    seen = []
    with torch.profiler.profile(schedule=torch.profiler.schedule(wait=0, warmup=1, active=2),
                                on_trace_ready=lambda p: seen.append(_intervals_of(p, on_device=False))) as prof:
        for _ in range(3):
            torch.mm(torch.randn(64, 64), torch.randn(64, 64))
            prof.step()
    kernels, steps, _ = seen[0]
    assert len(steps) == 2 and [sum(a <= k < b for k, _, c in kernels if c == "matmul") for a, b in steps] == [1, 1]


def test_kernel_rows_hold_the_steps_work_only():
    """The host a step ahead: the profiler's window also records the step before's last kernels (0-90 us)."""
    events = [_evt("ProfilerStep#4", 50, 400, ann=True), _evt("ProfilerStep#4", 100, 300, "CUDA", ann=True),
              _evt("nvjet_a", 0, 90, "CUDA"), _evt("nvjet_a", 100, 180, "CUDA"), _evt("nvjet_a", 200, 260, "CUDA"),
              _evt("triton_b", 280, 300, "CUDA")]
    prof = NS(events=lambda: events)
    steps = _intervals_of(prof, on_device=True)[1]
    rows, unit = _events_of(prof, steps, on_device=True)
    assert steps == [(90, 300)] and unit == "device" and rows == [("nvjet_a", 140, 2), ("triton_b", 20, 1)]
    assert _events_of(prof, [], on_device=True)[0][0] == ("nvjet_a", 230, 3)


def test_a_step_on_the_device_runs_from_the_work_before_it_to_its_last_kernel():
    """The device's step: from the end of the work before it (or the host step's start, if later) to its last kernel."""
    ahead = [(0, 300, "matmul"), (320, 1200, "matmul")]  # the host a step ahead: 0-300 is the step before's end
    assert device_steps([(0, 1000)], [(320, 1200)], ahead) == [(300, 1200)]
    late = [(0, 50, "matmul"), (400, 900, "matmul")]  # the device waited for the host (step from 100)
    assert device_steps([(100, 1000)], [(400, 900)], late) == [(100, 900)]
    assert device_steps([(100, 1000)], [(400, 900)], late[1:]) == [(400, 900)]  # nothing recorded before it
    assert device_steps([(0, 10), (10, 20)], [(2, 9)], []) == [(0, 10), (10, 20)]  # not one annotation per step
    assert timeline_breakdown(ahead, device_steps([(0, 1000)], [(320, 1200)], ahead))["idle_ms"] == pytest.approx(0.02)


def test_timeline_imports_no_profiling_nor_torch():
    code = ("import sys, graph_trainer.tools.timeline; "
            "print([m for m in ('torch', 'graph_trainer.tools.profiling') if m in sys.modules])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout.strip() == b"[]"


def test_pack_step_keeps_the_step_compact_and_lossless():
    packed = pack_step([(a + 1000, b + 1000, c) for a, b, c in HAND], (1000, 1100), step_num=7)
    assert packed["step"] == 7 and packed["wall_ms"] == pytest.approx(0.1)
    assert packed["kernels"][0] == [0.0, 0.002, packed["categories"].index("copy")]  # clipped to the step
    assert len(packed["kernels"]) == len(HAND) and len(packed["categories"]) == 5
    kernels, step = unpack_step(packed)
    assert step == (0.0, pytest.approx(100.0))
    assert timeline_breakdown(kernels, [step]) == pytest.approx(timeline_breakdown(HAND, [(0, 100)]))
    text = _json_text({"steps": 1, "step_intervals": packed})  # one row per line
    assert json.loads(text)["step_intervals"] == packed and '\n   [0.0, 0.002, ' in text and len(text.splitlines()) < 30


def test_no_matplotlib_skips_the_picture_with_one_line(tmp_path, monkeypatch, log_lines):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    _write_picture(str(tmp_path / "t.png"), HAND, (0, 100), "x")
    assert not (tmp_path / "t.png").exists()
    assert [m for m in log_lines if "timeline" in m][0].startswith("no step timeline picture")


def test_timeline_pictures_mark_exposed_and_idle_as_timeline_breakdown(tmp_path):
    t = timeline_breakdown(HAND, [(0, 100)])
    assert t["exposed_comm_ms"] == pytest.approx(0.032) and t["idle_ms"] == pytest.approx(0.018)
    one = draw_timeline(str(tmp_path / "t.png"), HAND, (0, 100), "hand-built")
    width, height = _check_png(tmp_path / "t.png")
    assert width > 2 * height and one["path"] == str(tmp_path / "t.png")
    _assert_ranges(one["exposed_ranges_ms"], [(0.04, 0.06), (0.085, 0.095), (0.098, 0.1)])
    _assert_ranges(one["idle_ranges_ms"], [(0.06, 0.07), (0.08, 0.085), (0.095, 0.098)])
    b_kernels = [(0, 50, "matmul"), (20, 70, "communication"), (80, 150, "inductor triton")]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, kernels, step in zip(paths, (HAND, b_kernels), ((0, 100), (0, 160))):
        path.write_text(_json_text({"step": 5, "unit": "CPU", "step_intervals": pack_step(kernels, step, 5)}))
    out = timeline_a_vs_b(str(tmp_path / "ab.png"), *map(str, paths), ("pass off", "pass on"))
    assert _check_png(tmp_path / "ab.png", min_size=(800, 400)) and out["path"] == str(tmp_path / "ab.png")
    for drawn, kernels, step in ((one, HAND, (0, 100)), (out["A"], HAND, (0, 100)), (out["B"], b_kernels, (0, 160))):
        t = timeline_breakdown(kernels, [step])
        assert [drawn[k] for k in SUM_KEYS] == pytest.approx([t[k] for k in SUM_KEYS])
    _assert_ranges(out["A"]["idle_ranges_ms"], one["idle_ranges_ms"])
    _assert_ranges(out["B"]["exposed_ranges_ms"], [(0.05, 0.07)])
    (tmp_path / "old.json").write_text(json.dumps({"step": 5, "categories": {}}))  # profiled before step_intervals
    with pytest.raises(ValueError, match="no step intervals"):
        read_step(str(tmp_path / "old.json"))
    with pytest.raises(ValueError):
        timeline_a_vs_b(str(tmp_path / "x.png"), str(paths[0]), str(tmp_path / "old.json"))
    assert not (tmp_path / "x.png").exists()


def test_collectives_by_kind_dtype_and_stream_with_their_exposed_time():
    assert [collective_label(n) for n in (
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "gloo:reduce_scatter", "c10d_symm_mem_kernel")] == [
        "ReduceScatter f32", "AllGather", "AllReduce float", "reduce_scatter", "c10d_symm_mem_kernel"]
    # 0..100 us: matmuls 0-30, 50-80; FSDP's fp32 reduce-scatter, TP's bf16 ones, all-gathers on two streams
    events = [_evt("ProfilerStep#4", 0, 100, ann=True), _evt("nvjet_a", 0, 30, "CUDA"), _evt("nvjet_b", 50, 80, "CUDA"),
              *(_evt(f"ncclDevKernel_{kind}_RING_LL", a, b, "CUDA", stream=stream) for kind, a, b, stream in [
                  ("ReduceScatter_Sum_f32", 20, 40, 1), ("ReduceScatter_Sum_bf16", 40, 45, 2),
                  ("ReduceScatter_Sum_bf16", 60, 70, 2), ("AllGather", 85, 90, 1), ("AllGather", 85, 95, 2)])]
    kernels, steps, collectives = _intervals_of(NS(events=lambda: events), on_device=True)
    got = collective_breakdown(kernels, collectives, steps)
    assert list(got) == ["AllGather (stream 2)", "ReduceScatter f32", "AllGather (stream 1)", "ReduceScatter bf16"]
    _assert_ranges([(c["ms"], c["exposed_ms"], c["launches"]) for c in got.values()],  # (ms, exposed ms, launches)
                   [(0.01, 0.01, 1), (0.02, 0.01, 1), (0.005, 0.005, 1), (0.015, 0.005, 2)])
    assert timeline_breakdown(kernels, steps)["exposed_comm_ms"] == pytest.approx(0.025)  # 30-45, 85-95: < labels' sum
    md = summary_markdown({**summarize_events([("nvjet_a", 60.0, 2)], steps=1), "collectives": got})
    assert "| ReduceScatter f32 | 0.02 | 0.01 | 1 |" in md and "exposed: while no compute kernel runs" in md


def test_idle_charged_to_the_host_or_a_queue_by_the_kernel_that_ends_it_and_named_in_markdown():
    """A gap's closing kernel launched after it began: host-late; before: queued; at the end: tail; else unknown."""
    kernels = [(0, 10, "matmul"), (20, 30, "matmul"), (35, 40, "communication"), (50, 60, "matmul"), (70, 80, "matmul")]
    launches = [(0, -5, "aten::mm"), (20, 15, "symm_mem::fused_all_gather_matmul"),  # 10-20: host-late
                (35, 25, "nccl"), (50, 30, "aten::mm")]  # 30-35, 40-50: queued; 60-70: unknown; 80-100: tail
    got, causes = idle_causes(kernels, launches, [(0, 100)]), ("host_ms", "queued_ms", "tail_ms", "unknown_ms")
    assert [got[k] for k in causes] == pytest.approx([0.01, 0.015, 0.02, 0.01])
    assert sum(got[k] for k in causes) == pytest.approx((t := timeline_breakdown(kernels, [(0, 100)]))["idle_ms"])
    assert got["by_host_op"] == pytest.approx({"symm_mem::fused_all_gather_matmul": 0.01})
    assert got["lead_ms"] == pytest.approx(0.01)  # leads 5, 5, 10, 20 us: the median
    two = idle_causes(kernels, launches, [(0, 100), (100, 200)])  # the second step idles whole: tail
    assert two["host_ms"] == pytest.approx(0.005) and two["tail_ms"] == pytest.approx(0.06)
    assert idle_causes(kernels, launches, [])["host_ms"] == 0
    md = summary_markdown({**summarize_events([("nvjet_gemm", 1000.0, 1)], 1), "timeline": t, "idle_causes": got})
    assert "| host-late: the next kernel launched after the device went idle | 0.01 |" in md
    assert "| (host-late, launched by `symm_mem::fused_all_gather_matmul`) | 0.01 |" in md
    assert "median 0.01 ms after its launch" in md


def test_launches_matched_by_correlation_id_to_the_outermost_host_op():
    """A kernel's runtime call shares its id; host ops: outermost below ProfilerStep › innermost; others left out."""
    step = _evt("ProfilerStep#10", 0, 1000)
    region = _evt("## Call CompiledFxGraph fx3k2abc ##", 10, 200, parent=step)
    launch = _evt("cuLaunchKernelEx", 20, 25, id=7, parent=_evt("aten::empty", 15, 30, parent=region))
    mm = _evt("cudaLaunchKernel", 300, 305, id=8, parent=_evt("aten::mm", 290, 310))
    events = [step, region, launch, mm, _evt("triton_poi_fused_0", 40, 50, "CUDA", id=7),
              _evt("nvjet_gemm", 320, 400, "CUDA", id=8), _evt("other_kernel", 500, 600, "CUDA", id=9),
              _evt("nccl:all_gather", 40, 50, "CUDA", ann=True, id=7)]
    assert _launches_of(events) == [(40, 20, "## Call CompiledFxGraph ## › aten::empty"), (320, 300, "aten::mm")]
