"""Triton kernels that sample a token per row and return its logprob (the CUDA fast path).

Per row, in one pass: the log-sum-exp of logits / T (online max and sum) and a draw by the
Gumbel-max trick (the exponential race of rltool.engine.sampling in log space: argmax of
log p - log E with E = -log U ~ Exp(1)), U from a counter-based hash of the row's seed and the
token id, so a request's draw depends only on its seed and step, not on its batch. Greedy rows
take the plain argmax (first index on ties, as torch does). The logprob is that of the
temperature-scaled distribution (the project's convention). One read of the logits, no [B, V] intermediate: a row
is split into chunks (so a small batch still fills the GPU) whose partial log-sum-exps and best
keys a second, tiny kernel combines.

A batch with top-k / top-p / min-p, logit_bias or masked stop ids passes `draw`: the logits the
race runs over (biased, -inf where a token may not be drawn; rltool.engine.batch_sampling builds
them), while the logprob still comes from `logits`. A row's race keys are the same either way, so
a token is the plain race's argmax over the tokens the row may draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rltool import trace

BLOCK = 1024
TARGET_PROGRAMS = 1024  # ~8 per SM of an H100/H200
MAX_CHUNKS = 64  # a run-time argument below it: a constexpr would compile a kernel per batch size


@triton.jit
def _fmix32(h):
    """MurmurHash3's 32-bit finaliser: a bijection that mixes every input bit into every output."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _uniform(seed, offs):
    """U(0, 1) keyed by (seed, token id): a counter-based hash, ~12 integer ops per token (Philox,
    tl.rand, costs ~10x more and made the kernel compute-bound)."""
    h = _fmix32(offs.to(tl.uint32) * 0x9E3779B1 + 0x7F4A7C15)
    h = _fmix32(h ^ seed.to(tl.uint32))
    # The largest hash, (2^24 - 1) + 0.5, rounds to 2^24 in float32: U = 1 would make the noise
    # -log(-log U) +inf, and its token (one row-step in ~110 at a 152k vocabulary) win whatever
    # its probability. Clamped to the largest float32 below 1; every other U is unchanged.
    return tl.minimum(((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), 0.99999994)


@triton.jit(do_not_specialize=["NCHUNK"])  # varies with the batch: see rltool.engine.fused
def _partial(Logits, stride_l, Draw, stride_d, Temps, Seeds, Greedy, PartM, PartS, PartKey,
             PartIdx, V, CHUNK, NCHUNK, HAS_DRAW: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over a chunk of a row: running max and sum of exp of x = logit / T (for the
    log-sum-exp) and the best race key (d = x, or draw / T with HAS_DRAW, plus Gumbel noise
    unless greedy) with its index."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_t = 1.0 / tl.load(Temps + row)
    seed = tl.load(Seeds + row)
    greedy = tl.load(Greedy + row) != 0
    base = Logits + row * stride_l
    draw_base = Draw + row * stride_d
    arange = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s_vec = tl.zeros([BLOCK], dtype=tl.float32)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, V)
    while start < end:  # while, not range: Triton's interpreter cannot range() over program ids
        offs = start + arange
        mask = offs < end
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m_vec, x)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - safe) + tl.exp(x - safe)
        m_vec = m_new
        if HAS_DRAW:
            d = tl.load(draw_base + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        else:
            d = x
        u = _uniform(seed, offs)
        key = tl.where(greedy, d, d - tl.log(-tl.log(tl.maximum(u, 1e-20))))
        key = tl.where(mask, key, float("-inf"))
        take = key > best
        best = tl.where(take, key, best)
        best_idx = tl.where(take, offs, best_idx)
        start += BLOCK
    m = tl.max(m_vec, axis=0)
    s = tl.sum(s_vec * tl.exp(m_vec - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_idx, V), axis=0)
    out = row * NCHUNK + chunk
    tl.store(PartM + out, m)
    tl.store(PartS + out, s)
    tl.store(PartKey + out, top)
    tl.store(PartIdx + out, idx)


@triton.jit(do_not_specialize=["NCHUNK"])
def _combine(Logits, stride_l, Temps, PartM, PartS, PartKey, PartIdx, OutTok, OutLp, V,
             NCHUNK, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < NCHUNK
    m = tl.load(PartM + row * NCHUNK + offs, mask=mask, other=float("-inf"))
    s = tl.load(PartS + row * NCHUNK + offs, mask=mask, other=0.0)
    key = tl.load(PartKey + row * NCHUNK + offs, mask=mask, other=float("-inf"))
    idx = tl.load(PartIdx + row * NCHUNK + offs, mask=mask, other=V)
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
    top = tl.max(key, axis=0)
    tok = tl.min(tl.where(key == top, idx, V), axis=0)  # chunks are in index order: first wins
    inv_t = 1.0 / tl.load(Temps + row)
    chosen = tl.load(Logits + row * stride_l + tok).to(tl.float32) * inv_t - lse
    tl.store(OutTok + row, tok.to(tl.int64))
    tl.store(OutLp + row, chosen)


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                greedy: torch.Tensor, *, draw: torch.Tensor | None = None,
                block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, last dim contiguous); temps [B] float32 (greedy rows 1.0);
    seeds [B] int32; greedy [B] int32; draw [B, V] (last dim contiguous): the logits to race
    over, when they are not `logits`. Returns (tokens [B] int64, logprobs [B] float32). A fixed
    two launches whatever B: CUDA-graph capturable."""
    B, V = logits.shape
    # Enough programs to keep every SM streaming: a row is split into chunks when B is small.
    nchunk = max(1, min(MAX_CHUNKS, triton.cdiv(TARGET_PROGRAMS, B), triton.cdiv(V, block)))
    chunk = triton.cdiv(triton.cdiv(V, nchunk), block) * block  # whole blocks per program
    nchunk = triton.cdiv(V, chunk)
    dev = logits.device
    with trace.span("decode.sample", cat="engine", batch=B):
        part_m = torch.empty(B, nchunk, dtype=torch.float32, device=dev)
        part_s = torch.empty_like(part_m)
        part_key = torch.empty_like(part_m)
        part_idx = torch.empty(B, nchunk, dtype=torch.int32, device=dev)
        race = logits if draw is None else draw
        _partial[(B, nchunk)](logits, logits.stride(0), race, race.stride(0), temps, seeds,
                              greedy, part_m, part_s, part_key, part_idx, V, chunk,
                              NCHUNK=nchunk, HAS_DRAW=draw is not None, BLOCK=block,
                              num_warps=4)
        tokens = torch.empty(B, dtype=torch.int64, device=dev)
        logprobs = torch.empty(B, dtype=torch.float32, device=dev)
        _combine[(B,)](logits, logits.stride(0), temps, part_m, part_s, part_key, part_idx,
                       tokens, logprobs, V, NCHUNK=nchunk, BLOCK_C=MAX_CHUNKS, num_warps=1)
    return tokens, logprobs
