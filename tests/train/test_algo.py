"""GRPO-family algorithms against independent float64 references written with plain loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rltool.train.algo.advantages import compute_advantages
from rltool.train.algo.kl import approx_kl
from rltool.train.algo.losses import (aggregation_weights, entropy_from_logits, gspo_log_ratio,
                                      policy_loss)
from rltool.train.lr import lr_at


def _ragged(rng: random.Random, lengths: list[int], *, lo: float = -2.0, hi: float = 0.0):
    return [[rng.uniform(lo, hi) for _ in range(n)] for n in lengths]


def _masks(rng: random.Random, lengths: list[int]):
    return [[1 if rng.random() > 0.25 else 0 for _ in range(n)] for n in lengths]


def _t(rows):
    return [torch.tensor(r, dtype=torch.float64) for r in rows]


GROUPS = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]  # group 3 has one sample
REWARDS = [1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 1.0, 0.25, 0.0, 0.7]
LENGTHS = [3, 1, 4, 2, 5, 3, 3, 1, 2, 4]


@pytest.mark.parametrize("std_norm", [True, False])
@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_grpo_advantages(estimator, std_norm):
    ref = []
    for i, r in enumerate(REWARDS):
        members = [REWARDS[j] for j in range(len(REWARDS)) if GROUPS[j] == GROUPS[i]]
        mean = sum(members) / len(members)
        value = r - mean
        if std_norm:
            n = len(members)
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1)) if n > 1 else 0.0
            value = value / (std + 1e-6)
        ref.append([value] * LENGTHS[i])
    masks = [torch.ones(n) for n in LENGTHS]
    got = compute_advantages(estimator, rewards=torch.tensor(REWARDS, dtype=torch.float64),
                             groups=torch.tensor(GROUPS), masks=masks,
                             std_normalization=std_norm)
    for g, r in zip(got, ref):
        assert g.tolist() == pytest.approx(r, abs=1e-9)
    assert got[-1].abs().max() == 0  # a group of one has no baseline signal



@pytest.mark.parametrize("std_norm", [True, False])
@pytest.mark.parametrize("reward", [1 / 3, 2 / 3, 0.1, 0.7])
def test_a_group_of_equal_rewards_has_no_advantage(reward, std_norm):
    """Bug: the float32 mean of eight equal rewards such as 1/3 is off by an ulp and the std is
    then of that size, so a group whose samples all scored the same got an advantage of
    0.03-0.06, of one sign for the whole group: a push towards whatever it sampled that collapsed
    the CPU demo's entropy and, for one seed, its reward to zero. Equal rewards give exactly 0
    (and a group with spread keeps its advantages)."""
    rewards = torch.tensor([reward] * 8 + [0.0, 1.0], dtype=torch.float32)
    groups = torch.tensor([0] * 8 + [1, 1])
    got = compute_advantages("grpo", rewards=rewards, groups=groups,
                             masks=[torch.ones(2)] * 10, std_normalization=std_norm)
    assert all(g.abs().max() == 0 for g in got[:8])
    spread = 1 / (math.sqrt(0.5) + 1e-6) * 0.5 if std_norm else 0.5
    assert got[9].tolist() == pytest.approx([spread] * 2) and got[8].tolist() == pytest.approx(
        [-spread] * 2)

def _whiten(values, masks):
    flat = [v for vs, ms in zip(values, masks) for v, m in zip(vs, ms) if m]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / len(flat)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in vs] for vs in values]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(gamma):
    rng = random.Random(1)
    kl = _ragged(rng, LENGTHS, lo=-0.3, hi=0.3)
    masks = _masks(rng, LENGTHS)
    coef = 0.1
    returns = []
    for i, n in enumerate(LENGTHS):
        token_rewards = [-coef * kl[i][t] * masks[i][t] for t in range(n)]
        token_rewards[-1] += REWARDS[i]
        out, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            running = token_rewards[t] + gamma * running
            out[t] = running
        returns.append(out)
    ref = _whiten(returns, masks)
    got = compute_advantages("reinforce_plus_plus", rewards=torch.tensor(REWARDS, dtype=torch.float64),
                             groups=torch.tensor(GROUPS), masks=[torch.tensor(m) for m in masks],
                             kl=_t(kl), kl_coef=coef, gamma=gamma)
    for g, r in zip(got, ref):
        assert g.tolist() == pytest.approx(r, abs=1e-9)


def test_reinforce_plus_plus_baseline():
    rng = random.Random(2)
    kl = _ragged(rng, LENGTHS, lo=-0.3, hi=0.3)
    masks = _masks(rng, LENGTHS)
    coef = 0.05
    raw = []
    for i, n in enumerate(LENGTHS):
        members = [REWARDS[j] for j in range(len(REWARDS)) if GROUPS[j] == GROUPS[i]]
        base = REWARDS[i] - sum(members) / len(members)
        raw.append([base - coef * kl[i][t] * masks[i][t] for t in range(n)])
    ref = _whiten(raw, masks)
    got = compute_advantages("reinforce_plus_plus_baseline",
                             rewards=torch.tensor(REWARDS, dtype=torch.float64),
                             groups=torch.tensor(GROUPS), masks=[torch.tensor(m) for m in masks],
                             kl=_t(kl), kl_coef=coef)
    for g, r in zip(got, ref):
        assert g.tolist() == pytest.approx(r, abs=1e-9)


def test_kl_reward_shaping_refused_for_grpo():
    with pytest.raises(ValueError, match="reinforce_plus_plus"):
        compute_advantages("grpo", rewards=torch.zeros(2), groups=torch.zeros(2, dtype=torch.long),
                           masks=[torch.ones(1)] * 2, kl_coef=0.1)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
def test_approx_kl(kl_type):
    rng = random.Random(3)
    lp = [rng.uniform(-15, 0) for _ in range(50)]
    ref_lp = [rng.uniform(-15, 0) for _ in range(50)]
    want = []
    for a, b in zip(lp, ref_lp):
        r = a - b
        if kl_type == "k1":
            want.append(r)
        elif kl_type == "k2":
            want.append(r * r / 2)
        else:
            k3 = math.exp(-r) - 1 + r
            want.append(min(max(k3, -10), 10) if kl_type == "low_var_kl" else k3)
    got = approx_kl(torch.tensor(lp, dtype=torch.float64), torch.tensor(ref_lp, dtype=torch.float64),
                    kl_type=kl_type)
    assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("eps_high,dual_c", [(None, None), (0.28, None), (0.28, 3.0)])
def test_policy_loss(eps_high, dual_c):
    rng = random.Random(4)
    n = 400
    log_ratio = [rng.uniform(-1.5, 1.5) for _ in range(n)]
    adv = [rng.uniform(-2, 2) for _ in range(n)]
    eps, high = 0.2, eps_high if eps_high is not None else 0.2
    want_loss, want_clip = [], []
    for lr_, a in zip(log_ratio, adv):
        ratio = math.exp(lr_)
        l1 = -ratio * a
        l2 = -min(max(ratio, 1 - eps), 1 + high) * a
        loss = max(l1, l2)
        want_clip.append(1.0 if l2 > l1 else 0.0)
        if dual_c is not None and a < 0:
            loss = min(loss, -dual_c * a)
        want_loss.append(loss)
    out = policy_loss(torch.tensor(log_ratio, dtype=torch.float64),
                      torch.tensor(adv, dtype=torch.float64), eps_clip=eps,
                      eps_clip_high=eps_high, eps_clip_c=dual_c)
    assert out.loss.tolist() == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    assert out.clipped.tolist() == want_clip
    assert out.ppo_kl.tolist() == pytest.approx([-x for x in log_ratio])
    if dual_c is not None:
        assert any(a < 0 and w == -dual_c * a for w, a in zip(want_loss, adv))  # dual clip active


def test_gspo_sequence_ratio_and_gradient():
    rng = random.Random(5)
    lengths = [3, 5, 1]
    new, old, masks = _ragged(rng, lengths), _ragged(rng, lengths), _masks(rng, lengths)
    masks[2] = [0]
    want = []
    for lp, o, m in zip(new, old, masks):
        count = sum(m)
        mean = sum((a - b) * k for a, b, k in zip(lp, o, m)) / max(count, 1)
        want.append([mean] * len(lp))
    new_t = [t.requires_grad_() for t in _t(new)]
    got = gspo_log_ratio(new_t, _t(old), [torch.tensor(m) for m in masks])
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=1e-12)
    got[0].sum().backward()  # d(mean)/d(lp_t) = m_t / count, for each of the L broadcast copies
    count = sum(masks[0])
    assert new_t[0].grad.tolist() == pytest.approx([len(new[0]) * m / count for m in masks[0]])


@pytest.mark.parametrize("mode", ["token", "sequence", "group"])
def test_aggregation_weights(mode):
    rng = random.Random(6)
    masks = _masks(rng, LENGTHS)
    values = _ragged(rng, LENGTHS, lo=-1, hi=1)
    if mode == "token":
        total = sum(sum(m) for m in masks)
        want = sum(v * m for vs, ms in zip(values, masks) for v, m in zip(vs, ms)) / total
    elif mode == "sequence":
        want = sum(sum(v * m for v, m in zip(vs, ms)) / max(sum(ms), 1)
                   for vs, ms in zip(values, masks)) / len(values)
    else:
        groups = sorted(set(GROUPS))
        want = 0.0
        for g in groups:
            idx = [i for i in range(len(GROUPS)) if GROUPS[i] == g]
            tokens = sum(sum(masks[i]) for i in idx)
            want += sum(v * m for i in idx for v, m in zip(values[i], masks[i])) / max(tokens, 1)
        want /= len(groups)
    weights = aggregation_weights([torch.tensor(m) for m in masks], torch.tensor(GROUPS), mode=mode)
    got = sum(float((w.double() * v).sum()) for w, v in zip(weights, _t(values)))
    assert got == pytest.approx(want, rel=1e-6)
    # Split anywhere (micro-batches, ranks): the parts add up to the same aggregate.
    part1 = sum(float((w.double() * v).sum()) for w, v in zip(weights[:4], _t(values[:4])))
    part2 = sum(float((w.double() * v).sum()) for w, v in zip(weights[4:], _t(values[4:])))
    assert part1 + part2 == pytest.approx(want, rel=1e-6)


def test_entropy_from_logits():
    rng = random.Random(7)
    logits = [[rng.uniform(-3, 3) for _ in range(7)] for _ in range(4)]
    temperature = 0.7
    want = []
    for row in logits:
        scaled = [x / temperature for x in row]
        z = max(scaled)
        lse = z + math.log(sum(math.exp(x - z) for x in scaled))
        want.append(-sum(math.exp(x - lse) * (x - lse) for x in scaled))
    got = entropy_from_logits(torch.tensor(logits, dtype=torch.float64), temperature=temperature)
    assert got.tolist() == pytest.approx(want, rel=1e-5)


def test_lr_schedule():
    assert [lr_at(s, lr=1.0, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_at(s, lr=1.0, min_lr=0.1, warmup_steps=2, decay_style="cosine", decay_steps=4)
           for s in range(8)]
    want = [0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * min(k / 4, 1))) for k in range(6)]
    assert cos == pytest.approx(want)


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95)])
def test_gae(gamma, lambd):
    from rltool.train.algo.advantages import gae

    rng = random.Random(8)
    values = _ragged(rng, LENGTHS, lo=-1, hi=1)
    kl = _ragged(rng, LENGTHS, lo=-0.3, hi=0.3)
    masks = _masks(rng, LENGTHS)
    coef = 0.1
    want_adv, want_ret = [], []
    for i, n in enumerate(LENGTHS):
        r = [-coef * kl[i][t] * masks[i][t] for t in range(n)]
        r[-1] += REWARDS[i]
        adv, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_value = values[i][t + 1] if t + 1 < n else 0.0
            running = r[t] + gamma * next_value - values[i][t] + gamma * lambd * running
            adv[t] = running
        want_adv.append(adv)
        want_ret.append([a + v for a, v in zip(adv, values[i])])
    adv, ret = gae(torch.tensor(REWARDS, dtype=torch.float64), _t(values),
                   [torch.tensor(m) for m in masks], gamma=gamma, lambd=lambd, kl=_t(kl),
                   kl_coef=coef)
    for g, w in zip(adv, want_adv):
        assert g.tolist() == pytest.approx(w, abs=1e-9)
    for g, w in zip(ret, want_ret):
        assert g.tolist() == pytest.approx(w, abs=1e-9)


def test_value_loss():
    from rltool.train.algo.losses import value_loss

    rng = random.Random(9)
    n, clip = 300, 0.2
    v = [rng.uniform(-2, 2) for _ in range(n)]
    old = [x + rng.uniform(-0.5, 0.5) for x in v]
    ret = [rng.uniform(-2, 2) for _ in range(n)]
    want, want_clip = [], []
    for x, o, r in zip(v, old, ret):
        clipped = o + min(max(x - o, -clip), clip)
        l1, l2 = (x - r) ** 2, (clipped - r) ** 2
        want.append(0.5 * max(l1, l2))
        want_clip.append(1.0 if l2 > l1 else 0.0)
    out = value_loss(torch.tensor(v, dtype=torch.float64), torch.tensor(old, dtype=torch.float64),
                     torch.tensor(ret, dtype=torch.float64), value_clip=clip)
    assert out.loss.tolist() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert out.clipped.tolist() == want_clip and 0 < sum(want_clip) < n
