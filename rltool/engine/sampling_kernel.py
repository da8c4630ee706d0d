"""One Triton kernel that samples a token per row and returns its logprob (CUDA fast path).

For rows without top-k / top-p / min-p, logit_bias or suppressed ids, which is what RL rollouts
send. Per row: pass 1 finds the log-sum-exp of logits / T (online max and sum); pass 2 draws with
the Gumbel-max trick (the exponential race of `sampling.sample` in log space: argmax of
log p - log E with E = -log U ~ Exp(1)), U from Philox keyed by the row's seed and the token id, so
a request's draw depends only on its seed and step, not on its batch. Greedy rows take the plain
argmax (first index on ties, as torch does). The logprob is that of the temperature-scaled
distribution (the project's convention). Two reads of the logits, no [B, V] intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _sample_rows(Logits, stride_l, Temps, Seeds, Greedy, OutTok, OutLp, V,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_t = 1.0 / tl.load(Temps + row)
    seed = tl.load(Seeds + row)
    greedy = tl.load(Greedy + row) != 0
    base = Logits + row * stride_l
    arange = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s_vec = tl.zeros([BLOCK], dtype=tl.float32)
    start = 0
    while start < V:  # while, not range: Triton's interpreter cannot range() over an argument
        offs = start + arange
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m_vec, x)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - safe) + tl.exp(x - safe)
        m_vec = m_new
        start += BLOCK
    m = tl.max(m_vec, axis=0)
    lse = m + tl.log(tl.sum(s_vec * tl.exp(m_vec - m), axis=0))
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    start = 0
    while start < V:
        offs = start + arange
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        u = tl.rand(seed, offs)
        gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        key = tl.where(greedy, x, x + gumbel)
        key = tl.where(mask, key, float("-inf"))
        take = key > best
        best = tl.where(take, key, best)
        best_idx = tl.where(take, offs, best_idx)
        start += BLOCK
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_idx, V), axis=0)
    chosen = tl.load(base + idx).to(tl.float32) * inv_t - lse
    tl.store(OutTok + row, idx.to(tl.int64))
    tl.store(OutLp + row, chosen)


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
                greedy: torch.Tensor, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, last dim contiguous); temps [B] float32 (greedy rows 1.0);
    seeds [B] int32; greedy [B] int32. Returns (tokens [B] int64, logprobs [B] float32)."""
    B, V = logits.shape
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    _sample_rows[(B,)](logits, logits.stride(0), temps, seeds, greedy, tokens, logprobs, V,
                       BLOCK=block, num_warps=8)
    return tokens, logprobs
