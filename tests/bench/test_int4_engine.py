"""benchmarks/engine_int4.py (mode int4 of benchmarks/engine_gpu.py) without a GPU: the bytes
arithmetic behind its decode bounds and GEMM rates against hand counts of the 7B and MoE shapes,
the table's assembly, and the mode's refusal on the CPU. The measured rows need a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.engine_fp8 import preset_spec
from benchmarks.engine_int4 import (decode_bound, decode_step_bytes, gemm_bytes, gemm_row, table,
                                    weight_bytes)

ROOT = Path(__file__).resolve().parents[2]
# Qwen2.5-7B: hidden, intermediate, layers, heads, kv heads, head dim, vocab
H, I, L, NH, KV, D, V = 3584, 18944, 28, 28, 4, 128, 152064


def test_weight_bytes_per_precision():
    assert weight_bytes(4096, 4096, "bf16") == 2 * 4096 * 4096
    # FP8: a byte per entry, a float32 scale per row and 128-column block (a partial one too)
    assert weight_bytes(10, 300, "fp8") == 10 * 300 + 4 * 10 * 3
    # INT4, groups of 32: half a byte per entry, a float32 scale per row and group
    assert weight_bytes(64, 3584, "int4") == 64 * 3584 // 2 + 4 * 64 * (3584 // 32)
    assert weight_bytes(64, 3584, "int4", group_size=128) == 64 * 3584 // 2 + 4 * 64 * 28
    assert gemm_bytes(8, 64, 3584, "int4") == weight_bytes(64, 3584, "int4") + 2 * 8 * 3584 + \
        2 * 8 * 64
    with pytest.raises(ValueError, match="unknown precision"):
        weight_bytes(8, 8, "int8")


def _reference_7b(batch: int, context: int, bytes_per_weight: float) -> float:
    """A decode step's bytes counted by hand: the 28 layers' linears at `bytes_per_weight`,
    lm_head in bf16, embedding rows, bf16 KV (read + the new token), bf16 logits."""
    per_layer = (NH + 2 * KV) * D * H + H * NH * D + 2 * I * H + H * I
    kv_per_token = 2 * L * KV * D * 2
    return (L * per_layer * bytes_per_weight + 2.0 * V * H + batch * H * 2
            + batch * (context + 1) * kv_per_token + batch * V * 2)


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_bound_of_the_7b_against_a_hand_count(batch):
    spec = preset_spec("qwen2.5-7b")
    bf16 = _reference_7b(batch, 256, 2.0)
    int4 = _reference_7b(batch, 256, 0.5 + 4 / 32)  # every K a multiple of 32
    assert decode_step_bytes(spec, batch=batch, context=256, precision="bf16") == bf16
    assert decode_step_bytes(spec, batch=batch, context=256, precision="int4") == int4
    assert decode_bound(spec, batch, "int4") == pytest.approx(bf16 / int4, rel=1e-12)
    assert decode_bound(spec, batch, "bf16") == 1.0
    # INT4 reads fewer bytes than FP8, and the larger batch's KV shrinks both bounds
    assert decode_bound(spec, batch, "int4") > decode_bound(spec, batch, "fp8") > 1.5
    assert decode_bound(spec, 64, "int4") < decode_bound(spec, 1, "int4")


def test_moe_step_reads_the_routed_experts_and_keeps_attention_bf16_for_int4(tmp_path):
    from rltool.data.models import build_config
    from rltool.engine.model_spec import read_spec

    config = build_config("qwen3_moe", "small", vocab_size=1024, eos_token_id=0, pad_token_id=0)
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(str(tmp_path))
    spec = read_spec(tmp_path)
    h, layers, e_inter, vocab = 256, 4, 384, 1024  # the small preset, 4 experts of 768 / 2
    attn = (8 + 2 * 4) * 32 * h + h * 8 * 32
    expert = 2 * e_inter * h + h * e_inter
    fixed = 2 * vocab * h + 2 * 4 * h * layers  # lm_head and the routers, bf16

    def reference(batch: int, experts: int, attn_bytes: float, expert_bytes: float) -> float:
        kv = batch * 257 * 2 * layers * 4 * 32 * 2
        return (layers * (attn * attn_bytes + experts * expert * expert_bytes) + fixed
                + batch * h * 2 + kv + batch * vocab * 2)

    int4 = 0.5 + 4 / 32
    # B = 1 routes to top_k = 2 experts a layer; B = 2 already to all 4
    assert decode_step_bytes(spec, batch=1, context=256, precision="int4") == reference(
        1, 2, 2.0, int4)
    assert decode_step_bytes(spec, batch=64, context=256, precision="int4") == reference(
        64, 4, 2.0, int4)
    assert decode_step_bytes(spec, batch=64, context=256, precision="bf16") == reference(
        64, 4, 2.0, 2.0)


def test_gemm_row_rates():
    row = gemm_row("down", 64, 3584, 18944, bf16_s=2e-4, int4_s=5e-5)
    assert row["int4_speedup"] == pytest.approx(4.0)
    assert row["bf16_tflops"] == pytest.approx(2 * 64 * 3584 * 18944 / 2e-4 / 1e12)
    assert row["int4_GBps"] == pytest.approx(gemm_bytes(64, 3584, 18944, "int4") / 5e-5 / 1e9)


def test_table_rows_ratios_to_bf16():
    def run(tok_s: float, bound: float) -> dict:
        return {"tokens_per_s": tok_s, "decode_bound": bound}

    results = {"qwen2.5-7b": {"bf16": {1: run(100.0, 1.0), 64: run(3000.0, 1.0)},
                              "fp8": {1: run(150.0, 1.8), 64: run(3900.0, 1.7)},
                              "int4": {1: run(200.0, 2.7), 64: run(4500.0, 2.5)}},
               "moe": {"bf16": {64: run(1000.0, 1.0)}, "fp8": {64: run(1500.0, 1.8)},
                       "int4": {64: run(1400.0, 2.9)}}}
    rows = table(results, {"qwen2.5-7b": [1, 64], "moe": [64]})
    assert [(r["model"], r["batch"]) for r in rows] == [("qwen2.5-7b", 1), ("qwen2.5-7b", 64),
                                                         ("moe", 64)]
    assert rows[0]["int4_vs_bf16"] == 2.0 and rows[1]["fp8_vs_bf16"] == 1.3
    assert rows[2]["int4_vs_bf16"] == 1.4 and rows[2]["int4_bound"] == 2.9
    assert rows[2]["bf16_vs_bf16"] == 1.0


def test_mode_int4_is_refused_without_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.engine_gpu", "--mode", "int4",
                           "--device", "cpu", "--gemm-only"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--device cpu runs mode rl and long-context --quick only; mode int4 needs a GPU")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemm_rates_of_one_shape_on_the_gpu():
    """The GEMM-rate path as `--mode int4 --gemm-only` runs it, on one small shape."""
    from benchmarks.engine_int4 import shape_rates

    rows = shape_rates("down", n=256, k=512, tokens=(1, 16))
    assert [(r["m"], r["n"], r["k"]) for r in rows] == [(1, 256, 512), (16, 256, 512)]
    for r in rows:
        assert r["bf16_tflops"] > 0 and r["int4_tflops"] > 0 and r["int4_speedup"] > 0
