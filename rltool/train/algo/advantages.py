"""Advantage estimators of the GRPO family, as functions of tensors.

Per-sample values are 1-D tensors [N]; per-token values are ragged: one 1-D tensor per sample
(its response tokens). `groups` is a long tensor [N] of group indices (samples of one prompt share
one). Every estimator returns per-token advantages (one tensor per sample).

- grpo:  A_i = (r_i - mean_g r) / (std_g r + eps), std unbiased (torch.std, as slime); a group of
         one sample has std 0; a group whose rewards are all equal has A = 0 exactly. Without
         std normalisation (Dr.GRPO): A_i = r_i - mean_g r.
- gspo:  GRPO's advantages; the difference is the sequence-level ratio in the policy loss.
- reinforce_plus_plus: token rewards -kl_coef * kl_t, plus r_i on the last response token,
         discounted returns G_t = r_t + gamma * G_{t+1}, then whitened over all loss-masked tokens
         of the batch.
- reinforce_plus_plus_baseline: (r_i - mean_g r) - kl_coef * kl_t, whitened the same way.
- ppo:   GAE over a learned value V_t (the critic's prediction before token t): token rewards as
         reinforce_plus_plus, delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token = 0),
         A_t = delta_t + gamma * lambd * A_{t+1}; returns R_t = A_t + V_t (the value targets);
         advantages whitened over all loss-masked tokens. See `gae`.
- none:  A = 0 on every token (pure on-policy distillation: the teacher's signal is the only one,
         rltool.train.algo.opd).
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
              "none")
GRPO_EPS = 1e-6
WHITEN_EPS = 1e-8


def group_baseline(rewards: torch.Tensor, groups: torch.Tensor, *, std_normalization: bool,
                   eps: float = GRPO_EPS) -> torch.Tensor:
    """Per-sample (r - group mean), divided by (group std + eps) when `std_normalization`."""
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    counts = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, groups,
                                                                   torch.ones_like(rewards))
    sums = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, groups, rewards)
    mean = (sums / counts.clamp_min(1))[groups]
    # A group whose rewards are all equal has no spread: its centered rewards are exactly 0. The
    # float mean of equal values such as 1/3 is off by an ulp, and the std below is then of the
    # same size, so without this such a group got an advantage of 0.03-0.06 of one sign: a push
    # towards whatever it sampled that sharpened the policy until its entropy collapsed.
    lo, hi = (torch.zeros(num_groups, dtype=rewards.dtype).scatter_reduce_(
        0, groups, rewards, reduce, include_self=False) for reduce in ("amin", "amax"))
    centered = torch.where((lo == hi)[groups], torch.zeros_like(rewards), rewards - mean)
    if not std_normalization:
        return centered
    sq = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, groups, centered.square())
    # Unbiased std like torch.std; a group of one has no spread, so its std is 0.
    std = torch.where(counts > 1, (sq / (counts - 1).clamp_min(1)).sqrt(), torch.zeros_like(sq))
    return centered / (std[groups] + eps)


def broadcast_to_tokens(values: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """values[i] repeated over sample i's lengths[i] tokens (views of one tensor)."""
    return list(values.repeat_interleave(torch.tensor(lengths), output_size=sum(lengths))
                .split(lengths))


def masked_whiten(values: list[torch.Tensor], masks: list[torch.Tensor], *,
                  eps: float = WHITEN_EPS) -> list[torch.Tensor]:
    """(x - mean) / sqrt(var + eps) with mean and (biased) var over all masked tokens."""
    flat = torch.cat(values) if values else torch.zeros(0)
    mask = torch.cat(masks).to(flat.dtype) if masks else torch.zeros(0)
    count = mask.sum().clamp_min(1)
    mean = (flat * mask).sum() / count
    var = ((flat - mean).square() * mask).sum() / count
    rstd = torch.rsqrt(var + eps)
    return [(v - mean) * rstd for v in values]


def _token_rewards(reward: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *,
                   kl_coef: float) -> torch.Tensor:
    """-kl_coef * kl on masked tokens, plus the sample's reward on its last token."""
    token_rewards = -kl_coef * kl * mask.to(kl.dtype)
    if token_rewards.numel():
        token_rewards[-1] += reward.to(kl.dtype)
    return token_rewards


def gae_one(v: torch.Tensor, token_rewards: torch.Tensor, *, gamma: float,
            lambd: float) -> torch.Tensor:
    """One sample's GAE advantages from its values and per-token rewards."""
    adv = torch.empty_like(v)
    running = torch.zeros((), dtype=v.dtype)
    for t in range(v.numel() - 1, -1, -1):
        next_value = v[t + 1] if t + 1 < v.numel() else torch.zeros((), dtype=v.dtype)
        delta = token_rewards[t] + gamma * next_value - v[t]
        running = delta + gamma * lambd * running
        adv[t] = running
    return adv


def gae(rewards: torch.Tensor, values: list[torch.Tensor], masks: list[torch.Tensor], *,
        gamma: float, lambd: float, kl: list[torch.Tensor] | None = None,
        kl_coef: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation per sample -> (advantages, returns), not whitened."""
    advantages, returns = [], []
    for i, (v, m) in enumerate(zip(values, masks)):
        k = kl[i] if kl is not None else torch.zeros_like(v)
        token_rewards = _token_rewards(rewards[i], k.to(v.dtype), m, kl_coef=kl_coef)
        adv = gae_one(v, token_rewards, gamma=gamma, lambd=lambd)
        advantages.append(adv)
        returns.append(adv + v)
    return advantages, returns


def reinforce_plus_plus_returns(rewards: torch.Tensor, kl: list[torch.Tensor],
                                masks: list[torch.Tensor], *, kl_coef: float,
                                gamma: float) -> list[torch.Tensor]:
    """Discounted returns of token rewards -kl_coef*kl (masked) plus the reward on the last token."""
    out = []
    for i, (k, m) in enumerate(zip(kl, masks)):
        token_rewards = _token_rewards(rewards[i], k, m, kl_coef=kl_coef)
        returns = torch.empty_like(token_rewards)
        running = torch.zeros((), dtype=token_rewards.dtype)
        for t in range(token_rewards.numel() - 1, -1, -1):
            running = token_rewards[t] + gamma * running
            returns[t] = running
        out.append(returns)
    return out


def compute_advantages(estimator: str, *, rewards: torch.Tensor, groups: torch.Tensor,
                       masks: list[torch.Tensor], kl: list[torch.Tensor] | None = None,
                       kl_coef: float = 0.0, gamma: float = 1.0,
                       std_normalization: bool = True) -> list[torch.Tensor]:
    """Per-token advantages for `estimator` (see the module docstring); ppo: use `gae`."""
    lengths = [m.numel() for m in masks]
    if kl is None:
        kl = [torch.zeros(n, dtype=rewards.dtype) for n in lengths]
    if estimator == "none":
        return [torch.zeros(n, dtype=rewards.dtype) for n in lengths]
    if estimator in ("grpo", "gspo"):
        if kl_coef:
            raise ValueError("KL reward shaping (kl_coef) applies to reinforce_plus_plus*; "
                             "use the KL loss term with grpo/gspo")
        return broadcast_to_tokens(
            group_baseline(rewards, groups, std_normalization=std_normalization), lengths)
    if estimator == "reinforce_plus_plus":
        returns = reinforce_plus_plus_returns(rewards, kl, masks, kl_coef=kl_coef, gamma=gamma)
        return masked_whiten(returns, masks)
    if estimator == "reinforce_plus_plus_baseline":
        centered = group_baseline(rewards, groups, std_normalization=False)
        adv = [centered[i] - kl_coef * k * m.to(k.dtype)
               for i, (k, m) in enumerate(zip(kl, masks))]
        return masked_whiten(adv, masks)
    raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of "
                     f"{', '.join(ESTIMATORS)}")
