"""Policy-gradient and SFT losses, entropy, and loss aggregation, as functions of tensors.

Losses are per token; aggregation turns them into one scalar through per-token weights computed
once for the whole global batch (`aggregation_weights`), so the result does not depend on how the
batch is split into micro-batches or data-parallel ranks: loss = sum over tokens of w_t * l_t.

- token:    w_t = m_t / (masked tokens in the batch)                  (DAPO / verl "token-mean")
- sequence: w_t = m_t / (masked tokens of its sample) / (samples)     (slime's default, GRPO paper)
- group:    w_t = m_t / (masked tokens of its group) / (groups)       (every prompt weighs the same)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltool.logprobs import scaled_logits

AGGREGATIONS = ("token", "sequence", "group")


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor      # per-token clipped surrogate loss
    clipped: torch.Tensor   # per-token 1.0 where the clip was active (slime's pg_clipfrac)
    ppo_kl: torch.Tensor    # per-token old - new log-prob (sequence mean for gspo)


def policy_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, *, eps_clip: float,
                eps_clip_high: float | None = None,
                eps_clip_c: float | None = None) -> PolicyLossOutput:
    """PPO clipped surrogate with asymmetric clip and optional dual clip (slime's formula).

    `log_ratio` = log pi - log pi_old per token (`gspo_log_ratio` for the sequence-level ratio).
    Dual clip (Ye et al. 2020): for negative advantages the loss is capped at -c * A, c > 1.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = log_ratio.exp()
    loss1 = -ratio * advantages
    loss2 = -ratio.clamp(1.0 - eps_clip, 1.0 + high) * advantages
    clipped_loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).to(log_ratio.dtype)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"dual clip c must be > 1, got {eps_clip_c}")
        loss3 = -eps_clip_c * advantages
        clipped_loss = torch.where(advantages < 0, torch.minimum(loss3, clipped_loss),
                                   clipped_loss)
    return PolicyLossOutput(loss=clipped_loss, clipped=clipped, ppo_kl=-log_ratio)


@dataclass
class ValueLossOutput:
    loss: torch.Tensor      # per-token 0.5 * max((V - R)^2, (V_clipped - R)^2)
    clipped: torch.Tensor   # per-token 1.0 where the clipped term was the larger one


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
               value_clip: float) -> ValueLossOutput:
    """PPO's clipped value loss (slime's compute_value_loss): the prediction may move at most
    `value_clip` from the old value before the clipped term takes over."""
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss1 = (values - returns).square()
    loss2 = (clipped_values - returns).square()
    return ValueLossOutput(loss=0.5 * torch.maximum(loss1, loss2),
                           clipped=(loss2 > loss1).to(values.dtype))


def gspo_log_ratio(logprobs: list[torch.Tensor], old_logprobs: list[torch.Tensor],
                   masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """GSPO's sequence-level log ratio: masked mean of (new - old) over each sample's tokens,
    broadcast to its tokens (gradients flow through every token of the sequence)."""
    out = []
    for lp, old, m in zip(logprobs, old_logprobs, masks):
        mf = m.to(lp.dtype)
        mean = ((lp - old) * mf).sum() / mf.sum().clamp_min(1)
        out.append(mean.expand(lp.numel()))
    return out


def entropy_from_logits(logits: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dim, in float32."""
    logp = torch.log_softmax(scaled_logits(logits, temperature=temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def aggregation_weights(masks: list[torch.Tensor], groups: torch.Tensor | None, *,
                        mode: str) -> list[torch.Tensor]:
    """Per-token weights (float32, zero where the mask is 0) for `mode` (module docstring)."""
    if mode == "token":  # one division over the batch's tokens (the same bits per token)
        flat = torch.cat(masks).to(torch.float32) if masks else torch.zeros(0)
        return list((flat / max(float(flat.sum(dtype=torch.float64)), 1.0))
                    .split([m.numel() for m in masks]))
    fmasks = [m.to(torch.float32) for m in masks]
    if mode == "sequence":
        n = len(fmasks)
        return [m / max(float(m.sum()), 1.0) / max(n, 1) for m in fmasks]
    if mode == "group":
        if groups is None:
            raise ValueError("group aggregation needs group ids")
        per_group: dict[int, float] = {}
        for g, m in zip(groups.tolist(), fmasks):
            per_group[g] = per_group.get(g, 0.0) + float(m.sum())
        num_groups = len(per_group)
        return [m / max(per_group[g], 1.0) / max(num_groups, 1)
                for g, m in zip(groups.tolist(), fmasks)]
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")


def weighted_sum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_t w_t * v_t: a micro-batch's share of an aggregated loss or metric."""
    return (values * weights.to(values.dtype)).sum()


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of the targets: -log p(target). Aggregate with the weights above."""
    return -logprobs
