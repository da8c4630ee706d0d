"""Paged decode attention as a Triton kernel, flash-decoding style (split-KV).

Stage 1: one program per (request, KV head, split). It handles the query heads sharing that KV
head together (GQA: the group is padded to 16 rows so both products run on tensor cores), walks its
split of the request's tokens through the page table, and writes the split's normalised output and
log-sum-exp. Stage 2 merges the splits with softmax weights of their log-sum-exps, one program
per (request, head), and rounds the result to the query's dtype. Before an FP8 o_proj it writes
that result only quantized for the block-FP8 GEMM (rltool.engine.fp8_gemm: per token and K-block
of o_proj's input [H * head_dim]) when each head holds whole K-blocks (head_dim 128 and 128-wide
K-blocks: one head, one K-block), each program its own K-blocks' amax and scale: the bytes and
scales fp8_gemm's quantization kernel would write, one kernel fewer per layer. Otherwise (a
K-block spanning heads) the output stays unquantized and the GEMM quantizes it.

The number of splits is fixed per call, so a CUDA graph captured for a batch size replays with any
sequence lengths: a split longer than the sequence simply has no tokens (lse = -inf, weight 0).
An FP8 cache (float8_e4m3fn K/V with one float32 scale per token and KV head) is read as e4m3
converted to the query's dtype; the K scales multiply the scores and the V scales the softmax
weights, so the products stay on tensor cores.

Tested against `paged.decode_attention_ref` on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltool.batch_invariant import INTERPRETED
from rltool.engine.fp8_gemm import Fp8Activations, empty_activations
from rltool.engine.fp8_kernels import store_quantized

BLOCK_N = 32
# The most splits a call takes. The number of splits follows the batch (num_splits_for), so it
# is a run-time argument of both stages (a constexpr would compile them again for each), and
# stage 2 reads a fixed MAX_SPLITS lanes, those past the call's masked off.
MAX_SPLITS = 32
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# Not specialized on per-batch values (see rltool.engine.fused): index rows, placeholder scales,
# the number of splits and the strides of the split buffers, which follow it (a stride of 1 or a
# multiple of 16 would otherwise be a variant of its own).
@triton.jit(do_not_specialize=["NUM_SPLITS", "stride_ob", "stride_oh", "stride_lb", "stride_lh"],
            do_not_specialize_on_alignment=["KScale", "VScale", "Rows", "SeqLens"])
def _stage1(Q, K, V, KScale, VScale, ReqToPage, Rows, SeqLens, MidO, MidLse,
            stride_qb, stride_qh, stride_kt, stride_kh, stride_st, stride_rp,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            sm_scale,
            GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            NUM_SPLITS, PRECISION: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(Rows + b).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    n0 = start
    while n0 < end:  # a while loop: the interpreter cannot range() over program-id arithmetic
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(ReqToPage + row * stride_rp + offs_n // PAGE, mask=mask_n, other=0)
        tok = page.to(tl.int64) * PAGE + offs_n % PAGE
        kv_off = tok[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        if FP8:  # the per-token scales factor out of the dot products
            scale_off = tok * stride_st + kvh
            s = s * tl.load(KScale + scale_off, mask=mask_n, other=0.0)[None, :]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        if FP8:
            pv = p * tl.load(VScale + scale_off, mask=mask_n, other=0.0)[None, :]
        else:
            pv = p
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
        n0 += BLOCK_N
    has = l > 0
    o = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(MidO + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
             + offs_d[None, :], o, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit(do_not_specialize=["B", "ROWS", "NUM_SPLITS", "stride_ob", "stride_oh", "stride_lb",
                               "stride_lh"])
def _stage2(MidO, MidLse, Out, Q, S, B, ROWS, stride_ob, stride_oh, stride_os, stride_lb,
            stride_lh, stride_xb, stride_xh, NUM_SPLITS, BLOCK_S: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr,
            QUANT: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """Row r's head h: the splits merged, rounded to DTYPE, stored into Out, or with QUANT
    quantized (its HEAD_DIM / BLOCK_K whole K-blocks of the row [H * HEAD_DIM]) into Q, S; rows
    B..ROWS (the GEMM's padding) zeros with the floor scale."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.minimum(r, B - 1)  # a padding row merges the last request's splits, then stores zeros
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    o = tl.load(MidO + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os
                + offs_d[None, :], mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0)
    out = (tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)).to(DTYPE)
    if QUANT:  # the bytes and scales fp8_gemm's quantization kernel writes from `out`
        row = tl.where(r < B, out.to(tl.float32), 0.0)
        k_total = tl.num_programs(1) * HEAD_DIM
        store_quantized(row, Q + r.to(tl.int64) * k_total + h * HEAD_DIM,
                        S + (h * HEAD_DIM // BLOCK_K) * ROWS + r, ROWS, HEAD_DIM, BLOCK_D,
                        BLOCK_K, EMULATE)
    else:
        tl.store(Out + b * stride_xb + h * stride_xh + offs_d, out, mask=offs_d < HEAD_DIM)


def num_splits_for(batch: int, num_kv_heads: int, *, max_len: int = 1 << 30,
                   target_programs: int = 264) -> int:
    """Enough splits for ~2 programs per SM of an H100/H200, never a split shorter than a block."""
    want = max(1, -(-target_programs // max(batch * num_kv_heads, 1)))
    return int(max(1, min(want, MAX_SPLITS, -(-max_len // BLOCK_N))))


def quantizes(head_dim: int, block_k: int) -> bool:
    """Whether stage 2 can write the output quantized for a block-FP8 o_proj of K-block
    `block_k`: each head (one program) holds whole K-blocks, so no K-block spans two programs."""
    return head_dim % block_k == 0


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                     req_to_page: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     page_size: int, scale: float, num_splits: int,
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None,
                     block_k: int | None = None) -> torch.Tensor | Fp8Activations:
    """q [B, H, D]; k/v_cache [slots, KVH, D] (in q's dtype, or float8_e4m3fn with k/v_scale
    [slots, KVH]: one scale per token and head); rows, seq_lens [B]. Returns [B, H, D], q's
    dtype; with `block_k` (the K-block of an FP8 o_proj) where `quantizes(D, block_k)`, the
    output as o_proj's input [B, H * D] quantized for it (fp8_gemm.Fp8Activations: the bytes and
    scales fp8_gemm's quantization kernel writes from the q-dtype output)."""
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    B, H, D = q.shape
    kvh = k_cache.shape[1]
    group = H // kvh
    mid_o = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    fp8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)
    _stage1[(B, kvh, num_splits)](
        q, k_cache, v_cache, ks, vs, req_to_page, rows, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), ks.stride(0),
        req_to_page.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        scale,
        GROUP=group, PAGE=page_size, HEAD_DIM=D, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)), NUM_SPLITS=num_splits,
        PRECISION=precision, FP8=fp8, num_warps=4, num_stages=2)
    quant = block_k is not None and quantizes(D, block_k)
    if quant:
        out = empty_activations(B, H * D, block_k, q.dtype, q.device)
        dest, fp8_q, fp8_s = out.q, out.q, out.s
    else:
        out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
        dest, fp8_q, fp8_s = out, out, out
    _stage2[(dest.shape[0], H)](
        mid_o, mid_lse, dest, fp8_q, fp8_s, B, dest.shape[0], mid_o.stride(0), mid_o.stride(1),
        mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), dest.stride(0), dest.stride(1),
        NUM_SPLITS=num_splits,
        BLOCK_S=MAX_SPLITS, HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D), DTYPE=TL_DTYPES[q.dtype], QUANT=quant,
        BLOCK_K=block_k if quant else D, EMULATE=INTERPRETED, num_warps=2)
    return out
