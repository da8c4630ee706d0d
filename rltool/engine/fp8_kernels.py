"""The Triton kernels of the block-FP8 GEMM (rltool.engine.fp8_gemm launches them): activation
quantization and the GEMM itself, and the device helpers that other kernels use to write their
output already quantized for it (rltool.engine.fused, rltool.engine.decode_attention).

Quantization is per token and K-block, exactly as weights are: `s = max(max|x|, 1e-12) / 448`,
`q = clamp(x / s, ±448)` cast to e4m3 (round to nearest even); scales are stored K-block-major.
The GEMM promotes per block as DeepSeek-V3 does: each K-block's product is an FP8 tensor-core dot
(accumulated inside the tensor core), multiplied by the token's and the row's scales and added
into a float32 accumulator; with `SWAP` it computes the transposed product (decode sizes: weight
rows fill the MMA's 64-row side), and split K's float32 partial sums are added by `sum_splits` in
a fixed order.

Triton 3.6's interpreter casts float32 to e4m3 wrongly when the mantissa carries into the exponent
(31.6 becomes 16), so under TRITON_INTERPRET=1 (CPU tests) the kernels round to an exact e4m3
value first with float32 arithmetic (`EMULATE`); on a GPU the hardware conversion does the same
rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
def quantize_groups(a, EMULATE: tl.constexpr):
    """float32 [G, block_k] (zeros past the data) -> (e4m3 [G, block_k], scales [G]): per row
    s = max(max|a|, 1e-12) / 448, q = e4m3(clamp(a / s, ±448))."""
    s = tl.maximum(tl.max(tl.abs(a), axis=1), SCALE_FLOOR) / E4M3_MAX
    return to_e4m3(tl.clamp(a / s[:, None], -E4M3_MAX, E4M3_MAX), EMULATE), s


@triton.jit
def store_quantized(v, Q, S, ROWS, K, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                    EMULATE: tl.constexpr):
    """Quantize one row's chunk v [BLOCK] (float32, zeros past K; BLOCK a multiple of BLOCK_K)
    into Q[0:K] and its K-blocks' scales into S[0], S[ROWS], ... (K-block-major scales)."""
    q, s = quantize_groups(tl.reshape(v, (BLOCK // BLOCK_K, BLOCK_K)), EMULATE)
    kb = tl.arange(0, BLOCK // BLOCK_K)
    k = kb[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    tl.store(Q + k, q, mask=k < K)
    tl.store(S + kb * ROWS, s, mask=kb * BLOCK_K < K)


@triton.jit(do_not_specialize=["M", "ROWS"])  # token counts: see rltool.engine.fused
def quantize_rows(X, Q, S, M, ROWS, K, stride_xm, BLOCK_M: tl.constexpr,
                   BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """Q[m, k-block] = e4m3(x / s), S[k-block, m] = s for ROWS >= M rows (those past M zero):
    one program per row tile and K-block."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)[:, None]
    a = tl.load(X + rows * stride_xm + k[None, :], mask=(offs_m < M)[:, None] & (k < K)[None, :],
                other=0.0).to(tl.float32)
    q, s = quantize_groups(a, EMULATE)
    tl.store(Q + rows * K + k[None, :], q, mask=(offs_m < ROWS)[:, None] & (k < K)[None, :])
    tl.store(S + kb * ROWS + offs_m, s, mask=offs_m < ROWS)


@triton.jit
def _block_product(acc, a_ptr, b_ptr, As, Bs, rows_a, rows_b, kb, offs_k, stride_as, K,
                   stride_bsn, stride_bsk, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """acc + K-block kb's FP8 dot times its activation and weight scales."""
    if EVEN_K:
        a = tl.load(a_ptr + kb * BLOCK_K)
        b = tl.load(b_ptr + kb * BLOCK_K)
    else:
        mask_k = (kb * BLOCK_K + offs_k < K)[None, :]
        a = tl.load(a_ptr + kb * BLOCK_K, mask=mask_k, other=0.0)
        b = tl.load(b_ptr + kb * BLOCK_K, mask=mask_k, other=0.0)
    sa = tl.load(As + kb * stride_as + rows_a)
    sb = tl.load(Bs + rows_b * stride_bsn + kb * stride_bsk)
    if SWAP:
        d = tl.dot(b, tl.trans(a), out_dtype=tl.float32) * sb[:, None] * sa[None, :]
    else:
        d = tl.dot(a, tl.trans(b), out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    return acc + d


@triton.jit
def block_fp8_gemm(A, As, B, Bs, Bias, C, M, N, K, stride_as, stride_bn, stride_bsn,
                   stride_bsk, stride_cm, stride_cs, KB_PER_SPLIT, NUM_KB: tl.constexpr,
                   EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EMULATE: tl.constexpr):
    """C (or split pid_k's float32 partial sum at C + pid_k * stride_cs) of the quantized A
    [M, K] (scales As [NUM_KB, stride_as]) times B [N, K] (scales Bs, strides
    stride_bsn/stride_bsk)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n  # GROUP_M row tiles sweep the columns together (L2 reuse of B)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = offs_m % M  # wrapped: loads need no row mask, the store drops the copies
    rows_b = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    kb_lo = pid_k * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, NUM_KB)
    a_ptr = A + rows_a.to(tl.int64)[:, None] * K + offs_k[None, :]
    b_ptr = B + rows_b.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if EMULATE:  # a while loop: the interpreter cannot range() over program-id arithmetic
        kb = kb_lo
        while kb < kb_hi:
            acc = _block_product(acc, a_ptr, b_ptr, As, Bs, rows_a, rows_b, kb, offs_k,
                                 stride_as, K, stride_bsn, stride_bsk, EVEN_K, SWAP, BLOCK_K)
            kb += 1
    else:  # software-pipelined over num_stages K-blocks
        for kb in range(kb_lo, kb_hi):
            acc = _block_product(acc, a_ptr, b_ptr, As, Bs, rows_a, rows_b, kb, offs_k,
                                 stride_as, K, stride_bsn, stride_bsk, EVEN_K, SWAP, BLOCK_K)
    if SWAP:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out = C + pid_k * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def sum_splits(P, Bias, C, M, N, stride_cm, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK: tl.constexpr):
    """C = sum of the SPLIT float32 partial products P [SPLIT, M, N], in split order, + bias."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(P + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(P + s * M * N + offs, mask=mask, other=0.0)
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(Bias + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + (offs // N) * stride_cm + col, acc.to(C.dtype.element_ty), mask=mask)
