"""Block-FP8 GEMM (DeepSeek-V3 style): y = x @ dequant(w).T (+ bias), and which GEMM runs it.

Weights are float8_e4m3fn [N, K] with one float32 scale per row and K-block of `block_k` columns
(`scale` [N, ceil(K / block_k)]: a checkpoint's 128x128 block scales repeated over the block's
rows, so fused projections need not start on a block boundary; rltool.engine.quant keeps it
K-block-major in memory, strides (1, N), the layout cuBLAS's 1x128 scales take). Activations
are quantized first, per token and K-block exactly as weights are (rltool.engine.fp8_kernels),
into `Fp8Activations`: q [R, K] and s [ceil(K / block_k), R], R = M rounded up to a multiple of 4
(cuBLASLt's block scales want 16-byte aligned columns; the padding rows are zeros with the floor
scale). Either one Triton kernel quantizes x, or the kernel that computes x writes it quantized
(`quantize_groups`: rltool.engine.fused's RMSNorm and SiLU-and-multiply, the decode attention
kernel's output before o_proj), with the same bits.

Two GEMMs take the quantized operands:
- native: `torch._scaled_mm` with 1x128 block scales on both operands (cuBLASLt >= 12.9 on
  Hopper, sm90), used on a GPU where a first call's probe against the Triton kernel passes;
- Triton (everywhere else): the per-block promotion of rltool.engine.fp8_kernels. At decode sizes
  (M <= 64) it computes the transposed product (weight rows fill the MMA's 64-row side, tokens
  its narrow side) and splits K over enough programs to fill the GPU, the float32 partial sums
  added by a second kernel in a fixed order; prefill tiles are 64 or 128 x 128 in grouped launch
  order (`config`).
The result is rounded once to x's dtype. Neither is batch invariant (tiles and splits follow M):
the engine's deterministic mode serves FP8 checkpoints dequantized.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
import triton

from rltool.batch_invariant import INTERPRETED
from rltool.engine.fp8_kernels import block_fp8_gemm, quantize_rows, sum_splits

BACKENDS = ("auto", "triton", "native")


def quantize_activations(x: torch.Tensor, block_k: int, rows: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [R, K], float32 scales [ceil(K / block_k), R]): per token and K-block,
    R = `rows` (>= M; the rows past M quantize zeros) or M."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    R = M if rows is None else rows
    num_kb = triton.cdiv(K, block_k)
    q = torch.empty(R, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(num_kb, R, dtype=torch.float32, device=x.device)
    if R:
        quantize_rows[(triton.cdiv(R, 16), num_kb)](x, q, s, M, R, K, x.stride(0), BLOCK_M=16,
                                                    BLOCK_K=block_k, EMULATE=INTERPRETED,
                                                    num_warps=4)
    return q, s


@dataclass(frozen=True)
class Fp8Activations:
    """Activations quantized for the block-FP8 GEMM: `q` e4m3 [R, K] and `s` float32 scales
    [ceil(K / block_k), R] of `m` tokens (rows past m: zeros, floor scale); `dtype`: the GEMM's
    output dtype (the unquantized activations')."""
    q: torch.Tensor
    s: torch.Tensor
    m: int
    dtype: torch.dtype


def padded_rows(m: int) -> int:
    """The rows of quantized activations for m tokens: m rounded up to a multiple of 4."""
    return -(-m // 4) * 4


def empty_activations(m: int, k: int, block_k: int, dtype: torch.dtype,
                      device: torch.device) -> Fp8Activations:
    """Uninitialized `Fp8Activations` for m tokens of k channels (a kernel fills them)."""
    rows = padded_rows(m)
    return Fp8Activations(torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device),
                          torch.empty(triton.cdiv(k, block_k), rows, dtype=torch.float32,
                                      device=device), m, dtype)


def activations(x: torch.Tensor | Fp8Activations, block_k: int) -> Fp8Activations:
    """x quantized per token and K-block (by `quantize_activations`), or x as it is when a fused
    kernel already quantized it."""
    if isinstance(x, Fp8Activations):
        return x
    q, s = quantize_activations(x, block_k, rows=padded_rows(x.shape[0]))
    return Fp8Activations(q, s, x.shape[0], x.dtype)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter: a small "GPU", so CPU tests cover the split-K path
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=4096)
def config(m: int, n: int, num_kb: int, sms: int) -> dict:
    """Tiles, warps, stages and K splits by problem size. Decode sizes (m <= 64) read the weight
    once and do little math: the transposed product with 64 weight rows per tile, the tokens
    padded to 16/32/64, and K split until the tiles cover every SM once (at least 2 K-blocks per
    split). Prefill: 64x128 tiles to m = 128, 128x128 beyond; 4 stages of 128-wide K-blocks."""
    if m <= 64:
        bm, bn, warps, swap, min_kb = max(16, triton.next_power_of_2(m)), 64, 4, True, 2
    elif m <= 128:
        bm, bn, warps, swap, min_kb = 64, 128, 4, False, 4
    else:
        bm, bn, warps, swap, min_kb = 128, 128, 8, False, 4
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = max(1, min(triton.cdiv(sms, tiles) if tiles < sms else 1, num_kb // min_kb))
    per_split = triton.cdiv(num_kb, split)
    return {"BLOCK_M": bm, "BLOCK_N": bn, "SWAP": swap, "num_warps": warps, "num_stages": 4,
            "split": triton.cdiv(num_kb, per_split), "per_split": per_split}


def triton_linear(x: torch.Tensor | Fp8Activations, q: torch.Tensor, scale: torch.Tensor, *,
                  block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton path of fp8_linear."""
    act = activations(x, block_k)
    xq, xs, M = act.q, act.s, act.m
    K = xq.shape[1]
    N = q.shape[0]
    out = torch.empty(M, N, dtype=act.dtype, device=xq.device)
    if M == 0:
        return out
    num_kb = scale.shape[1]
    cfg = dict(config(M, N, num_kb, _num_sms(xq.device)))
    split, per_split = cfg.pop("split"), cfg.pop("per_split")
    dest = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), split)
    has_bias = bias is not None and split == 1
    block_fp8_gemm[grid](xq, xs, q, scale, bias if has_bias else scale, dest, M, N, K,
                         xs.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
                         N if split > 1 else out.stride(0), M * N, per_split, NUM_KB=num_kb,
                         EVEN_K=K % block_k == 0, HAS_BIAS=has_bias, BLOCK_K=block_k,
                         GROUP_M=8, EMULATE=INTERPRETED, **cfg)
    if split > 1:
        block = 1024
        sum_splits[(triton.cdiv(M * N, block),)](dest, bias if bias is not None else scale, out,
                                                 M, N, out.stride(0), SPLIT=split,
                                                 HAS_BIAS=bias is not None, BLOCK=block)
    return out


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def native_fits(x: torch.Tensor | Fp8Activations, q: torch.Tensor, scale: torch.Tensor,
                block_k: int) -> bool:
    """Whether torch._scaled_mm's 1x128 x 1x128 block scaling takes these operands as they are:
    a CUDA device of compute capability 9.x, 128-wide K-blocks, K and N multiples of 128 and 16,
    a bf16/fp16 output, the weight row-major and its scales K-block-major (strides (1, N))."""
    N, K = q.shape
    return (q.is_cuda and hasattr(torch, "_scaled_mm") and block_k == 128 and K % 128 == 0
            and N % 16 == 0 and x.dtype in (torch.bfloat16, torch.float16)
            and q.stride() == (K, 1) and scale.stride() == (1, N) and _hopper(q.device))


def native_linear(x: torch.Tensor | Fp8Activations, q: torch.Tensor, scale: torch.Tensor, *,
                  block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The cuBLASLt path of fp8_linear (operands as `native_fits` requires): A's scales [R, Kb]
    with strides (1, R), B = q.T column-major with scales whose transpose is `scale`; the padding
    rows' products are cut off. The bias is added in cuBLASLt's epilogue where a probe found it
    honoured with block scales (one rounding, no second kernel), else by a second kernel."""
    act = activations(x, block_k)
    fuse = bias is not None and _NATIVE.bias_fused(q.device, act.m)
    out = _scaled_mm(act, q, scale, bias if fuse else None)
    return out if bias is None or fuse else out.add_(bias)


def _scaled_mm(act: Fp8Activations, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    return torch._scaled_mm(act.q, q.t(), scale_a=act.s.t(), scale_b=scale.t(), bias=bias,
                            out_dtype=act.dtype)[:act.m]


class _Native:
    """Whether the native path is used on a device for M tokens, and whether it adds the bias in
    cuBLASLt's epilogue: `auto` probes each once per device (outside CUDA-graph capture) against
    the Triton kernel, one token apart from several (torch takes a one-row activation scale as a
    128x128 block); `set_backend` overrides the first."""

    def __init__(self):
        self.backend = "auto"
        self.verdict: dict[tuple[str, torch.device, bool], bool] = {}
        self.lock = threading.Lock()

    def usable(self, device: torch.device, m: int) -> bool:
        if self.backend != "auto":
            return self.backend == "native"
        return self._probed("gemm", device, m)

    def bias_fused(self, device: torch.device, m: int) -> bool:
        return self._probed("bias", device, m)

    def _probed(self, what: str, device: torch.device, m: int) -> bool:
        key = (what, device, m == 1)
        if key not in self.verdict:
            if torch.cuda.is_current_stream_capturing():
                return False
            tokens = (1,) if m == 1 else (5, 64)
            with self.lock:
                self.verdict.setdefault(key, probe_native(device, tokens, bias=what == "bias"))
        return self.verdict[key]


_NATIVE = _Native()


def set_backend(name: str) -> None:
    """`auto` (native where its probe passes, else Triton), `triton`, or `native` (where
    `native_fits`; Triton for the other shapes)."""
    if name not in BACKENDS:
        raise ValueError(f"FP8 GEMM backend {name!r} is not one of {', '.join(BACKENDS)}")
    _NATIVE.backend = name


def probe_native(device: torch.device, tokens: tuple[int, ...] = (1, 5, 64), *,
                 bias: bool = False) -> bool:
    """One call of the native path per token count at N=256, K=512, within the two GEMMs'
    rounding and accumulation differences of the Triton path; False when torch, cuBLASLt or the
    GPU refuse it. `bias`: the call with a bias (large against those differences) passed to
    cuBLASLt's epilogue instead."""
    if not _hopper(device) or not hasattr(torch, "_scaled_mm"):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(256, 512, device=device, generator=gen)
    q = (w / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    # scales 2^-3..2^3 apart: one read from the wrong row or K-block shows
    exponents = torch.randint(-3, 4, (4, 256), device=device, generator=gen)
    scale = (0.01 * 2.0 ** exponents).t()  # K-block-major, as native_fits requires
    deq = q.float() * scale.repeat_interleave(128, dim=1)
    b = (torch.randn(256, device=device, generator=gen) * 256).to(torch.bfloat16) if bias else None
    for m in tokens:
        x = torch.randn(m, 512, device=device, generator=gen, dtype=torch.bfloat16)
        try:
            got = _scaled_mm(activations(x, 128), q, scale, b).float()
        except (RuntimeError, NotImplementedError, ValueError):  # refused, by torch version
            return False
        want = triton_linear(x, q, scale, block_k=128, bias=b).float()
        # both round activations and accumulate; the output rounding of |y| <= |x||w| + |b|
        magnitude = x.float().abs() @ deq.abs().T + (0 if b is None else b.float().abs())
        if not ((got - want).abs() <= 2 ** -6 * magnitude).all():
            return False
    return True


def fp8_linear(x: torch.Tensor | Fp8Activations, q: torch.Tensor, scale: torch.Tensor, *,
               block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, or already quantized with this `block_k`) times the block-FP8
    weight (q [N, K], scale [N, ceil(K / block_k)], any strides) transposed, plus bias: [M, N]
    in x's dtype. `block_k`: a power of two >= 32 (the FP8 tensor-core dot's K)."""
    m = x.m if isinstance(x, Fp8Activations) else x.shape[0]
    if m and native_fits(x, q, scale, block_k) and _NATIVE.usable(q.device, m):
        return native_linear(x, q, scale, block_k=block_k, bias=bias)
    return triton_linear(x, q, scale, block_k=block_k, bias=bias)
