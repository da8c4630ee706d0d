"""The megatron trainer's core attention: causal attention through torch SDPA, for the local spec.

megatron-core's local layer spec computes attention with `DotProductAttention`, which materialises
the full S x S score matrix and refuses packed sequences. `SdpaCoreAttention` takes its place in
the spec (same constructor and forward signature) and calls
`torch.nn.functional.scaled_dot_product_attention` with `is_causal=True`, so on CUDA the flash or
memory-efficient kernel runs and no S x S tensor is kept for backward.

- Padded layout `sbhd`: query [s, b, heads, d] -> one SDPA call -> [s, b, heads * d].
- Packed layout `thd` (`PackedSeqParams(qkv_format="thd")`): query [t, heads, d] holds several
  sequences back to back, delimited by `cu_seqlens_q`; rltool.train.packed.causal_varlen runs
  them (one variable-length flash call on CUDA in bf16, one causal SDPA call per sequence
  elsewhere; no token attends across a boundary) -> [t, heads * d]. No attention dropout there.
  `RowParams` carries the offsets twice: on the host for megatron's THD rotary embedding (which
  reads them with `.tolist()` in every layer) and on the device for the attention call, so no
  layer copies them to the device or waits for it.
- Rotary embedding of a packed row from tables built once per row: when `RowParams.rotary` holds
  the row's cos and sin (`rotary_tables`), the model's own RoPE is off for the pass and this
  module rotates q and k with megatron's formula (bf16 on CUDA: one Triton kernel each way,
  rltool.train.rope_kernel, instead of about ten). Megatron's THD RoPE instead slices and
  concatenates the frequencies per sample and recomputes cos and sin for q and for k in every
  layer (about 13 kernels each); the values are the same, bit for bit.
- Grouped-query attention: key/value heads are shared by `heads / groups` query heads
  (`enable_gqa`), never copied.

Context parallelism needs transformer-engine's attention (the TE spec); this module refuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _rotate_half
from megatron.core.packed_seq_params import PackedSeqParams

from rltool.errors import ConfigError
from rltool.train.packed import causal_varlen


@dataclass
class RowParams(PackedSeqParams):
    """PackedSeqParams of one packed row whose `cu_seqlens_q`/`_kv` stay on the host, plus the
    same offsets already on the attention's device (`cu_seqlens_device`) and the row's RoPE
    tables (`rotary`, from `rotary_tables`; None while the model applies its own RoPE)."""

    cu_seqlens_device: torch.Tensor | None = None
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) [T, 1, 1, rot_dim]


def rotary_tables(emb: torch.Tensor, position_ids: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's rotary frequencies `emb` [S, 1, 1, rot_dim] (its RotaryEmbedding's output) at
    a packed row's positions [T] -> (cos, sin) [T, 1, 1, rot_dim] in the activations' dtype, as
    megatron's RoPE computes them per layer (its scale factor is 1 for plain RoPE)."""
    freqs = emb.index_select(0, position_ids)
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's non-interleaved RoPE on t [T, heads, d] with precomputed tables: the same
    operations in the same order (the first rot_dim channels rotated, the rest passed)."""
    x = t.unsqueeze(1)
    rot = cos.shape[-1]
    x, rest = x[..., :rot], x[..., rot:]
    x = (x * cos) + (_rotate_half(x, False) * sin)
    return (torch.cat((x, rest), dim=-1) if rest.shape[-1] else x).squeeze(1)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` of q and of k; bf16 on CUDA as one kernel for both, with the same roundings
    (rltool.train.rope_kernel)."""
    if q.is_cuda and q.dtype == torch.bfloat16:
        from rltool.train.rope_kernel import rotary

        return rotary(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class SdpaCoreAttention(torch.nn.Module):
    """Drop-in for megatron-core's `DotProductAttention` (causal self-attention only)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if config.context_parallel_size != 1:
            raise ConfigError("--context-parallel-size > 1 needs transformer-engine attention; "
                              "install transformer-engine or use --context-parallel-size 1")
        if attn_mask_type != AttnMaskType.causal:
            raise ConfigError(f"attention mask type {attn_mask_type} is not supported (causal "
                              "only)")
        self.config = config
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, heads, s, d], k/v [b, groups, s, d] -> [b, heads, s, d]."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1])

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ConfigError("attention bias is not supported by the SDPA core attention")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if self.dropout and self.training:
                raise ConfigError("attention dropout is not supported with packed sequences; "
                                  "set attention_dropout to 0")
            cu = getattr(packed_seq_params, "cu_seqlens_device", None)
            rotary = getattr(packed_seq_params, "rotary", None)
            if rotary is not None:
                query, key = rotate_qk(query, key, *rotary)
            out = causal_varlen(query, key, value,
                                packed_seq_params.cu_seqlens_q if cu is None else cu,
                                packed_seq_params.max_seqlen_q, scale=self.softmax_scale)
            return out.reshape(out.shape[0], -1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        out = self._attend(q, k, v).permute(2, 0, 1, 3)                   # [s, b, heads, d]
        return out.reshape(out.shape[0], out.shape[1], -1)
