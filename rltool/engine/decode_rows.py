"""Attention of decode rows (one query token per request) over the paged KV pool, as the paged
runner runs it for decode steps and for short continued prefill chunks: the Triton split-KV kernel
on CUDA (rltool.engine.decode_attention), the torch reference on CPU, in deterministic mode on
CPU one request at a time (so a request's numbers never depend on its batch)."""

from __future__ import annotations

from typing import Any

import torch

from rltool.engine.paged import decode_attention_ref


def paged_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: torch.Tensor,
                    seq_lens: torch.Tensor, *, req_to_page: torch.Tensor, page_size: int,
                    scale: float, max_len: int, splits: int | None = None,
                    block_k: int | None = None, **sc: Any) -> Any:
    """q [B, H, D] over rows' first seq_lens cached tokens (`sc`: an FP8 cache's k/v scales).
    CUDA: Triton, `splits` ways (by default `num_splits_for` the batch), with `block_k` the
    output quantized for an FP8 o_proj where the kernel can (decode_attention's `block_k`).
    CPU: torch, `max_len` the longest sequence (a CPU model holds no FP8 weights)."""
    if q.is_cuda:
        from rltool.engine.decode_attention import decode_attention, num_splits_for

        return decode_attention(q, kc, vc, req_to_page=req_to_page, rows=rows,
                                seq_lens=seq_lens, page_size=page_size, scale=scale,
                                num_splits=splits or num_splits_for(q.shape[0], kc.shape[1]),
                                block_k=block_k, **sc)
    return decode_attention_ref(q, kc, vc, req_to_page=req_to_page, rows=rows, seq_lens=seq_lens,
                                page_size=page_size, max_len=max_len, scale=scale, **sc)


def per_request_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                          rows: torch.Tensor, seq_lens: torch.Tensor, *,
                          req_to_page: torch.Tensor, page_size: int, scale: float,
                          **sc: Any) -> torch.Tensor:
    """The torch reference for each request alone (deterministic mode on CPU)."""
    return torch.cat([
        decode_attention_ref(q[i:i + 1], kc, vc, req_to_page=req_to_page, rows=rows[i:i + 1],
                             seq_lens=seq_lens[i:i + 1], page_size=page_size,
                             max_len=int(seq_lens[i]), scale=scale, **sc)
        for i in range(q.shape[0])])
