"""rltool's SDPA core attention for megatron's local spec against a float64 softmax reference:
padded (sbhd) and packed (thd) layouts, grouped KV heads, no attention across packed samples."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rltool.errors import ConfigError
from rltool.train.megatron_attention import (RowParams, SdpaCoreAttention, apply_rotary,
                                            rotary_tables)

HEADS, GROUPS, DIM = 4, 2, 8


def _attention(cp: int = 1) -> SdpaCoreAttention:
    from megatron.core.transformer.enums import AttnMaskType

    config = SimpleNamespace(context_parallel_size=cp, kv_channels=DIM, attention_dropout=0.0)
    return SdpaCoreAttention(config, 1, AttnMaskType.causal, "self")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [s, heads, d], k/v [s, groups, d] -> [s, heads * d], causal, in float64."""
    q, k, v = (x.double() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    s = q.shape[0]
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)


def _qkv(s: int, b: int | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shape = (s,) if b is None else (s, b)
    return (torch.randn(*shape, HEADS, DIM, generator=g),
            torch.randn(*shape, GROUPS, DIM, generator=g),
            torch.randn(*shape, GROUPS, DIM, generator=g))


def test_padded_layout_matches_reference():
    q, k, v = _qkv(7, b=2)
    out = _attention()(q, k, v, None)
    assert out.shape == (7, 2, HEADS * DIM)
    for b in range(2):
        want = _reference(q[:, b], k[:, b], v[:, b])
        assert torch.allclose(out[:, b].double(), want, atol=1e-6)


def test_packed_layout_attends_within_each_sample_only():
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [3, 5, 1]
    q, k, v = _qkv(sum(lengths), seed=1)
    bounds = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=5, max_seqlen_kv=5)
    out = _attention()(q, k, v, None, packed_seq_params=params)
    assert out.shape == (9, HEADS * DIM)
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        want = _reference(q[start:end], k[start:end], v[start:end])
        assert torch.allclose(out[start:end].double(), want, atol=1e-6)


def test_row_params_attend_with_the_offsets_already_on_the_device():
    """RowParams' host offsets are for megatron's rotary embedding; the attention call takes the
    device copy (here a different split, to tell which one it read)."""
    q, k, v = _qkv(9, seed=2)
    host = torch.tensor([0, 9], dtype=torch.int32)
    device = torch.tensor([0, 4, 9], dtype=torch.int32)
    params = RowParams(qkv_format="thd", cu_seqlens_q=host, cu_seqlens_kv=host, max_seqlen_q=9,
                       max_seqlen_kv=9, cu_seqlens_device=device)
    out = _attention()(q, k, v, None, packed_seq_params=params)
    for start, end in ((0, 4), (4, 9)):
        want = _reference(q[start:end], k[start:end], v[start:end])
        assert torch.allclose(out[start:end].double(), want, atol=1e-6)


def test_context_parallelism_is_refused():
    with pytest.raises(ConfigError, match="context-parallel-size"):
        _attention(cp=2)


@pytest.mark.parametrize("rot_dim", [DIM, DIM // 2])
def test_row_rotary_tables_match_megatron_s_thd_rope_bit_for_bit(rot_dim):
    """The tables built once per row and applied in the core attention give exactly what
    megatron's THD RoPE computes per layer (per-sample frequency slices, cos/sin per call)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    lengths = [3, 5, 1]
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(5, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    cos, sin = rotary_tables(emb, positions, torch.float32)
    cp = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    for t in _qkv(9, seed=3)[:2]:
        want = _apply_rotary_pos_emb_thd(t, cu, emb, cp_group=cp)
        assert torch.equal(apply_rotary(t, cos, sin), want)


def rope_kernel_matches_torch() -> None:
    """rltool.train.rope_kernel (q and k in one launch) against apply_rotary's torch operations
    on the CPU, forward and backward, bf16: q and k as strided views of one fused projection, a
    partial rotary width, token counts that end mid-block. Runs on the GPU when there is one, else in Triton's interpreter."""
    from rltool.train.rope_kernel import rotary

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    for tokens, heads, dim, rot in [(37, 3, 16, 16), (20, 2, 24, 16), (5, 4, 128, 128)]:
        fused = torch.randn(tokens, 2 * heads + 1, dim, generator=g).bfloat16()  # q, k, v views
        positions = torch.randint(0, 4096, (tokens,), generator=g)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        cos, sin = rotary_tables(emb, positions, torch.bfloat16)
        grads = [torch.randn(tokens, n, dim, generator=g).bfloat16() for n in (heads, 1)]
        ref_in = [fused[:, :heads].clone().requires_grad_(True),
                  fused[:, heads:heads + 1].clone().requires_grad_(True)]
        refs = [apply_rotary(x, cos, sin) for x in ref_in]
        torch.autograd.backward(refs, grads)
        x = fused.to(dev).requires_grad_(True)
        outs = rotary(x[:, :heads], x[:, heads:heads + 1], cos.to(dev), sin.to(dev))
        torch.autograd.backward(outs, [t.to(dev) for t in grads])
        case = (tokens, heads, dim, rot)
        assert all(torch.equal(o.cpu(), r) for o, r in zip(outs, refs)), case
        assert torch.equal(x.grad[:, :heads].cpu(), ref_in[0].grad), case
        assert torch.equal(x.grad[:, heads:heads + 1].cpu(), ref_in[1].grad), case
        assert not x.grad[:, heads + 1:].any()


def test_rope_kernel_matches_megatron_s_rope_bit_for_bit():
    if torch.cuda.is_available():
        rope_kernel_matches_torch()
        return
    # Triton picks interpreted or compiled once per process: a child started interpreted
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", "from tests.train.test_megatron_attention import "
         "rope_kernel_matches_torch as check; check()"],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
