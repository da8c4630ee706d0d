"""Turn-level advantages of agentic episodes (rltool.train.algo.multiturn) against independent
float64 references written here as plain loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rltool.train.algo.advantages import compute_advantages, gae
from rltool.train.algo.multiturn import turn_gae, turn_grpo, turn_token_rewards

EPS = 1e-6


def reference_turn_grpo(groups, turn_rewards, turn_starts, lengths, *, gamma, std_norm):
    """Plain-loop reference: G_k per turn; per (group, turn index) mean and unbiased std over the
    samples that reached it; all-equal or lone -> 0; tokens of turn k get A_k."""
    returns = []
    for tr in turn_rewards:
        g = [0.0] * len(tr)
        for k in range(len(tr)):
            g[k] = sum(gamma ** (j - k) * tr[j] for j in range(k, len(tr)))
        returns.append(g)
    out = []
    for i, (g_i, starts, n) in enumerate(zip(returns, turn_starts, lengths)):
        adv = [0.0] * n
        ends = starts[1:] + [n]
        for k in range(len(g_i)):
            peers = [returns[j][k] for j in range(len(returns))
                     if groups[j] == groups[i] and len(returns[j]) > k]
            mean = sum(peers) / len(peers)
            if max(peers) == min(peers):
                a = 0.0
            else:
                a = g_i[k] - mean
                if std_norm:
                    std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1))
                    a /= std + EPS
            for t in range(starts[k], ends[k]):
                adv[t] = a
        out.append(adv)
    return out


def random_episodes(seed, *, num_groups=3, group_size=4):
    rng = random.Random(seed)
    groups, turn_rewards, turn_starts, lengths = [], [], [], []
    for g in range(num_groups):
        for _ in range(group_size):
            turns = rng.randint(1, 4)
            starts, t = [], 0
            for _ in range(turns):
                starts.append(t)
                t += rng.randint(1, 5)
            groups.append(g)
            turn_rewards.append([rng.choice([0.0, 0.1, 0.5, 1.0]) for _ in range(turns)])
            turn_starts.append(starts)
            lengths.append(t)
    return groups, turn_rewards, turn_starts, lengths


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma, std_norm", [(1.0, True), (0.9, True), (1.0, False)])
def test_turn_grpo_matches_the_reference(seed, gamma, std_norm):
    groups, turn_rewards, turn_starts, lengths = random_episodes(seed)
    rewards = torch.tensor([sum(tr) for tr in turn_rewards], dtype=torch.float64)
    got = turn_grpo(rewards=rewards, groups=torch.tensor(groups), masks=[
        torch.ones(n, dtype=torch.int8) for n in lengths], turn_rewards=turn_rewards,
        turn_starts=turn_starts, gamma=gamma, std_normalization=std_norm)
    want = reference_turn_grpo(groups, turn_rewards, turn_starts, lengths, gamma=gamma,
                               std_norm=std_norm)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=1e-9)


def test_turn_zero_is_episode_grpo_and_single_turn_rows_fall_back():
    """Turn 0's return is the episode reward, so its advantage is GRPO's; rows without turns
    (single-turn samples) are one turn with their reward."""
    rewards = torch.tensor([1.5, 0.5, 0.0, 2.0], dtype=torch.float64)
    masks = [torch.ones(n, dtype=torch.int8) for n in (6, 4, 3, 5)]
    got = turn_grpo(rewards=rewards, groups=torch.tensor([0, 0, 0, 0]), masks=masks,
                    turn_rewards=[[0.5, 1.0], [0.5, 0.0], None, None],
                    turn_starts=[[0, 3], [0, 2], None, None])
    grpo = compute_advantages("grpo", rewards=rewards, groups=torch.tensor([0, 0, 0, 0]),
                              masks=masks)
    assert [g[0].item() for g in got] == pytest.approx([a[0].item() for a in grpo])
    assert got[2].tolist() == pytest.approx([grpo[2][0].item()] * 3)


def test_turn_token_rewards_land_on_each_turns_last_model_token():
    mask = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.int8)
    kl = torch.full((8,), 0.5, dtype=torch.float64)
    got = turn_token_rewards([1.0, 2.0, 3.0], [0, 4, 6], mask, kl, kl_coef=0.1)
    want = [-0.05, -0.05 + 1.0, 0.0, 0.0, -0.05 + 2.0, 0.0, -0.05, -0.05 + 3.0]
    assert got.tolist() == pytest.approx(want)


def test_turn_gae_with_one_turn_equals_gae():
    torch.manual_seed(0)
    values = [torch.randn(5, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    masks = [torch.ones(5, dtype=torch.int8), torch.ones(3, dtype=torch.int8)]
    rewards = torch.tensor([1.0, -0.5], dtype=torch.float64)
    a1, r1 = gae(rewards, values, masks, gamma=0.9, lambd=0.8)
    a2, r2 = turn_gae(rewards=rewards, values=values, masks=masks, turn_rewards=[None, None],
                      turn_starts=[None, None], gamma=0.9, lambd=0.8)
    for x, y in zip(a1 + r1, a2 + r2):
        assert torch.allclose(x, y)


def test_turn_gae_matches_a_plain_loop():
    values = [0.2, -0.1, 0.4, 0.3, 0.0, 0.5]
    mask = [1, 1, 0, 1, 1, 0]
    turn_rewards, starts, gamma, lambd = [0.5, 1.0], [0, 3], 0.95, 0.9
    token_r = [0.0, 0.5, 0.0, 0.0, 1.0, 0.0]  # each turn's reward on its last model token
    adv, running = [0.0] * 6, 0.0
    for t in range(5, -1, -1):
        nv = values[t + 1] if t + 1 < 6 else 0.0
        running = token_r[t] + gamma * nv - values[t] + gamma * lambd * running
        adv[t] = running
    got, ret = turn_gae(rewards=torch.tensor([1.5], dtype=torch.float64),
                        values=[torch.tensor(values, dtype=torch.float64)],
                        masks=[torch.tensor(mask, dtype=torch.int8)], turn_rewards=[turn_rewards],
                        turn_starts=[starts], gamma=gamma, lambd=lambd)
    assert got[0].tolist() == pytest.approx(adv, abs=1e-12)
    assert ret[0].tolist() == pytest.approx([a + v for a, v in zip(adv, values)], abs=1e-12)


def test_mismatched_turns_are_refused():
    with pytest.raises(ValueError, match="2 turn rewards for 1 turns"):
        turn_grpo(rewards=torch.zeros(1), groups=torch.zeros(1, dtype=torch.long),
                  masks=[torch.ones(3)], turn_rewards=[[1.0, 2.0]], turn_starts=[[0]])
