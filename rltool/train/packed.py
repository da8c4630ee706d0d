"""Packed micro-batches: the torch backend's `--micro-batch-layout packed`, and the row, the
attention and the logprobs of the megatron backend's THD micro-batches.

The samples of a micro-batch are concatenated into one row without padding (`pack`: built on the
host, moved in one asynchronous copy): position ids restart at 0 for every sample, and attention
stays inside each sample (`causal_varlen`; for transformers through the attention function
registered here, `rltool_varlen`). On CUDA in bf16/fp16 it is one call to torch's
variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`) over the cumulative
sample offsets; elsewhere (CPU, fp32) it is one causal SDPA call per sample. A call without
offsets (a single sequence) is plain causal SDPA.

The response logprobs (and entropy, top-k) come from the decoder's last hidden states in chunks of
`chunk` rows: each chunk's logits are computed (by the caller's LM head), reduced to what the loss
needs and dropped, and under autograd the chunk is checkpointed (its logits are recomputed in the
backward pass), so the full [tokens, vocab] float32 logits never exist at once. Logprobs keep
rltool.logprobs' convention (float32 log-softmax of the temperature-scaled logits).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rltool.errors import ConfigError
from rltool import varlen
from rltool.logprobs import effective_temperature
from rltool.train.backend import output_names, token_outputs

ATTN_IMPLEMENTATION = "rltool_varlen"
LogitsOf = Callable[[torch.Tensor], torch.Tensor]



def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention)
    return ATTN_IMPLEMENTATION


def has_linear_attention(model_dir: str | os.PathLike) -> bool:
    """Whether config.json's layer_types name linear-attention (GDN) layers (qwen3_5 hybrids)."""
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config = config.get("text_config", config)
    return "linear_attention" in (config.get("layer_types") or [])


def hybrid_layout(model_dir: str | os.PathLike, layout: str) -> str | None:
    """The layout of a model with linear-attention (recurrent) layers: "padded" for `auto` and
    `padded`; None for a model without them. `packed` and `shared_prompt` are refused: a GDN
    layer runs one recurrence along the whole row, so samples packed or responses sharing a
    row would leak state into each other (neither the attention mask nor the sample offsets
    reach transformers' torch GDN path, which has no per-sequence state reset)."""
    if not has_linear_attention(model_dir):
        return None
    if layout in ("packed", "shared_prompt"):
        raise ConfigError(f"--micro-batch-layout {layout} is not supported for a model with "
                          "linear-attention layers (its recurrent state would cross samples); "
                          "use padded or auto")
    return "padded"


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
    if cu is None:
        cu = torch.tensor([0, total], dtype=torch.int32, device=query.device)
    dtype = query.dtype
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        # Under autocast the rotary embedding leaves q and k in float32 (it follows the fp32
        # residual stream); SDPA would cast them itself, the flash kernel needs them cast.
        dtype = torch.get_autocast_dtype("cuda")
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # [T, H(kv), D]
    out = causal_varlen(q, k, v, cu, kwargs.get("max_length_q"), scale=scaling)
    return out.unsqueeze(0), None


def causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                  max_len: int | None, *, scale: float | None) -> torch.Tensor:
    """Causal attention within each sample of a packed row: q [T, H, D], k/v [T, Hkv, D] (Hkv
    divides H: grouped-query attention), `cu` [N + 1] the sample offsets (int32 on q's device, or
    on the CPU: then the per-sample path reads them without a device sync) -> [T, H, D].
    On CUDA in bf16/fp16: one variable-length flash call (no host sync when `max_len` is given);
    elsewhere one causal SDPA call per sample."""
    groups = q.shape[1] // k.shape[1]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and varlen.available():
        cu32 = cu.to(device=q.device, dtype=torch.int32, non_blocking=True)
        if max_len is None:
            max_len = int((cu32[1:] - cu32[:-1]).max())
        try:
            return varlen.causal(q, k, v, cu32, cu32, max_len, max_len, scale=scale)
        except NotImplementedError as e:
            raise NotImplementedError(f"{e}; use --micro-batch-layout padded for this model"
                                      ) from e
    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(
                *(x[s:e].transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=True,
                scale=scale, enable_gqa=groups > 1)[0].transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


@dataclass
class Packed:
    """One micro-batch as a single row."""

    ids: torch.Tensor            # [1, T]
    position_ids: torch.Tensor   # [1, T], restarting at 0 per sample
    cu_seqlens: torch.Tensor     # [N + 1] int32 sample offsets
    cu_seqlens_host: torch.Tensor  # the same on the CPU (pinned on CUDA): read without a sync
    max_len: int
    rows: torch.Tensor           # [R] positions whose logits predict a response token
    targets: torch.Tensor        # [R] those response tokens
    response_lengths: list[int]  # per sample, summing to R


def pack(tokens: list[list[int]], response_starts: list[int], device: torch.device) -> Packed:
    """Build the row on the host and move it in one copy (pinned and asynchronous on CUDA, so
    packing never waits for the device to drain)."""
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.long)
    starts = torch.tensor(response_starts, dtype=torch.long)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    total = int(offsets[-1])
    ids = torch.tensor([tok for t in tokens for tok in t], dtype=torch.long)
    position_ids = torch.arange(total) - offsets[:-1].repeat_interleave(lengths)
    # response rows: position (offset + j - 1) predicts token j, for j from the response start
    kept = position_ids >= starts.repeat_interleave(lengths) - 1
    kept &= position_ids < (lengths - 1).repeat_interleave(lengths)
    rows = torch.arange(total)[kept]
    host = torch.cat([ids, position_ids, rows, offsets])
    cu_host = offsets.to(torch.int32)
    if device.type == "cuda":
        host, cu_host = host.pin_memory(), cu_host.pin_memory()
    flat = host.to(device, non_blocking=True)
    n = rows.numel()
    ids_d = flat[:total].unsqueeze(0)
    rows_d = flat[2 * total:2 * total + n]
    return Packed(ids=ids_d, position_ids=flat[total:2 * total].unsqueeze(0),
                  cu_seqlens=flat[2 * total + n:].to(torch.int32),
                  cu_seqlens_host=cu_host, max_len=int(lengths.max()),
                  rows=rows_d, targets=ids_d[0, rows_d + 1],
                  response_lengths=(lengths - starts).tolist())


def decoder_kwargs(p: Packed) -> dict:
    """Keyword arguments of the decoder call for a packed row."""
    return dict(input_ids=p.ids, position_ids=p.position_ids, cu_seq_lens_q=p.cu_seqlens,
                cu_seq_lens_k=p.cu_seqlens, max_length_q=p.max_len, max_length_k=p.max_len,
                use_cache=False)


def _chunk_outputs(hidden: torch.Tensor, targets: torch.Tensor, logits_of: LogitsOf,
                   temperature: float, with_entropy: bool, top_k: int
                   ) -> tuple[torch.Tensor, ...]:
    return token_outputs(logits_of(hidden), targets, temperature=temperature,
                         with_entropy=with_entropy, top_k=top_k)


def response_outputs(hidden: torch.Tensor, p: Packed, logits_of: LogitsOf, *,
                     temperature: float, with_entropy: bool, top_k: int,
                     chunk: int) -> dict[str, list[torch.Tensor]]:
    """Per-sample logprobs (and entropy, top-k) of the response tokens from the last hidden
    states [T, hidden] of a packed row, `chunk` rows of logits at a time; `logits_of` maps
    hidden rows [r, hidden] to their logits over the full vocabulary [r, V] (the LM head)."""
    temp = effective_temperature(temperature)
    h = hidden.index_select(0, p.rows)
    parts: list[tuple[torch.Tensor, ...]] = []
    for s in range(0, h.shape[0], chunk):
        args = (h[s:s + chunk], p.targets[s:s + chunk], logits_of, temp, with_entropy, top_k)
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_outputs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_outputs(*args))
    names = output_names(with_entropy=with_entropy, top_k=top_k)
    return {name: list(torch.cat([part[i] for part in parts]).split(p.response_lengths))
            for i, name in enumerate(names)}
