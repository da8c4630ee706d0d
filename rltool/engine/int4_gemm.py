"""W4A16 GEMM: y = x @ dequant(w).T (+ bias) for a weight kept INT4 (rltool.engine.int4_weight).

One Triton kernel. Each program computes a BLOCK_M x BLOCK_N tile of y; per K-step it loads x's
tile, the int32 words that hold the weight tile's 4-bit codes (word k // 8 of each row, code at
bits 4 * (k % 8)), the tile's float32 group scales (and int8 zero points), dequantizes in
registers exactly as the convert path does (`(code - 8 - zp) * scale` as one float32 product,
rounded to x's dtype, as a weight dequantized at load holds it) and accumulates the tile's dot in
float32. The result is rounded once to x's dtype, and the bias added in float32 before that.

No host synchronization (shapes only): the launch is capturable in a CUDA graph. Tiles follow M,
so the kernel is not batch invariant (the deterministic mode dequantizes at load). Tested on CPU
under TRITON_INTERPRET=1 against a float32 reference of the dequantized weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltool.batch_invariant import INTERPRETED
from rltool.engine.int4_weight import Int4Weight


@triton.jit
def _tile(acc, X, P, S, Z, rows_x, rows_n, m_ok, n_ok, k0, K, G, stride_pn, stride_sn, stride_zn,
          HAS_ZERO: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """acc + x[:, k0:k0+BLOCK_K] @ dequant(w[:, k0:k0+BLOCK_K]).T"""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    x = tl.load(X + rows_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    w_mask = n_ok[:, None] & k_ok[None, :]
    words = tl.load(P + rows_n * stride_pn + (offs_k // 8)[None, :], mask=w_mask, other=0)
    codes = (words >> ((offs_k % 8) * 4)[None, :]) & 0xF
    group = (offs_k // G)[None, :]
    scale = tl.load(S + rows_n * stride_sn + group, mask=w_mask, other=0.0)
    q = codes - 8
    if HAS_ZERO:
        q = q - tl.load(Z + rows_n * stride_zn + group, mask=w_mask, other=0).to(tl.int32)
    w = (q.to(tl.float32) * scale).to(x.dtype)  # [BLOCK_N, BLOCK_K], as dequantized at load
    if EMULATE:  # the interpreter's dot takes no bf16: the same exact products in float32
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    if IEEE:  # float32 activations: no TF32
        return acc + tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
    return acc + tl.dot(x, tl.trans(w), out_dtype=tl.float32)


@triton.jit(do_not_specialize=["M"])
def _w4a16(X, P, S, Z, B, Y, M, N, K, G, stride_xm, stride_pn, stride_sn, stride_zn, stride_ym,
           HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
           EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_x = offs_m.to(tl.int64)[:, None] * stride_xm
    rows_n = offs_n.to(tl.int64)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EMULATE:  # a while loop: the interpreter cannot range() over a scalar argument
        k0 = 0
        while k0 < K:
            acc = _tile(acc, X, P, S, Z, rows_x, rows_n, m_ok, n_ok, k0, K, G, stride_pn,
                        stride_sn, stride_zn, HAS_ZERO, IEEE, EMULATE, BLOCK_K)
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            acc = _tile(acc, X, P, S, Z, rows_x, rows_n, m_ok, n_ok, k0, K, G, stride_pn,
                        stride_sn, stride_zn, HAS_ZERO, IEEE, EMULATE, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) @ dequant(w).T -> [M, N] in x's dtype (+ bias)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = w.packed.shape[-2]
    if w.packed.stride(-1) != 1 or w.scale.stride(-1) != 1:
        raise ValueError("int4_linear takes row-major packed weights and scales")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64 if N >= 64 else max(16, triton.next_power_of_2(N))
    block_k = 64 if K >= 64 else max(16, triton.next_power_of_2(K))
    zero = w.zero if w.zero is not None else w.scale
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a16[grid](x, w.packed, w.scale, zero, bias if bias is not None else w.scale, y,
                 M, N, K, w.group_size, x.stride(0), w.packed.stride(-2), w.scale.stride(-2),
                 zero.stride(-2), y.stride(0), HAS_ZERO=w.zero is not None,
                 HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or INTERPRETED,
                 EMULATE=INTERPRETED, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                 num_warps=4)
    return y
