"""Fixtures of the train tests."""

from __future__ import annotations

import pytest

from tests.helpers.shards import REWARDS, make_shard, shard_rows


@pytest.fixture(scope="session")
def train_shard(tiny_model_dir, tmp_path_factory):
    """12 samples in 3 groups of 4 (REWARDS), sampled at temperature 0.8."""
    return make_shard(tmp_path_factory.mktemp("train") / "rollouts" / "step-000001",
                      tiny_model_dir, shard_rows(REWARDS), temperature=0.8)
