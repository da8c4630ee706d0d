"""Packed micro-batches for the torch backend (`--micro-batch-layout packed`).

The samples of a micro-batch are concatenated into one row without padding: position ids restart
at 0 for every sample, and attention stays inside each sample through the attention function
registered here with transformers (`rltool_varlen`). On CUDA in bf16/fp16 it is one call to
torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`) over the
cumulative sample offsets; elsewhere (CPU, fp32) it is one causal SDPA call per sample. A call
without offsets (a single sequence) is plain causal SDPA.

The response logprobs (and entropy, top-k) come from the decoder's last hidden states in chunks of
`chunk` rows: each chunk's logits are computed, reduced to what the loss needs and dropped, and
under autograd the chunk is checkpointed (its logits are recomputed in the backward pass), so the
full [tokens, vocab] float32 logits never exist at once. Logprobs keep rltool.logprobs'
convention (float32 log-softmax of the temperature-scaled logits).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rltool.logprobs import effective_temperature

ATTN_IMPLEMENTATION = "rltool_varlen"

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_ARGS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # torch without variable-length flash attention: the per-sample path
    varlen_attn = None
    _VARLEN_ARGS = set()


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention)
    return ATTN_IMPLEMENTATION


def _repeat_kv(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [1, H, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, H, D], None). Causal within each sample named by `cu_seq_lens_q`."""
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("the packed layout has no sliding-window attention; use "
                                  "--micro-batch-layout padded for this model")
    if attention_mask is not None:
        raise ValueError("the packed layout takes no attention mask (samples are separated by "
                         "cu_seq_lens_q)")
    if dropout:
        raise ValueError("the packed layout has no attention dropout")
    cu = kwargs.get("cu_seq_lens_q")
    total = query.shape[2]
    groups = query.shape[1] // key.shape[1]
    if cu is None:
        cu = torch.tensor([0, total], dtype=torch.int32, device=query.device)
    dtype = query.dtype
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        # Under autocast the rotary embedding leaves q and k in float32 (it follows the fp32
        # residual stream); SDPA would cast them itself, the flash kernel needs them cast.
        dtype = torch.get_autocast_dtype("cuda")
    if varlen_attn is not None and query.is_cuda and dtype in (torch.bfloat16, torch.float16):
        q = query[0].transpose(0, 1).to(dtype).contiguous()            # [T, H, D]
        k = key[0].transpose(0, 1).to(dtype).contiguous()              # [T, Hkv, D]
        v = value[0].transpose(0, 1).to(dtype).contiguous()
        # The keyword names moved between torch releases: causal is `is_causal` in some and a
        # window (-1, 0) in others; GQA and the scale are not accepted everywhere.
        extra: dict = {"is_causal": True} if "is_causal" in _VARLEN_ARGS else {
            "window_size": (-1, 0)}
        if "enable_gqa" in _VARLEN_ARGS:
            extra["enable_gqa"] = groups > 1
        else:
            k, v = _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1)
        if "scale" in _VARLEN_ARGS:
            extra["scale"] = scaling
        elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
            raise NotImplementedError("this torch's varlen_attn has no scale argument; use "
                                      "--micro-batch-layout padded for this model")
        max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
        cu32 = cu.to(torch.int32)
        out = varlen_attn(q, k, v, cu32, cu32, max_len, max_len, **extra)
        return out.unsqueeze(0), None
    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(
                query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                scale=scaling, enable_gqa=groups > 1)
            for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


@dataclass
class Packed:
    """One micro-batch as a single row."""

    ids: torch.Tensor            # [1, T]
    position_ids: torch.Tensor   # [1, T], restarting at 0 per sample
    cu_seqlens: torch.Tensor     # [N + 1] int32 sample offsets
    max_len: int
    rows: torch.Tensor           # [R] positions whose logits predict a response token
    targets: torch.Tensor        # [R] those response tokens
    response_lengths: list[int]  # per sample, summing to R


def pack(tokens: list[list[int]], response_starts: list[int], device: torch.device) -> Packed:
    lengths = [len(t) for t in tokens]
    flat = [tok for t in tokens for tok in t]
    ids = torch.tensor(flat, dtype=torch.long, device=device).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    rows = torch.cat([torch.arange(off + start - 1, off + n - 1, device=device)
                      for off, n, start in zip(offsets, lengths, response_starts)])
    return Packed(ids=ids, position_ids=position_ids,
                  cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=device),
                  max_len=max(lengths), rows=rows, targets=ids[0, rows + 1],
                  response_lengths=[n - s for n, s in zip(lengths, response_starts)])


def decoder_kwargs(p: Packed) -> dict:
    """Keyword arguments of the decoder call for a packed row."""
    return dict(input_ids=p.ids, position_ids=p.position_ids, cu_seq_lens_q=p.cu_seqlens,
                cu_seq_lens_k=p.cu_seqlens, max_length_q=p.max_len, max_length_k=p.max_len,
                use_cache=False)


def _chunk_outputs(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, temperature: float, with_entropy: bool,
                   top_k: int) -> tuple[torch.Tensor, ...]:
    logits = F.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = [logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)]
    if with_entropy:
        out.append(-(logp.exp() * logp).sum(-1))
    if top_k:
        values, ids = logp.topk(top_k, dim=-1)
        out += [values, ids]
    return tuple(out)


def response_outputs(hidden: torch.Tensor, p: Packed, lm_head: torch.nn.Linear, *,
                     temperature: float, with_entropy: bool, top_k: int,
                     chunk: int) -> dict[str, list[torch.Tensor]]:
    """Per-sample logprobs (and entropy, top-k) of the response tokens from the last hidden
    states [T, hidden] of a packed row, `chunk` rows of logits at a time."""
    temp = effective_temperature(temperature)
    h = hidden.index_select(0, p.rows)
    parts: list[tuple[torch.Tensor, ...]] = []
    for s in range(0, h.shape[0], chunk):
        args = (h[s:s + chunk], p.targets[s:s + chunk], lm_head.weight, lm_head.bias, temp,
                with_entropy, top_k)
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_outputs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_outputs(*args))
    names = ["logprobs"] + (["entropy"] if with_entropy else []) + (
        ["topk_logprobs", "topk_ids"] if top_k else [])
    return {name: list(torch.cat([part[i] for part in parts]).split(p.response_lengths))
            for i, name in enumerate(names)}
