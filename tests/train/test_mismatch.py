"""Mismatch correction vs independent float64 references written with plain Python loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rltool.train.algo.mismatch import (icepop_weights, importance_ratio, mismatch_kl,
                                        rejection_mask, rollout_correction,
                                        train_rollout_logprob_abs_diff, tis_weights)

B, T = 5, 9


def _batch(seed: int):
    """Padded [B, T] logprobs with ragged masks; row 3 has no masked token; garbage at padding."""
    rng = random.Random(seed)
    old, rollout, mask = [], [], []
    for b in range(B):
        n = 0 if b == 3 else rng.randint(1, T)
        row_old, row_roll, row_mask = [], [], []
        for t in range(T):
            m = 1 if t < n and rng.random() < 0.85 else 0
            lo = -rng.uniform(0.01, 4.0)
            # Mismatch mostly small, sometimes large, so every band is crossed.
            ro = lo + (rng.gauss(0.0, 0.15) if rng.random() < 0.7 else rng.uniform(-1.5, 1.5))
            if not m:
                # Must never be read: finite garbage, inf and NaN at padding.
                lo, ro = rng.choice([30.0, -30.0, math.inf, math.nan]), -math.inf
            row_old.append(lo)
            row_roll.append(ro)
            row_mask.append(m)
        old.append(row_old)
        rollout.append(row_roll)
        mask.append(row_mask)
    return old, rollout, mask


def _t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def _clamp_exp(x):
    return math.exp(max(-20.0, min(20.0, x)))


def _ref_level_ratio(old, rollout, mask, level):
    out = []
    for b in range(B):
        diffs = [old[b][t] - rollout[b][t] for t in range(T) if mask[b][t]]
        row = []
        for t in range(T):
            if not mask[b][t]:
                row.append(0.0)
            elif level == "token":
                row.append(_clamp_exp(old[b][t] - rollout[b][t]))
            elif level == "sequence":
                row.append(_clamp_exp(sum(diffs)))
            else:
                row.append(_clamp_exp(sum(diffs) / len(diffs)))
        out.append(row)
    return out


def _close(actual: torch.Tensor, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_importance_ratio_levels(level):
    old, rollout, mask = _batch(0)
    _close(importance_ratio(_t(old), _t(rollout), _t(mask), level=level),
           _ref_level_ratio(old, rollout, mask, level))


@pytest.mark.parametrize("mode,low,high", [("truncate", 0.0, 2.0), ("clip", 0.5, 1.5)])
@pytest.mark.parametrize("level", ["token", "geometric"])
def test_tis_weights(mode, low, high, level):
    old, rollout, mask = _batch(1)
    ratio = _ref_level_ratio(old, rollout, mask, level)
    expected = [[(min(max(ratio[b][t], low if mode == "clip" else 0.0), high) if mask[b][t]
                  else 0.0) for t in range(T)] for b in range(B)]
    got = tis_weights(_t(old), _t(rollout), _t(mask), mode=mode, level=level, clip_low=0.7 if
                      mode == "truncate" else low, clip_high=high)  # truncate ignores clip_low
    _close(got, expected)


def test_icepop_weights():
    old, rollout, mask = _batch(2)
    expected = []
    for b in range(B):
        row = []
        for t in range(T):
            r = math.exp(old[b][t] - rollout[b][t]) if mask[b][t] else 0.0
            row.append(r if mask[b][t] and 0.5 <= r <= 2.0 else 0.0)
        expected.append(row)
    got = icepop_weights(_t(old), _t(rollout), _t(mask), low=0.5, high=2.0)
    _close(got, expected)
    assert 0 < int((got == 0).sum()) - sum(1 for row in mask for m in row if not m)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("veto", [None, 0.3])
def test_rejection_mask(level, veto):
    old, rollout, mask = _batch(3)
    low, high = 0.6, 1.8
    ratio = _ref_level_ratio(old, rollout, mask, level)
    expected = []
    for b in range(B):
        vetoed = veto is not None and any(
            mask[b][t] and math.exp(old[b][t] - rollout[b][t]) < veto for t in range(T))
        expected.append([1.0 if mask[b][t] and low <= ratio[b][t] <= high and not vetoed else 0.0
                         for t in range(T)])
    got = rejection_mask(_t(old), _t(rollout), _t(mask), level=level, low=low, high=high,
                         veto_threshold=veto)
    _close(got, expected)
    if level != "token":  # whole samples are kept or dropped
        for b in range(B):
            kept = {got[b, t].item() for t in range(T) if mask[b][t]}
            assert len(kept) <= 1


def test_rejection_default_low_is_inverse_high():
    old, rollout, mask = _batch(4)
    a = rejection_mask(_t(old), _t(rollout), _t(mask), level="token", high=1.25)
    b = rejection_mask(_t(old), _t(rollout), _t(mask), level="token", low=0.8, high=1.25)
    assert torch.equal(a, b)


def test_abs_diff_is_mean_of_per_sample_means():
    old, rollout, mask = _batch(5)
    per_sample = []
    for b in range(B):
        diffs = [abs(old[b][t] - rollout[b][t]) for t in range(T) if mask[b][t]]
        if diffs:
            per_sample.append(sum(diffs) / len(diffs))
    expected = sum(per_sample) / len(per_sample)
    got = train_rollout_logprob_abs_diff(_t(old), _t(rollout), _t(mask))
    assert got.item() == pytest.approx(expected, rel=1e-12)
    # Differs from the token mean whenever samples have different lengths.
    flat = [abs(old[b][t] - rollout[b][t]) for b in range(B) for t in range(T) if mask[b][t]]
    assert got.item() != pytest.approx(sum(flat) / len(flat), rel=1e-6)
    empty = torch.zeros(2, 3)
    assert train_rollout_logprob_abs_diff(empty, empty, empty).item() == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_mismatch_kl(estimator):
    old, rollout, mask = _batch(6)
    vals = []
    for b in range(B):
        for t in range(T):
            if mask[b][t]:
                d = old[b][t] - rollout[b][t]  # log pi_old - log pi_rollout
                vals.append(-d if estimator == "k1" else math.exp(d) - 1.0 - d)
    got = mismatch_kl(_t(old), _t(rollout), _t(mask), estimator=estimator)
    assert got.item() == pytest.approx(sum(vals) / len(vals), rel=1e-12)


def _ref_ppo(logp, proximal, adv, eps):
    ratio = math.exp(logp - proximal)
    return -min(ratio * adv, max(1 - eps, min(1 + eps, ratio)) * adv)


def test_decoupled_ppo_three_policies():
    """Decoupled PPO through the train stage's own loss (rltool.train.objective): clip anchored at
    pi_old, behaviour weight pi_old/pi_rollout truncated at 2, token aggregation."""
    from rltool.train.backend import ForwardOutput, MicroBatch
    from rltool.train.config import TrainConfig
    from rltool.train.objective import SampleTensors, batch_terms, make_loss_fn

    old, rollout, mask = _batch(7)
    # The trainer's old logprobs come from a forward pass, finite everywhere; keep the garbage
    # at masked positions finite here too.
    old = [[x if math.isfinite(x) else -30.0 for x in row] for row in old]
    rollout = [[x if math.isfinite(x) else -30.0 for x in row] for row in rollout]
    rng = random.Random(7)
    cur = [[old[b][t] + rng.gauss(0, 0.2) for t in range(T)] for b in range(B)]
    adv = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
    eps = 0.2
    masked = sum(sum(row) for row in mask)
    expected = sum(min(math.exp(old[b][t] - rollout[b][t]), 2.0)
                   * _ref_ppo(cur[b][t], old[b][t], adv[b][t], eps)
                   for b in range(B) for t in range(T) if mask[b][t]) / masked

    cfg = TrainConfig(rollouts=["unused"], load="unused", tis_mode="truncate", tis_clip_high=2.0,
                      eps_clip=eps, loss_aggregation="token")
    rows = lambda x: [torch.tensor(r, dtype=torch.float64) for r in x]
    data = SampleTensors(masks=[torch.tensor(m) for m in mask], rollout_logprobs=rows(rollout),
                         old_logprobs=rows(old), advantages=rows(adv))
    batch = list(range(B))
    terms = batch_terms(cfg, data, batch, torch.zeros(B, dtype=torch.long))
    loss_fn = make_loss_fn(cfg, data, terms)
    cur_t = [t.requires_grad_() for t in rows(cur)]
    loss, metrics = loss_fn(ForwardOutput(logprobs=cur_t),
                            MicroBatch(indices=batch, tokens=[[0]] * B, response_starts=[1] * B))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["train/pg_loss"].item() == pytest.approx(expected, rel=1e-6)
    loss.backward()  # no gradient reaches masked tokens, whatever their logprobs
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                assert cur_t[b].grad[t] == 0.0


def test_bypass_uses_rollout_as_old():
    old, rollout, mask = _batch(8)
    corr = rollout_correction(_t(rollout), loss_mask=_t(mask), bypass=True)
    assert torch.equal(corr.proximal_logprobs, _t(rollout))
    _close(corr.weights, [[float(m) for m in row] for row in mask])
    assert corr.metrics == {}
    with pytest.raises(ValueError, match="bypass"):
        rollout_correction(_t(rollout), loss_mask=_t(mask), old_logprobs=_t(old), bypass=True,
                           tis_mode="truncate")
    with pytest.raises(ValueError, match="old_logprobs"):
        rollout_correction(_t(rollout), loss_mask=_t(mask))


def test_correction_metrics_and_rejection_combined():
    old, rollout, mask = _batch(9)
    corr = rollout_correction(_t(rollout), loss_mask=_t(mask), old_logprobs=_t(old),
                              tis_mode="clip", tis_clip_low=0.8, tis_clip_high=1.2,
                              rs_level="geometric", rs_low=0.5, rs_high=2.0)
    ratio = _ref_level_ratio(old, rollout, mask, "token")
    geo = _ref_level_ratio(old, rollout, mask, "geometric")
    kept = [[bool(mask[b][t]) and 0.5 <= geo[b][t] <= 2.0 for t in range(T)] for b in range(B)]
    n_kept = sum(k for row in kept for k in row)
    n_mask = sum(m for row in mask for m in row)
    raw = [ratio[b][t] for b in range(B) for t in range(T) if kept[b][t]]
    applied = [min(max(r, 0.8), 1.2) for r in raw]
    m = corr.metrics
    assert m["train/tis"].item() == pytest.approx(sum(raw) / n_kept, rel=1e-12)
    assert m["train/tis_weight"].item() == pytest.approx(sum(applied) / n_kept, rel=1e-12)
    assert m["train/tis_clipfrac"].item() == pytest.approx(
        sum(1 for r in raw if not 0.8 <= r <= 1.2) / n_kept, rel=1e-12)
    assert m["train/rs_reject_frac"].item() == pytest.approx(1 - n_kept / n_mask, rel=1e-12)
    _close(corr.loss_mask, [[1.0 if k else 0.0 for k in row] for row in kept])
    _close(corr.weights, [[min(max(ratio[b][t], 0.8), 1.2) if kept[b][t] else 0.0
                           for t in range(T)] for b in range(B)])
    # Mismatch metrics use the input mask (before rejection): what the engines actually differ by.
    diffs = [old[b][t] - rollout[b][t] for b in range(B) for t in range(T) if mask[b][t]]
    assert m["train/mismatch_kl"].item() == pytest.approx(-sum(diffs) / n_mask, rel=1e-12)
    assert m["train/mismatch_k3_kl"].item() == pytest.approx(
        sum(math.exp(d) - 1 - d for d in diffs) / n_mask, rel=1e-12)
    per_sample = [sum(abs(old[b][t] - rollout[b][t]) for t in range(T) if mask[b][t])
                  / sum(mask[b]) for b in range(B) if sum(mask[b])]
    assert m["train/train_rollout_logprob_abs_diff"].item() == pytest.approx(
        sum(per_sample) / len(per_sample), rel=1e-12)


def test_icepop_through_correction_keeps_the_loss_mask():
    old, rollout, mask = _batch(10)
    corr = rollout_correction(_t(rollout), loss_mask=_t(mask), old_logprobs=_t(old),
                              tis_mode="icepop", tis_clip_low=0.5, tis_clip_high=2.0)
    _close(corr.loss_mask, [[float(m) for m in row] for row in mask])
    popped = sum(1 for b in range(B) for t in range(T) if mask[b][t]
                 and not 0.5 <= math.exp(old[b][t] - rollout[b][t]) <= 2.0)
    n_mask = sum(m for row in mask for m in row)
    assert corr.metrics["train/tis_clipfrac"].item() == pytest.approx(popped / n_mask, rel=1e-12)


def test_weights_are_detached_and_float32_inputs_stay_float32():
    old, rollout, mask = _batch(11)
    old_t = _t(old, torch.float32).requires_grad_(True)
    corr = rollout_correction(_t(rollout, torch.float32), loss_mask=_t(mask, torch.int8),
                              old_logprobs=old_t, tis_mode="truncate")
    assert not corr.weights.requires_grad and not corr.proximal_logprobs.requires_grad
    assert corr.weights.dtype == torch.float32
    assert torch.isfinite(corr.weights).all()


def test_sequence_level_product_does_not_overflow():
    n = 4000
    old = torch.zeros(1, n, dtype=torch.float32)
    rollout = torch.full((1, n), -0.05)  # product ratio exp(200): inf without the clamp
    mask = torch.ones(1, n)
    w = tis_weights(old, rollout, mask, mode="truncate", level="sequence", clip_high=2.0)
    assert torch.isfinite(w).all() and torch.all(w == 2.0)


def test_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        importance_ratio(x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="level"):
        importance_ratio(x, x, x, level="batch")
    with pytest.raises(ValueError, match="low < high"):
        tis_weights(x, x, x, mode="clip", clip_low=2.0, clip_high=1.0)
    with pytest.raises(ValueError, match="TIS mode"):
        rollout_correction(x, loss_mask=x, old_logprobs=x, tis_mode="cap")
