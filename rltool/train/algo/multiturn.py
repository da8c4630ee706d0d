"""Advantages of multi-turn (agentic) episodes, as functions of tensors.

An episode's response holds K model turns, each followed by the environment's tokens (loss mask
0); turn k spans response tokens [s_k, s_{k+1}) (s = the shard's `turn_starts`, s_K = the
response length) and earned reward r_k (`turn_rewards`; the episode reward R = sum_k r_k is the
shard's `reward`). A sample without turns (a single-turn row) is one turn with r_0 = R.

- Episode level (`grpo`, `gspo`, ... on R): the estimators of advantages.py, unchanged; every
  model token of the episode gets the episode's advantage.
- Turn level (`turn_grpo`): the return of turn k is G_k = sum_{j>=k} gamma^(j-k) r_j (the
  reward from that turn onward; with gamma = 1 and no per-turn rewards, G_k = R for every k).
  Each turn is compared with the same turn of the other samples of its group:
  A_{i,k} = (G_{i,k} - mean_g G_{.,k}) / (std_g G_{.,k} + eps) over the samples of group g that
  reached turn k (advantages.group_baseline: unbiased std, a group whose returns at that turn
  are all equal, or a turn only one sample reached, gives 0). Turn 0's advantage is therefore
  the episode-level GRPO advantage; later turns are credited with what followed them only.
  Every token of turn k gets A_{i,k} (the environment's tokens among them are masked out of the
  loss anyway).
- PPO (`ppo`, a value head): `turn_token_rewards` puts r_k on the last model token of turn k
  (instead of R on the last token), minus kl_coef * kl on model tokens; `turn_gae` runs GAE
  over those token rewards. With lambda = gamma = 1 its returns equal the single-reward GAE's
  at turn 0.
"""

from __future__ import annotations

import torch

from rltool.train.algo.advantages import GRPO_EPS, gae_one, group_baseline


def turn_spans(turn_starts: list[int] | None, length: int) -> list[tuple[int, int]]:
    """[(start, end)] of each turn over a response of `length` tokens (one turn when None)."""
    starts = list(turn_starts) if turn_starts else [0]
    ends = starts[1:] + [length]
    return list(zip(starts, ends))


def turn_returns(turn_rewards: list[float], *, gamma: float) -> list[float]:
    """G_k = r_k + gamma * G_{k+1}."""
    out, running = [0.0] * len(turn_rewards), 0.0
    for k in range(len(turn_rewards) - 1, -1, -1):
        running = turn_rewards[k] + gamma * running
        out[k] = running
    return out


def turn_grpo(*, rewards: torch.Tensor, groups: torch.Tensor, masks: list[torch.Tensor],
              turn_rewards: list[list[float] | None], turn_starts: list[list[int] | None],
              gamma: float = 1.0, std_normalization: bool = True,
              eps: float = GRPO_EPS) -> list[torch.Tensor]:
    """Per-token turn-level advantages (module docstring); one tensor per sample."""
    n = len(masks)
    spans, returns = [], []
    for i in range(n):
        tr = turn_rewards[i]
        if tr is None:  # a single-turn row: one turn, its reward
            tr = [float(rewards[i])]
        spans.append(turn_spans(turn_starts[i], masks[i].numel()))
        returns.append(turn_returns(list(tr), gamma=gamma))
        if len(spans[-1]) != len(returns[-1]):
            raise ValueError(f"sample {i}: {len(returns[-1])} turn rewards for "
                             f"{len(spans[-1])} turns")
    max_turns = max((len(r) for r in returns), default=1)
    flat_values, flat_groups, where = [], [], []
    for i in range(n):
        for k, g in enumerate(returns[i]):
            flat_values.append(g)
            flat_groups.append(int(groups[i]) * max_turns + k)
            where.append((i, k))
    if not flat_values:
        return [torch.zeros(m.numel(), dtype=rewards.dtype) for m in masks]
    # Dense ids, so the per-group buffers stay as small as the number of (group, turn) pairs.
    _, dense = torch.unique(torch.tensor(flat_groups), return_inverse=True)
    adv = group_baseline(torch.tensor(flat_values, dtype=rewards.dtype), dense,
                         std_normalization=std_normalization, eps=eps)
    out = [torch.zeros(m.numel(), dtype=rewards.dtype) for m in masks]
    for (i, k), a in zip(where, adv):
        start, end = spans[i][k]
        out[i][start:end] = a
    return out


def turn_token_rewards(turn_rewards: list[float], turn_starts: list[int] | None,
                       mask: torch.Tensor, kl: torch.Tensor, *, kl_coef: float) -> torch.Tensor:
    """-kl_coef * kl on model tokens, plus r_k on the last model token of turn k (the turn's
    last token when it has no model token)."""
    out = -kl_coef * kl * mask.to(kl.dtype)
    for (start, end), r in zip(turn_spans(turn_starts, mask.numel()), turn_rewards):
        if end <= start:
            continue
        model = torch.nonzero(mask[start:end]).flatten()
        t = start + int(model[-1]) if model.numel() else end - 1
        out[t] += r
    return out


def turn_gae(*, rewards: torch.Tensor, values: list[torch.Tensor], masks: list[torch.Tensor],
             turn_rewards: list[list[float] | None], turn_starts: list[list[int] | None],
             gamma: float, lambd: float, kl: list[torch.Tensor] | None = None,
             kl_coef: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over per-turn token rewards -> (advantages, returns), not whitened."""
    advantages, returns = [], []
    for i, (v, m) in enumerate(zip(values, masks)):
        k = kl[i].to(v.dtype) if kl is not None else torch.zeros_like(v)
        tr = turn_rewards[i] if turn_rewards[i] is not None else [float(rewards[i])]
        token_rewards = turn_token_rewards(list(tr), turn_starts[i], m, k, kl_coef=kl_coef)
        adv = gae_one(v, token_rewards, gamma=gamma, lambd=lambd)
        advantages.append(adv)
        returns.append(adv + v)
    return advantages, returns


def has_turns(samples: list) -> bool:
    """Whether any sample of the set carries turns (an agentic episode)."""
    return any(getattr(s, "turn_starts", None) is not None for s in samples)


def turns_of(samples: list) -> dict[str, list]:
    """The samples' turn_rewards and turn_starts, as keyword arguments of turn_grpo / turn_gae."""
    return {"turn_rewards": [getattr(s, "turn_rewards", None) for s in samples],
            "turn_starts": [getattr(s, "turn_starts", None) for s in samples]}
