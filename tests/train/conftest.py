"""Fixtures of the train tests."""

from __future__ import annotations

import pytest

from rltool.data.models import init_model
from tests.helpers.shards import REWARDS, make_shard, shard_rows


@pytest.fixture(scope="session")
def train_shard(tiny_model_dir, tmp_path_factory):
    """12 samples in 3 groups of 4 (REWARDS), sampled at temperature 0.8."""
    return make_shard(tmp_path_factory.mktemp("train") / "rollouts" / "step-000001",
                      tiny_model_dir, shard_rows(REWARDS), temperature=0.8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(arch, preset) -> the dir of a model of that architecture and size preset (seed 0), built
    once per test module."""
    cache = {}

    def get(arch: str, preset: str):
        if (arch, preset) not in cache:
            cache[arch, preset] = init_model(tmp_path_factory.mktemp(f"{arch}-{preset}") / "m",
                                             arch=arch, preset=preset, seed=0)
        return cache[arch, preset]
    return get
