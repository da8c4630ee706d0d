"""torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`) behind one
causal call, for the torch releases whose keywords differ: causality is `is_causal` in some and a
window (-1, 0) in others, and grouped-query attention and the scale are not accepted by all (the
key/value heads are then repeated, and only the default scale runs). Used by the trainer's packed
layout (rltool.train.packed) and the engine's prefill (rltool.engine.varlen_attention)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch


@functools.cache
def kernel() -> tuple[Callable | None, frozenset[str]]:
    """torch's varlen_attn and its keywords, imported on first use: its module imports torch's
    compiler stack (about 1.4 s of start-up on a CPU), which a process that never runs it (the
    engine with grouped prefill, the front end, a CPU trainer) should not pay. (None, {}) for a
    torch without it: callers take their per-sample or masked path."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def available() -> bool:
    """Whether this torch has variable-length flash attention."""
    return kernel()[0] is not None


def repeat_kv(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """x with each head along `dim` repeated `groups` times in place (head h -> h*groups ...
    h*groups + groups - 1): `repeat_interleave`'s values, as one copy (an expanded view made
    contiguous; repeat_interleave costs several launches and index tensors per call)."""
    if groups == 1:
        return x
    shape = list(x.shape)
    expanded = x.unsqueeze(dim + 1).expand(*shape[:dim + 1], groups, *shape[dim + 1:])
    return expanded.reshape(*shape[:dim], shape[dim] * groups, *shape[dim + 1:])


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
           cu_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None
           ) -> torch.Tensor:
    """Causal attention of the packed segments: q [T, H, D], k/v [Tk, KVH, D] (KVH divides H),
    `cu_q`/`cu_k` [N + 1] int32 segment offsets on q's device; a segment's queries are its last
    keys' positions (a continuation attends to its cached prefix). -> [T, H, D]. Raises
    NotImplementedError for a non-default `scale` where this torch takes none."""
    varlen_attn, args = kernel()
    groups = q.shape[1] // k.shape[1]
    extra: dict = {"is_causal": True} if "is_causal" in args else {"window_size": (-1, 0)}
    if "enable_gqa" in args:
        extra["enable_gqa"] = groups > 1
    else:
        k, v = repeat_kv(k, groups, 1), repeat_kv(v, groups, 1)
    if "scale" in args:
        extra["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise NotImplementedError("this torch's varlen_attn takes no scale argument")
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k,
                       **extra)
