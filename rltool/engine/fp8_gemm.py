"""Block-FP8 GEMM (DeepSeek-V3 style) as a Triton kernel: y = x @ dequant(w).T (+ bias).

Weights are float8_e4m3fn [N, K] with one float32 scale per row and K-block of `BLOCK_K` columns
(`scale` [N, ceil(K / BLOCK_K)]: a checkpoint's 128x128 block scales repeated over the block's
rows, so fused projections need not start on a block boundary). Activations are quantized inside
the kernel, per token and K-block, exactly as weights are: `s = max(max|x|, 1e-12) / 448`,
`q = clamp(x / s, ±448)` cast to e4m3 (round to nearest even). Each K-block's product is an FP8
tensor-core dot accumulated in float32, multiplied by the token's and the row's scales and added
into a float32 accumulator (the per-block promotion DeepSeek-V3 uses), then rounded once to x's
dtype.

Triton 3.6's interpreter casts float32 to e4m3 wrongly when the mantissa carries into the exponent
(31.6 becomes 16), so under TRITON_INTERPRET=1 (CPU tests) the kernel rounds to an exact e4m3
value first with float32 arithmetic; on a GPU the hardware conversion does the same rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltool.batch_invariant import INTERPRETED
from rltool.convert import fp8

# Kernels may read only constexpr globals.
E4M3_MAX = tl.constexpr(fp8.E4M3_MAX)
SCALE_FLOOR = tl.constexpr(fp8.SCALE_FLOOR)


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """float32 (already clamped to ±448) -> float8e4nv, rounding to nearest even."""
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        ulp = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        x = ((x / ulp + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2**23: float32 rounds to even
    return x.to(tl.float8e4nv)


@triton.jit
def _fp8_gemm(A, B, Bs, Bias, C, M, N, K, stride_am, stride_bn, stride_sn, stride_cm,
              NUM_KB: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptr = A + offs_m.to(tl.int64)[:, None] * stride_am
    b_ptr = B + offs_n.to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, NUM_KB):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        a = tl.load(a_ptr + k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)
        sa = tl.maximum(tl.max(tl.abs(a), axis=1), SCALE_FLOOR) / E4M3_MAX
        aq = to_e4m3(tl.clamp(a / sa[:, None], -E4M3_MAX, E4M3_MAX), EMULATE)
        b = tl.load(b_ptr + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        sb = tl.load(Bs + offs_n * stride_sn + kb, mask=mask_n, other=0.0)
        acc += tl.dot(aq, tl.trans(b), out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by the number of tokens: narrow tiles at decode
    batch sizes (more programs over the weight, which is what is read), square ones for prefill."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 32:
        return 32, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, block_k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) times the block-FP8 weight (q [N, K], scale [N, ceil(K /
    block_k)]) transposed, plus bias: [M, N] in x's dtype. `block_k`: a power of two >= 32 (the
    FP8 tensor-core dot's K)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = q.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bm, bn, warps, stages = _tiles(M)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _fp8_gemm[grid](x, q, scale, bias if bias is not None else scale, out, M, N, K,
                    x.stride(0), q.stride(0), scale.stride(0), out.stride(0),
                    NUM_KB=scale.shape[1], HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
                    BLOCK_K=block_k, EMULATE=INTERPRETED, num_warps=warps, num_stages=stages)
    return out
