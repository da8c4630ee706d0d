"""Bounded staleness on a simulated version clock: no trained sample is older than K versions,
the rollout side never holds more than K versions' worth of groups, drops are counted, and the
metrics (mean, max, dropped, token-age histogram) match the samples."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from rltool.loop.async_staleness import (StalenessGate, sample_staleness, staleness_metrics,
                                         token_versions)


@dataclass
class FakeSample:
    weight_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)


def group_of(*versions_per_sample: list[int]) -> list[FakeSample]:
    return [FakeSample(list(v), [1] * len(v)) for v in versions_per_sample]


def test_tool_tokens_do_not_count_and_staleness_is_the_oldest_model_token():
    s = FakeSample([3, -1, 4, 5], [1, 0, 1, 1])
    assert token_versions(s) == [3, 4, 5]
    assert sample_staleness(s, 6) == 3
    assert sample_staleness(FakeSample(), 6) == 0


def test_admission_arithmetic():
    gate = StalenessGate(max_staleness=2, batch_groups=4, versions_per_step=2)
    # idle trainer at v4, engines at v4: the next 4 groups train at v4, the 4 after at v6
    assert gate.train_version(trainer_version=4, training=False, ahead=3) == 4
    assert gate.train_version(trainer_version=4, training=False, ahead=4) == 6
    assert gate.admit(engine_version=4, trainer_version=4, training=False, ahead=7)
    assert not gate.admit(engine_version=4, trainer_version=4, training=False, ahead=8)
    # training v4 -> v6 while engines serve v4: one more batch may start, no more
    assert gate.admit(engine_version=4, trainer_version=4, training=True, ahead=3)
    assert not gate.admit(engine_version=4, trainer_version=4, training=True, ahead=4)
    # K below the versions of one step: nothing starts while the trainer trains (sync-like)
    strict = StalenessGate(max_staleness=1, batch_groups=4, versions_per_step=2)
    assert not strict.admit(engine_version=4, trainer_version=4, training=True, ahead=0)


def test_split_drops_groups_with_any_sample_too_old():
    gate = StalenessGate(max_staleness=1, batch_groups=2, versions_per_step=1)
    fresh, mixed, old = group_of([5, 5], [4]), group_of([5], [3, 5]), group_of([2])
    keep, drop = gate.split([fresh, mixed, old], train_version=5)
    assert keep == [fresh] and drop == [mixed, old]


def test_metrics_histogram_counts_token_ages():
    groups = [group_of([4, 5], [5]), group_of([3, 4, 5])]
    m = staleness_metrics(groups, train_version=5, dropped_groups=2)
    assert m["staleness/max"] == 2
    assert m["staleness/mean"] == pytest.approx((1 + 0 + 2) / 3)
    assert m["staleness/dropped"] == 2
    assert m["staleness/token_age_hist"] == [3, 2, 1]  # ages 0, 1, 2


def simulate(*, max_staleness: int, versions_per_step: int, batch: int, seed: int,
             prepare_ahead: bool, steps: int = 40) -> dict:
    """A tick clock: each in-flight group makes a token per tick at the engines' version (an
    in-place update switches later tokens), finishes after a random length; the trainer takes a
    batch when one is ready, trains for a random number of ticks, and the engines then serve its
    new version. With `prepare_ahead` the next batch is taken while the trainer trains (for the
    version it will train at), as the rollout worker does, and counts as in training."""
    rng = random.Random(seed)
    gate = StalenessGate(max_staleness=max_staleness, batch_groups=batch,
                         versions_per_step=versions_per_step)
    trainer, engine, training_left = 0, 0, 0
    ready, in_flight, trained, dropped, most_ahead, prepared = [], [], [], 0, 0, None
    while len(trained) < steps:
        while gate.admit(engine_version=engine,
                         trainer_version=trainer + versions_per_step if prepared else trainer,
                         training=training_left > 0 or prepared is not None,
                         ahead=len(ready) + len(in_flight)):
            in_flight.append([group_of([]), rng.randint(1, 6)])
        most_ahead = max(most_ahead, len(ready) + len(in_flight) + len(prepared or []))
        for item in list(in_flight):  # a token per tick for each sample, completion random
            for s in item[0]:
                s.weight_versions.append(engine)
                s.loss_mask.append(1)
            item[1] -= 1
            if item[1] == 0:
                in_flight.remove(item)
                ready.append(item[0])
        rng.shuffle(ready[-2:])  # completion order is not start order
        if training_left:
            training_left -= 1
            if prepare_ahead and prepared is None:
                keep, drop = gate.split(ready, train_version=trainer + versions_per_step)
                dropped += len(drop)
                ready = keep
                if len(keep) >= batch:
                    prepared, ready = keep[:batch], keep[batch:]
            if training_left == 0:
                trainer += versions_per_step
                engine = trainer  # the in-flight weight update
            continue
        if prepared is not None:  # a tick after the update: the prepared batch is taken
            trained.append((trainer, prepared))
            prepared, training_left = None, rng.randint(1, 5)
            continue
        keep, drop = gate.split(ready, train_version=trainer)
        dropped += len(drop)
        if len(keep) >= batch:
            taken, ready = keep[:batch], keep[batch:]
            trained.append((trainer, taken))
            training_left = rng.randint(1, 5)
        else:
            ready = keep
    return {"trained": trained, "dropped": dropped, "most_ahead": most_ahead}


@pytest.mark.parametrize("max_staleness,versions_per_step", [(0, 1), (1, 1), (2, 1), (2, 2),
                                                             (1, 2), (4, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prepare_ahead", [False, True])
def test_simulated_clock_never_trains_a_sample_older_than_k(max_staleness, versions_per_step,
                                                            seed, prepare_ahead):
    batch = 3
    out = simulate(max_staleness=max_staleness, versions_per_step=versions_per_step,
                   batch=batch, seed=seed, prepare_ahead=prepare_ahead)
    ages = [sample_staleness(s, version) for version, groups in out["trained"]
            for g in groups for s in g]
    assert max(ages) <= max_staleness
    # backpressure: never more than K versions' worth of batches queued or in flight
    assert out["most_ahead"] <= batch * (max_staleness // versions_per_step + 1)
    if max_staleness < versions_per_step:  # nothing may start during training: on-policy
        assert max(ages) == 0 and out["dropped"] == 0
    if max_staleness >= versions_per_step:  # generation overlaps training: some data is stale
        assert max(ages) > 0
