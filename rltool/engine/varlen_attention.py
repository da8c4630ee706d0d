"""Variable-length causal attention over a prefill step's packed chunks, in one call per layer
(--prefill-attention varlen).

A step packs the chunks of several prompts into one token stream (rltool.engine.paged_forward),
fresh chunks (starting at position 0) first, then chunks over a cached prefix. A fresh chunk
attends to its own keys; a continuation to its prefix and itself, read back from the KV pool.
Instead of one causal SDPA call per group of equal-length fresh chunks (a new attention shape for
every new prompt length) and separate paths for continuations, every query attends once to one
key stream: the fresh chunks' own keys, then each continuation's keys gathered from the pool, a
segment per chunk in the queries' order (`cu_q`, `cu_k`: the segments' offsets).

On CUDA in bf16/fp16 that is one call to torch's variable-length flash attention (causal aligned
to the end of each key segment, so a continuation's queries see their whole prefix); elsewhere one
SDPA call under a block-diagonal causal mask [T, Tk]. On CPU the mask costs more than the grouped
calls it replaces (docs/serve.md, "Prefill attention"), so grouped stays the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rltool import varlen



@dataclass
class VarlenPlan:
    """The key stream of one prefill step (built once, used by every layer)."""

    num_fresh: int  # tokens of the fresh chunks, first in the stream: their keys are their own
    slots: torch.Tensor | None  # [G] pool slots of the continuations' keys, in order
    cu_q: torch.Tensor  # [N + 1] int32 query segment offsets
    cu_k: torch.Tensor  # [N + 1] int32 key segment offsets
    max_q: int
    max_k: int
    mask: torch.Tensor | None  # [T, Tk] bool, off CUDA: query i may attend to key j


def can_flash(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `attend` runs torch's variable-length flash attention there."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and varlen.available())


def plan(chunks: list[tuple[int, int, int, list[int] | None]], *, num_tokens: int,
         device: torch.device, flash: bool) -> VarlenPlan:
    """`chunks`: (offset in the packed stream, length, first position, the pool slots of
    positions 0 .. first + length for a continuation or None for a fresh chunk), fresh ones
    first in the stream, covering `num_tokens` packed tokens. `flash`: as `can_flash` says (else
    the plan holds the mask)."""
    chunks = sorted(chunks)
    assert sum(n for _, n, _, _ in chunks) == num_tokens
    num_fresh = sum(n for _, n, _, cont in chunks if cont is None)
    assert all((cont is None) == (offset < num_fresh) for offset, _, _, cont in chunks)
    q_len = [n for _, n, _, _ in chunks]
    k_len = [n + start for _, n, start, _ in chunks]
    slots = [s for *_, cont in chunks if cont is not None for s in cont]
    mask = None
    if not flash:
        seq = np.arange(len(chunks))
        q_seq, k_seq = np.repeat(seq, q_len), np.repeat(seq, k_len)
        q_pos = np.concatenate([np.arange(s, s + n) for _, n, s, _ in chunks])
        k_pos = np.concatenate([np.arange(n) for n in k_len])
        mask = torch.from_numpy((q_seq[:, None] == k_seq[None, :])
                                & (k_pos[None, :] <= q_pos[:, None])).to(device)
    cu = torch.from_numpy(np.stack([np.cumsum([0] + q_len), np.cumsum([0] + k_len)]))
    cu = cu.to(torch.int32).to(device, non_blocking=True)
    return VarlenPlan(num_fresh=num_fresh,
                      slots=torch.tensor(slots).to(device, non_blocking=True) if slots else None,
                      cu_q=cu[0], cu_k=cu[1], max_q=max(q_len), max_k=max(k_len), mask=mask)


def attend(p: VarlenPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           scale: float, pool_kv: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (the packed stream's own), `pool_kv` the continuations' keys
    and values gathered at `p.slots` ([G, KVH, D] each) -> [T, H, D]."""
    k, v = k[:p.num_fresh], v[:p.num_fresh]
    if pool_kv is not None:
        k, v = torch.cat([k, pool_kv[0].to(k.dtype)]), torch.cat([v, pool_kv[1].to(v.dtype)])
    if p.mask is None:
        assert can_flash(q.device, q.dtype)
        return varlen.causal(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, scale=scale)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0),
                                         k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=p.mask,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
