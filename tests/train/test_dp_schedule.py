"""DP schedule: plan invariants, edge cases, and quality against the round-robin baseline."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltool.train.dp_schedule import round_robin, sample_flops, schedule, schedule_stats


def _check_plan(lengths, plan, *, dp_size, cap):
    assert len(plan) == dp_size
    counts = {len(rank) for rank in plan}
    assert len(counts) == 1, f"unequal micro-batch counts {counts}"
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(len(lengths))), "every index exactly once"
    num_mb = counts.pop() * dp_size
    empties = sum(1 for rank in plan for mb in rank if not mb)
    if len(lengths) >= num_mb:
        assert empties == 0, "empty micro-batch although samples were available"
    for rank in plan:
        for mb in rank:
            tokens = sum(lengths[i] for i in mb)
            if tokens > cap:
                assert len(mb) == 1, f"micro-batch over the cap with {len(mb)} samples"


def _lognormal(n, seed):
    rng = random.Random(seed)
    return [min(32768, max(16, round(rng.lognormvariate(math.log(1500), 1.0)))) for _ in range(n)]


@pytest.mark.parametrize("dp_size", [1, 2, 8, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariants_random(dp_size, seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 5000) for _ in range(rng.randint(1, 700))]
    plan = schedule(lengths, dp_size=dp_size, max_tokens_per_microbatch=4096)
    _check_plan(lengths, plan, dp_size=dp_size, cap=4096)


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 600), max_size=80), dp_size=st.integers(1, 9),
       cap=st.integers(1, 700))
def test_invariants_property(lengths, dp_size, cap):
    plan = schedule(lengths, dp_size=dp_size, max_tokens_per_microbatch=cap)
    if not lengths:
        assert plan == [[] for _ in range(dp_size)]
        return
    _check_plan(lengths, plan, dp_size=dp_size, cap=cap)
    stats = schedule_stats(lengths, plan, max_tokens_per_microbatch=cap)
    assert stats.flops_imbalance >= stats.flops_imbalance_floor - 1e-9
    assert stats.packing_efficiency <= stats.packing_efficiency_ceiling + 1e-9


def test_invariants_lognormal_with_oversize():
    lengths = _lognormal(1024, seed=3)
    assert any(n > 16384 for n in lengths)
    for dp_size in (8, 64):
        plan = schedule(lengths, dp_size=dp_size, max_tokens_per_microbatch=16384)
        _check_plan(lengths, plan, dp_size=dp_size, cap=16384)


def test_fewer_samples_than_ranks():
    lengths = [5, 3, 9]
    plan = schedule(lengths, dp_size=8, max_tokens_per_microbatch=100)
    _check_plan(lengths, plan, dp_size=8, cap=100)
    assert all(len(rank) == 1 for rank in plan)
    # Each sample alone on its own rank: the balance is as good as it can be.
    assert sorted(len(rank[0]) for rank in plan) == [0] * 5 + [1] * 3


def test_spare_bins_take_samples_instead_of_staying_empty():
    lengths = [10] * 20  # fits one micro-batch, but 4 ranks need 4 micro-batches
    plan = schedule(lengths, dp_size=4, max_tokens_per_microbatch=1000)
    _check_plan(lengths, plan, dp_size=4, cap=1000)
    assert [sum(len(mb) for mb in rank) for rank in plan] == [5, 5, 5, 5]


def test_all_oversize():
    lengths = [300, 500, 200, 400, 250]
    plan = schedule(lengths, dp_size=2, max_tokens_per_microbatch=100)
    _check_plan(lengths, plan, dp_size=2, cap=100)
    # 5 singletons need 3 micro-batches per rank: one of the 6 stays empty.
    assert [len(rank) for rank in plan] == [3, 3]
    assert sorted(len(mb) for rank in plan for mb in rank) == [0, 1, 1, 1, 1, 1]


def test_dp_one_packs_tightly():
    lengths = [60, 50, 40, 30, 20, 10]  # 210 tokens, cap 100: 3 bins are needed and enough
    plan = schedule(lengths, dp_size=1, max_tokens_per_microbatch=100)
    _check_plan(lengths, plan, dp_size=1, cap=100)
    assert len(plan[0]) == 3


def test_empty_input_and_bad_arguments():
    assert schedule([], dp_size=3, max_tokens_per_microbatch=10) == [[], [], []]
    with pytest.raises(ValueError):
        schedule([1, 2], dp_size=0, max_tokens_per_microbatch=10)
    with pytest.raises(ValueError):
        schedule([1, 0], dp_size=1, max_tokens_per_microbatch=10)
    with pytest.raises(ValueError):
        schedule([1], dp_size=1, max_tokens_per_microbatch=0)


def test_deterministic():
    lengths = _lognormal(500, seed=4)
    a = schedule(lengths, dp_size=8, max_tokens_per_microbatch=8192)
    b = schedule(list(lengths), dp_size=8, max_tokens_per_microbatch=8192)
    assert a == b


def test_stats_against_hand_computation():
    lengths = [100, 200, 300]
    plan = [[[0, 1]], [[2]]]
    s = schedule_stats(lengths, plan, max_tokens_per_microbatch=400, flops_a=1.0, flops_b=0.01)
    f = [n + 0.01 * n * n for n in lengths]
    mean = sum(f) / 2
    assert s.num_microbatches_per_rank == 1
    assert s.flops_imbalance == pytest.approx(max(f[0] + f[1], f[2]) / mean)
    assert s.flops_imbalance_floor == pytest.approx(max(1.0, f[2] / mean))
    assert s.packing_efficiency == pytest.approx(600 / (2 * 400))
    # Lower bound: 600 tokens / 400 -> 2 bins -> 2 micro-batches (a multiple of dp 2).
    assert s.packing_efficiency_ceiling == pytest.approx(600 / (2 * 400))
    assert sample_flops(100, flops_a=1.0, flops_b=0.01) == pytest.approx(200.0)


@pytest.mark.parametrize("dp_size", [8, 64])
def test_quality_beats_round_robin_and_meets_targets(dp_size):
    lengths = _lognormal(1024, seed=5)
    cap = 16384
    plan = schedule(lengths, dp_size=dp_size, max_tokens_per_microbatch=cap)
    ours = schedule_stats(lengths, plan, max_tokens_per_microbatch=cap)
    base = schedule_stats(lengths, round_robin(lengths, dp_size=dp_size,
                                               max_tokens_per_microbatch=cap),
                          max_tokens_per_microbatch=cap)
    assert ours.flops_imbalance < base.flops_imbalance
    assert ours.packing_efficiency > base.packing_efficiency
    assert ours.flops_imbalance <= 1.05 * ours.flops_imbalance_floor
    assert ours.packing_efficiency >= 0.95 * ours.packing_efficiency_ceiling


@pytest.mark.parametrize("seed", [0, 4])
def test_heavy_tail_rank_with_a_huge_sample_gets_only_small_company(seed):
    """Pack-then-distribute alone leaves a rank holding a huge sample with full micro-batches
    besides it (imbalance ~2.0 against a floor of ~1.5 here); the rank-first candidate fixes it."""
    rng = random.Random(seed)
    lengths = [min(40000, max(1, round(rng.lognormvariate(math.log(100), 2.0))))
               for _ in range(600)]
    plan = schedule(lengths, dp_size=16, max_tokens_per_microbatch=4096)
    _check_plan(lengths, plan, dp_size=16, cap=4096)
    s = schedule_stats(lengths, plan, max_tokens_per_microbatch=4096)
    assert s.flops_imbalance <= 1.05 * s.flops_imbalance_floor
    assert s.packing_efficiency >= 0.95 * s.packing_efficiency_ceiling


def test_round_robin_baseline_is_a_valid_plan():
    lengths = _lognormal(300, seed=6)
    plan = round_robin(lengths, dp_size=8, max_tokens_per_microbatch=4096)
    assert len({len(rank) for rank in plan}) == 1
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(300))
