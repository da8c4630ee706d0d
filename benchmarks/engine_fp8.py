"""FP8 weights against bf16 on one GPU: the modes `fp8` and `fp8-quick` of benchmarks/engine_gpu.py.

Full (`python -m benchmarks.engine_gpu --mode fp8`, or `--precision fp8`): workload (a) of
engine_gpu.py (B concurrent requests of 128-token prompts, 256 output tokens each, in process)
on three fresh engines over the same
random-init checkpoint: its bf16 weights, its block-FP8 version (`rltool convert fp8`, 128x128
blocks; the engine keeps the linears in FP8 and runs them through rltool.engine.fp8_gemm), and FP8
weights with `--kv-cache-dtype fp8_e4m3`; then the GEMM rates below.

Quick (`python -m benchmarks.engine_gpu --mode fp8-quick [--preset qwen2.5-7b]`, a few minutes
for the 7B shapes, most of it writing and converting the checkpoint): the GEMM rates, then workload (a) on bf16 weights and on FP8
weights as served (`fp8`: the GEMM `auto`, torch._scaled_mm where its probe passes); the
quantization kernels' fused-against-separate cost is in the kernel rates. `--gemm-only`: the
GEMM rates alone (under a minute, no checkpoint written); `--engines-only`: without the GEMM rates.

GEMM rates: at the model's four linear shapes (qkv, o, gate_up, down) for 1, 64, 256 and 8192
tokens, bf16 F.linear, the Triton FP8 GEMM, the native one (null where torch has no 1x128 block
scaling), both also on activations already quantized (`_prequantized`: as the engine runs its
FP8 projections, whose inputs the RMSNorm, SiLU-and-multiply or decode attention kernel writes
quantized) and torch._scaled_mm with the weight's 128x128 block scales (not used by the engine),
each call but the prequantized ones including its activation quantization; then the kernels
before an FP8 linear with the quantization separate and fused into them (decode attention before
o_proj at the model's heads, 1000-token sequences). GPU time of 20 calls replayed from a
CUDA graph (as the engine's decode runs them, without host launch cost). Reported: TFLOP/s, and
GB/s of the bytes each moves (weight, its scales, activations, output) beside the measured
device copy bandwidth (bytes read + written per second). Engines report tokens/s, the ratio to
bf16, and weight GB/s (weight bytes x decode steps / seconds: a lower bound of what decode reads).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.engine_common import checkpoints, copy_bandwidth, in_process

TOKENS = (1, 64, 256, 8192)


def linear_shapes(spec) -> dict[str, tuple[int, int]]:
    """(N, K) of the model's four linears."""
    q_rows = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    return {"qkv": (q_rows, spec.hidden_size),
            "o": (spec.hidden_size, spec.num_heads * spec.head_dim),
            "gate_up": (2 * spec.intermediate_size, spec.hidden_size),
            "down": (spec.hidden_size, spec.intermediate_size)}


def graph_seconds(fn, calls: int = 20) -> float:
    """GPU seconds per call of `fn`, replayed from a CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    harness.sync()
    return start.elapsed_time(end) / 5 / calls / 1e3


def native_block_weight(x, q, block_scale):
    """torch._scaled_mm with the weight's 128x128 block scales as they are stored ([N / 128,
    K / 128], one per block) and 1x128 activation scales: the pairing DeepSeek-V3 uses, which
    the engine does not (its per-row scales need no 128-row alignment of fused projections);
    measured beside it to see what the other cuBLAS recipe would gain."""
    from rltool.engine.fp8_gemm import activations

    act = activations(x, 128)  # padded as native_linear takes them
    return torch._scaled_mm(act.q, q.t(), scale_a=act.s.t(), scale_b=block_scale.t(),
                            out_dtype=x.dtype)[:act.m]


KINDS = ("bf16", "triton", "triton_prequantized", "native", "native_prequantized",
         "native_128x128")


def gemm_rates(spec, tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    """TFLOP/s and GB/s of bf16 F.linear and of the FP8 GEMMs at the model's linear shapes
    (null where torch refuses one, or where native_128x128 disagrees with the Triton kernel)."""
    from rltool.engine import fp8_gemm

    native = fp8_gemm.probe_native(torch.device("cuda"))
    rows = []
    for name, (n, k) in linear_shapes(spec).items():
        rows += shape_rates(name, n=n, k=k, tokens=tokens, native=native)
    torch.cuda.empty_cache()
    return rows


def shape_rates(name: str, *, n: int, k: int, tokens: tuple[int, ...], native: bool) -> list[dict]:
    """gemm_rates' rows for one [n, k] weight; its tensors are freed when this returns, before
    the next shape's are made."""
    from rltool.convert.fp8 import quantize_blocks_torch
    from rltool.engine import fp8_gemm

    rows = []
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, block_scale = quantize_blocks_torch(w, (128, 128))
    block_scale = block_scale.to("cuda")
    # the engine's layout: per-row scales, K-block-major
    scale = block_scale.repeat_interleave(128, dim=0)[:n].t().contiguous().t()
    for m in tokens:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"gemm": name, "m": m, "n": n, "k": k}
        fp8_bytes = n * k + scale.numel() * 4 + m * k * 2 + m * n * 2
        act = fp8_gemm.activations(x, 128)  # as the fused norm / SiLU kernels leave them
        prequantized_bytes = fp8_bytes - m * k * 2 + act.q.numel() + act.s.numel() * 4
        kinds = {"bf16": (lambda: torch.nn.functional.linear(x, w),
                          2 * (n * k + m * k + m * n)),
                 "triton": (lambda: fp8_gemm.triton_linear(x, q, scale, block_k=128),
                            fp8_bytes),
                 "triton_prequantized": (
                     lambda: fp8_gemm.triton_linear(act, q, scale, block_k=128),
                     prequantized_bytes)}
        if native:
            kinds["native"] = (lambda: fp8_gemm.native_linear(x, q, scale, block_k=128),
                               fp8_bytes)
            kinds["native_prequantized"] = (
                lambda: fp8_gemm.native_linear(act, q, scale, block_k=128),
                prequantized_bytes)
        want = fp8_gemm.triton_linear(x, q, scale, block_k=128).float()
        try:
            got = native_block_weight(x, q, block_scale).float()
            if ((got - want).abs() <= 2 ** -6 * want.abs().amax()).all():
                kinds["native_128x128"] = (lambda: native_block_weight(x, q, block_scale),
                                           fp8_bytes - (scale.numel() - block_scale.numel())
                                           * 4)
        except (RuntimeError, NotImplementedError, ValueError):  # refused, by torch version
            pass
        for kind in KINDS:
            if kind not in kinds:
                row[f"{kind}_tflops"] = row[f"{kind}_GBps"] = None
                continue
            fn, nbytes = kinds[kind]
            seconds = graph_seconds(fn)
            row[f"{kind}_tflops"] = 2 * m * n * k / seconds / 1e12
            row[f"{kind}_GBps"] = nbytes / seconds / 1e9
        rows.append(row)
    return rows


def quantize_fusion(spec, tokens: tuple[int, ...] = (64, 256)) -> list[dict]:
    """GPU microseconds per call of the kernels before an FP8 linear, unfused (the bf16 kernel,
    then the activation quantization) against fused (one kernel writing the e4m3 bytes and
    scales): residual-add + RMSNorm at the hidden size (before qkv and gate_up) and
    SiLU-and-multiply at the intermediate size (before down), decode attention at the model's
    heads over 1000 cached tokens per request (before o)."""
    from rltool.engine import fp8_gemm, fused

    rows = []
    for m in tokens:
        h = torch.randn(m, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(h)
        w = torch.randn(spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        gu = torch.randn(m, 2 * spec.intermediate_size, device="cuda", dtype=torch.bfloat16)
        eps = spec.rms_norm_eps
        kernels = {
            "add_rms_norm": (
                lambda: fp8_gemm.activations(fused.add_rms_norm(h, res, w, eps)[0], 128),
                lambda: fused.add_rms_norm(h, res, w, eps, 128)),
            "silu_mul": (lambda: fp8_gemm.activations(fused.silu_mul(gu), 128),
                         lambda: fused.silu_mul(gu, 128)),
            "decode_attention": decode_attention_pair(spec, m)}
        for name, (unfused, fused_fn) in kernels.items():
            rows.append({"kernel": name, "m": m, "unfused_us": graph_seconds(unfused) * 1e6,
                         "fused_us": graph_seconds(fused_fn) * 1e6})
            print(f"quantize fusion {name:16} m={m:>4}: unfused {rows[-1]['unfused_us']:6.1f} us,"
                  f" fused {rows[-1]['fused_us']:6.1f} us", flush=True)
    return rows


def decode_attention_pair(spec, m: int, length: int = 1000):
    """(decode attention then the quantization kernel, decode attention writing o_proj's input
    quantized) for m requests of `length` cached tokens in a bf16 cache."""
    from rltool.engine import fp8_gemm
    from rltool.engine.decode_attention import decode_attention, num_splits_for

    d, kvh, page = spec.head_dim, spec.num_kv_heads, 16
    pages = -(-length // page)
    kv = [torch.randn(m * pages * page, kvh, d, device="cuda", dtype=torch.bfloat16)
          for _ in range(2)]
    q = torch.randn(m, spec.num_heads, d, device="cuda", dtype=torch.bfloat16)
    kw = dict(req_to_page=torch.arange(m * pages, device="cuda").view(m, pages),
              rows=torch.arange(m, device="cuda"),
              seq_lens=torch.full((m,), length, device="cuda"), page_size=page, scale=d ** -0.5,
              num_splits=num_splits_for(m, kvh))
    return (lambda: fp8_gemm.activations(decode_attention(q, *kv, **kw).view(m, -1), 128),
            lambda: decode_attention(q, *kv, block_k=128, **kw))


def print_gemms(preset: str, rows: list[dict], bw: float) -> None:
    print(f"{preset:14} device copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    for r in rows:
        cells = ", ".join(
            f"{kind} {r[f'{kind}_tflops']:6.1f} TFLOP/s {r[f'{kind}_GBps']:6.0f} GB/s"
            if r[f"{kind}_tflops"] is not None else f"{kind} n/a"
            for kind in KINDS)
        print(f"{preset:14} GEMM {r['gemm']:8} m={r['m']:>5} n={r['n']:>6} k={r['k']:>5}: "
              f"{cells}", flush=True)


def engines(preset: str, batches: list[int], modes: dict) -> dict:
    """Workload (a) on each mode's engine (checkpoint, KV cache dtype, GEMM backend):
    {mode: in_process result}, each batch with its tokens/s ratio
    to the first mode and the engine's weight GB/s."""
    from rltool.engine import fp8_gemm

    out: dict = {}
    for mode, (model_dir, kv, backend) in modes.items():
        fp8_gemm.set_backend(backend)
        try:
            out[mode] = in_process(model_dir, batches, kv_cache_dtype=kv)
        finally:
            fp8_gemm.set_backend("auto")
        for b in batches:
            r = out[mode][b]
            r["weight_GBps"] = (out[mode]["engine"]["weight_bytes"] * r["decode_steps"]
                                / r["seconds"] / 1e9)
    first = next(iter(modes))
    for b in batches:
        base = out[first][b]["tokens_per_s"]
        for mode in modes:
            out[mode][b]["vs_" + first] = out[mode][b]["tokens_per_s"] / base
        print(f"{preset:14} B={b:>4}: " + ", ".join(
            f"{m} {out[m][b]['tokens_per_s']:>8.0f} tok/s ({out[m][b]['vs_' + first]:.2f}x, "
            f"weights {out[m][b]['weight_GBps']:.0f} GB/s)" for m in modes), flush=True)
    for m in modes:
        print(f"{preset:14} {m}: {out[m]['engine']}", flush=True)
    return out


def preset_spec(preset: str):
    """The engine's spec of a preset's shapes (its config.json alone, no weights)."""
    from rltool.data.models import build_config
    from rltool.engine.model_spec import read_spec

    config = build_config("qwen2", preset, vocab_size=1024, eos_token_id=0, pad_token_id=0)
    config.architectures = ["Qwen2ForCausalLM"]
    out = Path(tempfile.mkdtemp())
    config.save_pretrained(str(out))
    return read_spec(out)


def precision_cost(preset: str, batches: list[int]) -> dict:
    """Mode fp8: the three engines' workload (a), and the GEMM rates."""
    from rltool.engine.model_spec import read_spec

    model_dir, fp8_dir = checkpoints(preset)
    out = engines(preset, batches, {"bf16": (model_dir, "auto", "auto"),
                                    "fp8": (fp8_dir, "auto", "auto"),
                                    "fp8+fp8kv": (fp8_dir, "fp8_e4m3", "auto")})
    out["copy_bandwidth_Bps"] = copy_bandwidth()
    out["gemm"] = gemm_rates(read_spec(model_dir))
    print_gemms(preset, out["gemm"], out["copy_bandwidth_Bps"])
    return out


def quick(preset: str, batches: list[int], gemm_only: bool, engines_only: bool) -> dict:
    """The GEMM rates (unless engines_only), the quantization fusions, then (unless gemm_only)
    the bf16 and fp8 engines."""
    bw = copy_bandwidth()
    spec = preset_spec(preset)
    out: dict = {"copy_bandwidth_Bps": bw}
    if not engines_only:
        out["gemm"] = gemm_rates(spec)
        print_gemms(preset, out["gemm"], bw)
    out["quantize_fusion"] = quantize_fusion(spec)
    from rltool.engine.fp8_gemm import probe_native

    out["native_bias_in_epilogue"] = probe_native(torch.device("cuda"), (5, 64), bias=True)
    print(f"native GEMM adds the bias in cuBLASLt's epilogue: {out['native_bias_in_epilogue']}",
          flush=True)
    if not gemm_only:
        model_dir, fp8_dir = checkpoints(preset)
        out["engines"] = engines(preset, batches, {"bf16": (model_dir, "auto", "auto"),
                                                   "fp8": (fp8_dir, "auto", "auto")})
    return out
