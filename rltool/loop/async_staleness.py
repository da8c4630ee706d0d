"""Bounded staleness for the asynchronous loop, as arithmetic on a version clock.

A token's age is the version that trains on it minus the version that generated it; a sample's
staleness is the age of its oldest model token. With `--max-staleness K` no sample older than K is
trained. Two places enforce it:

- admission (`StalenessGate.admit`): a group may start only when the version predicted to train
  on it, given the groups already queued or in flight ahead of it, is at most K past the version
  the engines serve now. This is the rollout side's backpressure: no more than K versions' worth
  of data is queued or in flight.
- consumption (`StalenessGate.split`): a group finishes later than predicted when others overtake
  it (completion order is not start order); any group with a sample older than K when its batch
  is formed is dropped and counted, never trained.

Versions count optimizer steps, so one loop step advances the policy by `versions_per_step`
(the optimizer steps one batch of `batch_groups` groups makes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


def token_versions(sample: Any) -> list[int]:
    """The versions of a sample's model tokens (tool tokens carry -1 and a zero loss mask)."""
    return [v for v, m in zip(sample.weight_versions, sample.loss_mask) if m and v >= 0]


def sample_staleness(sample: Any, train_version: int) -> int:
    """Age of the sample's oldest model token at `train_version` (0 for a sample without
    model tokens: it carries nothing off-policy)."""
    versions = token_versions(sample)
    return train_version - min(versions) if versions else 0


@dataclass
class StalenessGate:
    max_staleness: int
    batch_groups: int
    versions_per_step: int

    def train_version(self, *, trainer_version: int, training: bool, ahead: int) -> int:
        """The version predicted to train a group started now: the trainer's version when it
        next starts a step (after the step in progress, if any), plus one step per full batch
        of the `ahead` groups queued or in flight before it."""
        start = trainer_version + (self.versions_per_step if training else 0)
        return start + self.versions_per_step * (ahead // self.batch_groups)

    def admit(self, *, engine_version: int, trainer_version: int, training: bool,
              ahead: int) -> bool:
        predicted = self.train_version(trainer_version=trainer_version, training=training,
                                       ahead=ahead)
        return predicted - engine_version <= self.max_staleness

    def split(self, groups: list[list[Any]], *, train_version: int
              ) -> tuple[list[list[Any]], list[list[Any]]]:
        """(groups young enough to train at `train_version`, groups to drop), order kept."""
        keep, drop = [], []
        for group in groups:
            worst = max(sample_staleness(s, train_version) for s in group)
            (drop if worst > self.max_staleness else keep).append(group)
        return keep, drop


def staleness_metrics(groups: list[list[Any]], *, train_version: int,
                      dropped_groups: int) -> dict[str, Any]:
    """Per-step metrics of a trained batch: staleness mean/max over its samples, the groups
    dropped for staleness, and the histogram of its model tokens' ages (index = age)."""
    samples = [s for g in groups for s in g]
    ages = [sample_staleness(s, train_version) for s in samples]
    hist = Counter(train_version - v for s in samples for v in token_versions(s))
    top = max(hist, default=-1)
    return {"staleness/mean": sum(ages) / len(ages) if ages else 0.0,
            "staleness/max": max(ages, default=0),
            "staleness/dropped": dropped_groups,
            "staleness/token_age_hist": [hist.get(a, 0) for a in range(top + 1)]}
