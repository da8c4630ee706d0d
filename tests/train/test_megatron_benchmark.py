"""The profiled step's summary (rltool.profile.torch_trace, what benchmarks/train_megatron.py
records): device busy time, host gaps, kernel kinds and the limit named from a chrome trace
(synthetic events with known intervals), and the host syncs by call site."""

from __future__ import annotations

import warnings

import pytest

from rltool.profile.torch_trace import kernel_kind, profiled, sync_sites, trace_summary


def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


GEMM = "nvjet_sm90_tst_128x232_64x4_1x2_h_bz_coopA_NNT"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"


def test_busy_time_is_the_union_over_streams_and_gaps_are_device_idle():
    events = [
        kernel(GEMM, 0, 100),                      # 0-100
        kernel(ADD, 50, 100),                      # 50-150, overlaps on another stream
        kernel("Memcpy HtoD", 400, 50, cat="gpu_memcpy"),  # idle 150-400 before it
        kernel(GEMM, 460, 40),                     # idle 450-460 (short gap)
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 900},  # host: ignored
    ]
    s = trace_summary(events, step_s=1000e-6, gap_us=50)
    assert s["device_busy_s"] == pytest.approx(240e-6)      # 150 + 50 + 40
    assert s["gpu_busy_fraction"] == pytest.approx(0.24)
    assert s["device_events"] == 4 and s["device_span_s"] == pytest.approx(500e-6)
    gaps = s["host_gaps"]
    assert gaps["count"] == 2 and gaps["idle_s"] == pytest.approx(260e-6)
    assert gaps["count_over_50us"] == 1 and gaps["idle_over_50us_s"] == pytest.approx(250e-6)
    assert gaps["largest"] == [{"ms": pytest.approx(0.25), "before": "Memcpy HtoD"}]
    assert s["device_s_by_kind"] == pytest.approx({"gemm": 140e-6, "elementwise": 100e-6,
                                                   "memcpy": 50e-6})
    assert [k["name"] for k in s["top_kernels"]] == [GEMM, ADD[:100], "Memcpy HtoD"]
    assert s["top_kernels"][0]["calls"] == 2
    assert s["limit"] == "device idle (76% of the step)"


def test_a_busy_device_names_its_largest_kernel_kind():
    events = [kernel(GEMM, 0, 700), kernel("pytorch_flash::flash_fwd_kernel<Flash_fwd>", 700, 250)]
    assert trace_summary(events, step_s=1e-3)["limit"] == "gemm (70% of the step)"


def test_kernel_kinds_read_the_name_before_template_arguments():
    assert kernel_kind("void at::native::reduce_kernel<512, 1, ReduceOp<float, NormTwoOps>>",
                       "kernel") == "reduction"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, gemm_like_functor>",
                       "kernel") == "elementwise"
    assert kernel_kind("void (anonymous namespace)::softmax_warp_forward<float>",
                       "kernel") == "softmax"
    assert kernel_kind("Memset (Device)", "gpu_memset") == "memset"
    assert kernel_kind("some_custom_kernel", "kernel") == "other"


def test_the_engines_triton_kernels_have_their_kinds():
    kinds = {"_stage1": "attention", "_stage2": "attention", "_partial": "sampling",
             "_combine": "sampling", "_decode": "linear attention",
             "_gated_norm": "linear attention", "_chunk_state": "linear attention",
             "_rope_store": "rope and kv store", "_w4a16": "gemm", "block_fp8_gemm": "gemm",
             "_matmul": "gemm", "_add_rms_norm": "reduction", "_silu_mul": "elementwise",
             "quantize_rows": "elementwise"}
    assert {name: kernel_kind(name, "kernel") for name in kinds} == kinds


def test_profiled_runs_the_call_once_and_names_its_host_operators(tmp_path):
    import torch

    calls = []
    summary = profiled(lambda: calls.append(torch.ones(64, 64) @ torch.ones(64, 64)),
                       table=tmp_path / "ops.txt")
    assert len(calls) == 1 and summary["profiled_s"] > 0
    assert "aten::mm" in [op["name"] for op in summary["host_top_ops"]]
    assert "aten::mm" in (tmp_path / "ops.txt").read_text()
    assert summary["table"] == str(tmp_path / "ops.txt")


def test_sync_sites_count_the_sync_warnings_by_the_line_that_made_them():
    def warning(message: str, filename: str, lineno: int) -> warnings.WarningMessage:
        return warnings.WarningMessage(UserWarning(message), UserWarning, filename, lineno)

    sync = "called a synchronizing CUDA operation"
    caught = [warning(sync, "/x/megatron/core/optimizer/clip_grads.py", 190),
              warning(sync, "/x/rltool/train/packed.py", 7),
              warning(sync, "/x/rltool/train/packed.py", 7),
              warning("some other warning", "/x/rltool/train/packed.py", 9)]
    assert sync_sites(caught) == {"count": 3, "sites": [
        {"at": "train/packed.py:7", "calls": 2},
        {"at": "optimizer/clip_grads.py:190", "calls": 1}]}
    assert sync_sites([]) == {"count": 0, "sites": []}
