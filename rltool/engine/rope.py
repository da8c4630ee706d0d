"""RoPE frequencies as a checkpoint's config.json asks for them: the default, `linear` and `yarn`
scaling (the one Qwen2.5 and Qwen3 use for contexts past their pretraining length), each
computed as transformers computes it (fp32, same operations), so fp32 logits match it. Other
scaling types are refused in one line at start (rltool.engine.model_spec)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rltool.errors import CheckpointError

SUPPORTED = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A config's RoPE scaling (`rope_scaling`, or transformers 5's `rope_parameters`)."""
    rope_type: str = "default"
    factor: float = 1.0
    # yarn: the pretraining context; the cos/sin attention factor (None: from factor and mscale);
    # the ramp's rotation bounds; whether the correction range is rounded outwards.
    original_max_position_embeddings: int = 0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def context_length(self, max_position_embeddings: int) -> int:
        """Positions the scaled model serves: YaRN's `factor` times the pretraining context
        (Qwen's 4 x 32768 = 131072), linear's `factor` times config.json's; never fewer than
        config.json's `max_position_embeddings`."""
        if self.rope_type == "yarn":
            scaled = self.factor * self.original_max_position_embeddings
        else:
            scaled = self.factor * max_position_embeddings
        return max(int(scaled), max_position_embeddings)


def read_rope_scaling(cfg: dict[str, Any], *, where: str) -> RopeScaling:
    """The RoPE scaling of a config.json dict; a one-line CheckpointError for a type the engine's
    model does not implement."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED:
        raise CheckpointError(f"{where}: rope scaling {rope_type!r} is not supported by the "
                              f"engine's model (supported: {', '.join(SUPPORTED)}); serve it with "
                              "--engine sglang")
    if rope_type == "default":
        return RopeScaling()
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    original = int(rope.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or max_pos)
    factor = rope.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_pos / original  # transformers' fallback (DeepSeek-V3's configs)
    if factor is None or float(factor) < 1.0:
        raise CheckpointError(f"{where}: rope scaling {rope_type!r} needs a factor >= 1, got "
                              f"{factor!r}")

    def opt(key: str) -> float | None:
        return float(rope[key]) if rope.get(key) is not None else None

    return RopeScaling(rope_type=rope_type, factor=float(factor),
                       original_max_position_embeddings=original,
                       attention_factor=opt("attention_factor"), mscale=opt("mscale"),
                       mscale_all_dim=opt("mscale_all_dim"),
                       beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1),
                       truncate=bool(rope.get("truncate", True)))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(scaling: RopeScaling, *, dim: int, theta: float
                     ) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] fp32 on CPU, attention factor): cos and sin are the usual tables of
    positions x inv_freq, times the attention factor (1 but for yarn)."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / base
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type != "yarn":
        return inv_freq, 1.0
    s = scaling
    attention = s.attention_factor
    if attention is None:
        attention = (_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else _yarn_mscale(s.factor))

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times into the pretraining context
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the pretrained frequency; 0: interpolate by `factor`
    interpolated = 1.0 / (s.factor * base)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention)
