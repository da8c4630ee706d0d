"""`benchmarks/engine_gpu.py --precision fp8`: FP8 weights and FP8 KV against bf16 on one GPU.

Workload (a) of engine_gpu.py (B concurrent requests of 128-token prompts, 256 output tokens each,
in process) on three fresh engines over the same random-init checkpoint: its bf16 weights, its
block-FP8 version (`rltool convert fp8`, 128x128 blocks; the engine keeps the linears in FP8 and
runs them through rltool.engine.fp8_gemm), and FP8 weights with `--kv-cache-dtype fp8_e4m3`.
Reports tokens/s of each and the ratio to bf16, what each engine holds (weight bytes, weight
precision, KV bytes per token, pool tokens), and the TFLOP/s of the block-FP8 GEMM and of bf16
F.linear at the model's four linear shapes for 256 and 8192 tokens (CUDA events, 20 calls).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from engine_gpu import in_process, random_checkpoint


def gemm_rates(spec, tokens: tuple[int, ...] = (256, 8192)) -> list[dict]:
    """TFLOP/s of the block-FP8 GEMM and of bf16 F.linear at the model's linear shapes."""
    from rltool.engine.fp8_gemm import fp8_linear

    q_rows = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    shapes = {"qkv": (q_rows, spec.hidden_size),
              "o": (spec.hidden_size, spec.num_heads * spec.head_dim),
              "gate_up": (2 * spec.intermediate_size, spec.hidden_size),
              "down": (spec.hidden_size, spec.intermediate_size)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = w.to(torch.float8_e4m3fn)
        scale = torch.ones(n, -(-k // 128), device="cuda")
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"gemm": name, "m": m, "n": n, "k": k}
            for kind, fn in (("bf16", lambda: torch.nn.functional.linear(x, w)),
                             ("fp8", lambda: fp8_linear(x, q, scale, block_k=128))):
                for _ in range(3):
                    fn()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                for _ in range(20):
                    fn()
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 20 / 1e3
                row[f"{kind}_tflops"] = 2 * m * n * k / seconds / 1e12
            rows.append(row)
    return rows


def precision_cost(preset: str, batches: list[int]) -> dict:
    """The three engines' workload (a), and the GEMM rates."""
    from rltool.convert.fp8 import Fp8Config, quantize_checkpoint
    from rltool.engine.dense_model import read_spec

    model_dir = random_checkpoint(Path(tempfile.mkdtemp()) / preset, preset)
    fp8_dir = model_dir.parent / f"{preset}-fp8"
    quantize_checkpoint(Fp8Config(hf=model_dir, out=fp8_dir, workers=8))
    modes = {"bf16": (model_dir, "auto"), "fp8": (fp8_dir, "auto"),
             "fp8+fp8kv": (fp8_dir, "fp8_e4m3")}
    out: dict = {mode: in_process(d, batches, kv_cache_dtype=kv)
                 for mode, (d, kv) in modes.items()}
    out["gemm"] = gemm_rates(read_spec(model_dir))
    for b in batches:
        base = out["bf16"][b]["tokens_per_s"]
        print(f"{preset:14} B={b:>4}: " + ", ".join(
            f"{m} {out[m][b]['tokens_per_s']:>8.0f} tok/s ({out[m][b]['tokens_per_s'] / base:.2f}x)"
            for m in modes), flush=True)
    for m in modes:
        print(f"{preset:14} {m}: {out[m]['engine']}", flush=True)
    for row in out["gemm"]:
        print(f"{preset:14} GEMM {row['gemm']:8} m={row['m']:>5} n={row['n']:>6} "
              f"k={row['k']:>5}: bf16 {row['bf16_tflops']:6.1f} TFLOP/s, fp8 "
              f"{row['fp8_tflops']:6.1f} TFLOP/s", flush=True)
    return out
