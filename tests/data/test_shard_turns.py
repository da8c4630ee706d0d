"""The agentic columns of rollout shards (schema 1.2): turn_rewards and turn_starts round-trip,
and rows whose turns do not fit their response are refused by the writer."""

from __future__ import annotations

import pytest

from rltool.data.shards import open_shard, write_shard
from rltool.errors import ShardSchemaError
from tests.helpers.shards import random_rewards, shard_meta, shard_rows


def rows_with_turns():
    rows = shard_rows(random_rewards(1, 2, seed=3), seed=3)
    n = len(rows[0]["response_token_ids"])
    rows[0]["turn_rewards"], rows[0]["turn_starts"] = [0.5, 1.0], [0, n // 2]
    return rows, n


def test_turn_columns_round_trip(tmp_path):
    rows, n = rows_with_turns()
    write_shard(tmp_path / "s", rows, shard_meta())
    back = open_shard(tmp_path / "s").rows()
    assert (back[0]["turn_rewards"], back[0]["turn_starts"]) == ([0.5, 1.0], [0, n // 2])
    assert (back[1]["turn_rewards"], back[1]["turn_starts"]) == (None, None)


@pytest.mark.parametrize("rewards, starts, words", [
    ([0.5], [0, 1], "both be set with one entry per turn"),
    ([0.5, 1.0], None, "both be set with one entry per turn"),
    ([0.5, 1.0], [0, 0], "must rise"),
    ([0.5, 1.0], [0, 10_000], "must rise"),
    ([0.5, float("nan")], [0, 1], "non-finite"),
])
def test_bad_turns_are_refused(tmp_path, rewards, starts, words):
    rows, _ = rows_with_turns()
    rows[0]["turn_rewards"], rows[0]["turn_starts"] = rewards, starts
    with pytest.raises(ShardSchemaError, match=words):
        write_shard(tmp_path / "s", rows, shard_meta())
    assert not (tmp_path / "s").exists()
