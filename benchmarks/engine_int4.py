"""INT4 W4A16 weights against bf16 and block-FP8 on one GPU: the mode `int4` of
benchmarks/engine_gpu.py.

`python -m benchmarks.engine_gpu --mode int4 [--presets qwen2.5-7b] [--moe-preset qwen2.5-3b]
[--batches 1,64] [--moe-batches 64] [--gemm-only | --engines-only]`:

Engines: workload (a) of engine_gpu.py (B concurrent requests of 128-token prompts, 256 output
tokens each, in process, after an untimed warm-up) on three fresh engines over one random-init
checkpoint per model: its bf16 weights, its `rltool convert fp8` version (128x128 blocks) and its
`rltool convert int4` version (the converter's defaults: W4A16, groups of 32, symmetric; a dense
model keeps only lm_head in bf16, a MoE model quantizes only its routed experts, slime's list).
The engine keeps the quantized linears resident (rltool.engine.fp8_gemm, rltool.engine.int4_gemm).
The dense models are the qwen2 `--presets` at `--batches`; the MoE model is qwen3_moe with
`--moe-preset`'s shapes (4 experts of half the intermediate width, top-2; empty: none) at
`--moe-batches`. Reported per model and batch: tokens/s, the ratio to bf16, the engine's weight
bytes, and the decode-step bytes bound on that ratio (`decode_bound`: a bf16 decode step's
bytes over a quantized one's: weights the step reads plus KV plus logits; the expert weights a
MoE step at B reads are all of them once B x top-k >= E).

GEMM rates (`--gemm-only`: these alone, under a minute, no checkpoint written): at the dense
preset's four linear shapes (qkv, o, gate_up, down) for 1, 16, 64 and 256 tokens, bf16
F.linear against the INT4 Triton GEMM on symmetric groups of 32 (rltool.engine.int4_gemm), GPU
time of 20 calls replayed from a CUDA graph (benchmarks/engine_fp8.py's `graph_seconds`): TFLOP/s,
GB/s of the bytes each moves (weight, its scales, activations, output) and the INT4/bf16 speedup.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from benchmarks.engine_common import copy_bandwidth
from benchmarks.engine_fp8 import engines, graph_seconds, linear_shapes, preset_spec

GROUP_SIZE = 32  # rltool convert int4's default
GEMM_TOKENS = (1, 16, 64, 256)
PRECISIONS = ("bf16", "fp8", "int4")


def weight_bytes(n: int, k: int, precision: str, *, group_size: int = GROUP_SIZE) -> int:
    """Bytes an [n, k] linear weight takes resident in the engine: bf16 2 per entry; block-FP8 1
    per entry plus a float32 scale per row and 128-column block; INT4 (symmetric) half a byte
    per entry plus a float32 scale per row and group."""
    if precision == "bf16":
        return 2 * n * k
    if precision == "fp8":
        return n * k + 4 * n * -(-k // 128)
    if precision == "int4":
        return n * k // 2 + 4 * n * (k // group_size)
    raise ValueError(f"unknown precision {precision!r}")


def gemm_bytes(m: int, n: int, k: int, precision: str, *, group_size: int = GROUP_SIZE) -> int:
    """Bytes one [m, k] x [n, k]^T GEMM moves: the weight as held, bf16 activations and output."""
    return weight_bytes(n, k, precision, group_size=group_size) + 2 * m * k + 2 * m * n


def decode_step_bytes(spec, *, batch: int, context: int, precision: str) -> int:
    """Bytes one decode step at `batch` sequences of `context` tokens reads and writes, with the
    converters' defaults in `precision`: every linear weight but lm_head (and a MoE router) is
    quantized, except that INT4 keeps a MoE model's attention in bf16 (slime's list); plus the
    embedding rows looked up, the KV read and the new token's written, the logits written. A
    sparse layer reads the experts the step routes to: all E of them once batch x top_k >= E."""
    hidden, moe = spec.hidden_size, spec.moe
    q_rows = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    attn = [(q_rows, hidden), (hidden, spec.num_heads * spec.head_dim)]
    attn_prec = "bf16" if moe is not None and precision == "int4" else precision
    dense_mlp = [(2 * spec.intermediate_size, hidden), (hidden, spec.intermediate_size)]
    total = 0
    for layer in range(spec.num_layers):
        total += sum(weight_bytes(n, k, attn_prec) for n, k in attn)
        if moe is not None and layer in moe.sparse_layers:
            active = min(moe.num_experts, batch * moe.top_k)
            experts = [(2 * moe.intermediate_size, hidden), (hidden, moe.intermediate_size)]
            total += active * sum(weight_bytes(n, k, precision) for n, k in experts)
            total += 2 * moe.num_experts * hidden  # the router, bf16
        else:
            total += sum(weight_bytes(n, k, precision) for n, k in dense_mlp)
    kv_tok = spec.kv_bytes_per_token * 2  # bf16 cache
    return (total + 2 * spec.vocab_size * hidden + batch * hidden * 2
            + batch * (context + 1) * kv_tok + batch * spec.vocab_size * 2)


def decode_bound(spec, batch: int, precision: str, *, context: int = 256) -> float:
    """The bf16 decode step's bytes over `precision`'s: the speedup a bandwidth-bound decode
    step can get from the weights alone (context: the mid-run context of workload (a))."""
    return (decode_step_bytes(spec, batch=batch, context=context, precision="bf16")
            / decode_step_bytes(spec, batch=batch, context=context, precision=precision))


def gemm_row(name: str, m: int, n: int, k: int, bf16_s: float, int4_s: float) -> dict:
    """One GEMM-rate row from the two kernels' seconds per call."""
    flops = 2 * m * n * k
    return {"gemm": name, "m": m, "n": n, "k": k,
            "bf16_tflops": flops / bf16_s / 1e12,
            "bf16_GBps": gemm_bytes(m, n, k, "bf16") / bf16_s / 1e9,
            "int4_tflops": flops / int4_s / 1e12,
            "int4_GBps": gemm_bytes(m, n, k, "int4") / int4_s / 1e9,
            "int4_speedup": bf16_s / int4_s}


def gemm_rates(spec, tokens: tuple[int, ...] = GEMM_TOKENS) -> list[dict]:
    """bf16 F.linear against the INT4 Triton GEMM at the model's linear shapes."""
    rows = []
    for name, (n, k) in linear_shapes(spec).items():
        rows += shape_rates(name, n=n, k=k, tokens=tokens)
        torch.cuda.empty_cache()
    return rows


def shape_rates(name: str, *, n: int, k: int, tokens: tuple[int, ...]) -> list[dict]:
    """gemm_rates' rows for one [n, k] weight (its tensors freed when this returns)."""
    from rltool.convert.int4 import quantize_int4
    from rltool.engine.int4_gemm import int4_linear
    from rltool.engine.int4_weight import Int4Weight

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q = quantize_int4(w, group_size=GROUP_SIZE, symmetric=True, scale_dtype=torch.float32)
    w4 = Int4Weight(q.packed.contiguous(), q.scale.contiguous(), None, GROUP_SIZE)
    rows = []
    for m in tokens:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        rows.append(gemm_row(name, m, n, k,
                             graph_seconds(lambda: torch.nn.functional.linear(x, w)),
                             graph_seconds(lambda: int4_linear(x, w4))))
        r = rows[-1]
        print(f"GEMM {name:8} m={m:>4} n={n:>6} k={k:>5}: bf16 {r['bf16_tflops']:6.1f} "
              f"TFLOP/s {r['bf16_GBps']:6.0f} GB/s, int4 {r['int4_tflops']:6.1f} TFLOP/s "
              f"{r['int4_GBps']:6.0f} GB/s ({r['int4_speedup']:.2f}x)", flush=True)
    return rows


def model_checkpoints(arch: str, preset: str) -> dict[str, Path]:
    """A random-init bf16 checkpoint of (arch, preset), drawn on the GPU, and its `rltool
    convert fp8` and `rltool convert int4` versions (converters' defaults)."""
    from rltool.convert.fp8 import Fp8Config
    from rltool.convert.fp8 import quantize_checkpoint as to_fp8
    from rltool.convert.int4 import Int4Config
    from rltool.convert.int4 import quantize_checkpoint as to_int4
    from rltool.data.models import init_model

    root = Path(tempfile.mkdtemp())
    bf16 = init_model(root / "bf16", arch=arch, preset=preset, dtype="bf16", device="cuda")
    to_fp8(Fp8Config(hf=bf16, out=root / "fp8", workers=8))
    to_int4(Int4Config(hf=bf16, out=root / "int4", workers=8))
    return {"bf16": bf16, "fp8": root / "fp8", "int4": root / "int4"}


def model_rows(label: str, arch: str, preset: str, batches: list[int]) -> dict:
    """Workload (a) on the bf16, fp8 and int4 engines of one model, with the decode bounds."""
    from rltool.engine.model_spec import read_spec

    dirs = model_checkpoints(arch, preset)
    try:
        out = engines(label, batches, {p: (dirs[p], "auto", "auto") for p in PRECISIONS})
        spec = read_spec(dirs["bf16"])
    finally:  # the three checkpoints of a 7B take ~29 GB of disk
        shutil.rmtree(dirs["bf16"].parent)
    for p in PRECISIONS:
        for b in batches:
            out[p][b]["decode_bound"] = decode_bound(spec, b, p)
    return out


def table(results: dict[str, dict], batches_of: dict[str, list[int]]) -> list[dict]:
    """One row per model and batch: each precision's tokens/s, its ratio to bf16 and the
    decode-step bytes bound on that ratio."""
    rows = []
    for label, out in results.items():
        for b in batches_of[label]:
            row: dict = {"model": label, "batch": b}
            for p in PRECISIONS:
                r = out[p][b]
                row[f"{p}_tokens_per_s"] = r["tokens_per_s"]
                row[f"{p}_vs_bf16"] = r["tokens_per_s"] / out["bf16"][b]["tokens_per_s"]
                row[f"{p}_bound"] = r["decode_bound"]
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':22} {'B':>4} {'bf16 tok/s':>11} {'fp8 tok/s':>10} {'fp8/bf16':>8} "
          f"{'bound':>6} {'int4 tok/s':>11} {'int4/bf16':>9} {'bound':>6}")
    for r in rows:
        print(f"{r['model']:22} {r['batch']:>4} {r['bf16_tokens_per_s']:>11.0f} "
              f"{r['fp8_tokens_per_s']:>10.0f} {r['fp8_vs_bf16']:>7.2f}x {r['fp8_bound']:>5.2f}x "
              f"{r['int4_tokens_per_s']:>11.0f} {r['int4_vs_bf16']:>8.2f}x "
              f"{r['int4_bound']:>5.2f}x", flush=True)


def int4_mode(*, preset: str, moe_preset: str, batches: list[int], moe_batches: list[int],
              gemm_only: bool, engines_only: bool) -> dict:
    """Mode int4: unless engines_only the GEMM rates at the dense `preset`'s shapes (the 7B's
    when it is empty), then unless gemm_only the three engines of the dense qwen2 `preset` at
    `batches` and of the qwen3_moe `moe_preset` at `moe_batches` (either empty: skipped), and
    one table."""
    out: dict = {"copy_bandwidth_Bps": copy_bandwidth(), "group_size": GROUP_SIZE}
    if not engines_only:
        out["gemm"] = gemm_rates(preset_spec(preset or "qwen2.5-7b"))
    if gemm_only:
        return out
    results, batches_of = {}, {}
    if preset:
        results[preset], batches_of[preset] = model_rows(preset, "qwen2", preset, batches), batches
    if moe_preset:
        label = f"qwen3_moe-{moe_preset}"
        results[label] = model_rows(label, "qwen3_moe", moe_preset, moe_batches)
        batches_of[label] = moe_batches
    out["engines"] = results
    out["table"] = table(results, batches_of)
    print_table(out["table"])
    return out
