"""--profiling.enable_profiling: trace + kernel-time summary (graph_trainer/profiling.py)."""

import json

import pytest
import torch

from graph_trainer.profiling import kernel_category, summarize_events, summary_markdown


@pytest.mark.parametrize(
    "name, category",
    [
        ("nvjet_tst_256x128_64x4_1x2_h_bz_coopB_TNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", "attention"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("triton_red_fused__fused_rms_norm_backward_0", "inductor triton"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "eager pointwise / reduction"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float4, 128>", "copy"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("aten::mm", "matmul"),
        ("aten::view", "view / metadata (CPU)"),
        ("some_custom_kernel", "other"),
    ],
)
def test_kernel_category(name, category):
    assert kernel_category(name) == category


def test_summarize_events_per_step_and_shares():
    events = [("nvjet_gemm", 6000.0, 30), ("triton_poi_fused_add_0", 2000.0, 20), ("ncclDevKernel_AllGather", 2000.0, 4),
              ("aten::idle_zero", 0.0, 1)]
    s = summarize_events(events, steps=2, top=2)
    assert s["steps"] == 2 and s["total_ms"] == pytest.approx(5.0)  # 10 ms over 2 steps
    cats = s["categories"]
    assert list(cats)[0] == "matmul" and cats["matmul"]["ms"] == pytest.approx(3.0)
    assert cats["matmul"]["calls"] == 15 and cats["communication"]["share"] == pytest.approx(0.2)
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert [r["name"] for r in s["top"]] == ["nvjet_gemm", "triton_poi_fused_add_0"]
    md = summary_markdown(s)
    assert "| matmul | 3.00 | 60.0 % | 15 |" in md and "`nvjet_gemm`" in md


def test_profiled_run_writes_trace_and_summary(tmp_path):
    """2 CPU steps, the second recorded: a Chrome trace and a summary whose matmul time is > 0."""
    from graph_trainer.config import parse_args
    from graph_trainer.train import train
    from test_train import DEBUG, TINY

    out = tmp_path / "prof"
    cfg = parse_args(["--job.config_file", DEBUG, "--job.dump_folder", str(out), *TINY, "--training.steps", "2",
                      "--profiling.enable_profiling", "--profiling.profile_freq", "2",
                      "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1"])
    train(cfg)
    folder = out / "profile_traces" / "iteration_2"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_kernels.json", "rank0_kernels.md", "rank0_trace.json"]
    summary = json.loads((folder / "rank0_kernels.json").read_text())
    assert summary["unit"] == "CPU" and summary["step"] == 2
    assert summary["categories"]["matmul"]["ms"] > 0 and summary["categories"]["matmul"]["calls"] > 0
    t = summary["timeline"]  # on CPU: ATen op time inside the recorded step
    assert 0 < t["compute_ms"] <= t["wall_ms"] and t["idle_ms"] >= 0
    assert json.loads((folder / "rank0_trace.json").read_text())["traceEvents"]


def test_timeline_breakdown_splits_wall_into_compute_exposed_comm_and_idle():
    from graph_trainer.profiling import timeline_breakdown
    # step 1 (0..100 us): gemm 0-40, comm 30-60 (10 overlapped, 20 exposed), triton 70-80, idle 20 us
    # step 2 (100..200 us): gemm 100-200, comm 120-140 fully overlapped; a kernel past the step is clipped
    kernels = [(0, 40, "matmul"), (30, 60, "communication"), (70, 80, "inductor triton"),
               (100, 200, "matmul"), (120, 140, "communication"), (190, 250, "copy")]
    t = timeline_breakdown(kernels, [(0, 100), (100, 200)])
    assert t["wall_ms"] == pytest.approx(0.1)
    assert t["compute_ms"] == pytest.approx((50 + 100) / 2 / 1e3)
    assert t["comm_ms"] == pytest.approx((30 + 20) / 2 / 1e3)
    assert t["exposed_comm_ms"] == pytest.approx(20 / 2 / 1e3)
    assert t["idle_ms"] == pytest.approx(30 / 2 / 1e3)
    assert t["compute_ms"] + t["exposed_comm_ms"] + t["idle_ms"] == pytest.approx(t["wall_ms"])
    assert t["exposed_tail_ms"] == pytest.approx(20 / 2 / 1e3) and t["exposed_head_ms"] == 0  # after step 1's gemm
    assert timeline_breakdown(kernels, [])["wall_ms"] == 0
    # exposed before the first matmul (0-10), between matmuls (30-35), after the last one (60-70)
    t2 = timeline_breakdown([(0, 10, "communication"), (10, 30, "matmul"), (30, 35, "communication"),
                            (35, 60, "matmul"), (55, 70, "communication")], [(0, 70)])
    assert (t2["exposed_head_ms"], t2["exposed_comm_ms"], t2["exposed_tail_ms"]) == pytest.approx((0.01, 0.025, 0.01))
    s = summarize_events([("nvjet_gemm", 150.0, 2)], steps=2)
    s["timeline"] = t
    md = summary_markdown(s)
    assert "| only communication running | 0.01 | 10.0 % |" in md and "| nothing running | 0.01 | 15.0 % |" in md
    assert "| (of it: after the last matmul) | 0.01 | 10.0 % |" in md


def test_timeline_of_device_events_one_window_per_step_no_annotations():
    """On CUDA the profiler lists a step twice (host range + GPU annotation) and NCCL /
    optimizer ranges as GPU annotations: one window per step, annotations are not kernels."""
    from types import SimpleNamespace as NS

    from graph_trainer.profiling import _timeline_of

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def evt(name, a, b, dev, ann=False):
        return NS(name=name, time_range=NS(start=a, end=b), device_type=dev, is_user_annotation=ann)

    events = [
        evt("ProfilerStep#10", 0, 1000, cpu, ann=True),
        evt("ProfilerStep*", 100, 900, cuda, ann=True),  # the GPU-side range of the same step
        evt("nccl:all_gather", 100, 400, cuda, ann=True),
        evt("nvjet_gemm", 200, 600, cuda),
        evt("ncclDevKernel_AllGather", 100, 400, cuda),
    ]
    t = _timeline_of(NS(events=lambda: events), on_device=True)
    assert t["wall_ms"] == pytest.approx(1.0)  # one window, the host step
    assert t["compute_ms"] == pytest.approx(0.4) and t["exposed_comm_ms"] == pytest.approx(0.1)
    assert t["idle_ms"] == pytest.approx(0.5)
