"""Groups holding a failed sample (its reward raised or timed out) stay out of the train step."""

from __future__ import annotations

import pytest

from rltool.data.tokenizer import tokenizer_hash
from rltool.errors import ShardSchemaError
from rltool.train import run
from rltool.train.config import TrainConfig
from rltool.train.samples import load_rollouts
from tests.helpers.shards import REWARDS, VOCAB, make_shard, shard_rows


def with_failed(rows, uid):
    """Mark one sample failed the way the rollout stage does when its reward call raised."""
    for row in rows:
        if row["uid"] == uid:
            row.update(status="failed", reward=0.0,
                       finish_reason="reward_error: RuntimeError: reward crashed")
    return rows


def test_groups_with_a_failed_sample_are_left_out_and_counted(tiny_model_dir, tmp_path):
    """Bug: the trainer trained on failed samples as given, so a reward call that crashed
    counted as a real reward of 0.0 and skewed its whole group's advantages. Their groups are now
    left out of the step, and train.jsonl counts them; the step equals one on a shard that never
    held those groups."""
    rows = with_failed(shard_rows(REWARDS), "g1-s2")
    shard = make_shard(tmp_path / "with-failed", tiny_model_dir, rows)
    clean = make_shard(tmp_path / "clean", tiny_model_dir,
                       [r for r in shard_rows(REWARDS) if r["group_id"] != 1])
    loaded = load_rollouts([shard], tokenizer_hash=tokenizer_hash(tiny_model_dir),
                           vocab_size=VOCAB)
    assert [s.uid for s in loaded.samples] == [f"g{g}-s{i}" for g in (0, 2) for i in range(4)]
    assert [s.group for s in loaded.samples] == [0] * 4 + [1] * 4  # dense group indices
    assert (loaded.failed_groups, loaded.failed_group_samples) == (1, 4)

    common = dict(load=str(tiny_model_dir), lr=3e-3, max_tokens_per_microbatch=40, num_steps=1,
                  deterministic=True)
    with_failed_row = run(TrainConfig(rollouts=[str(shard)], metrics=str(tmp_path / "a.jsonl"),
                                      **common)).metrics[0]
    clean_row = run(TrainConfig(rollouts=[str(clean)], metrics=str(tmp_path / "b.jsonl"),
                                **common)).metrics[0]
    assert with_failed_row["train/failed_groups_left_out"] == 1
    assert with_failed_row["train/failed_group_samples_left_out"] == 4
    assert clean_row["train/failed_groups_left_out"] == 0
    assert with_failed_row["train/num_samples"] == clean_row["train/num_samples"] == 8
    for key in ("train/loss", "train/pg_loss", "train/grad_norm"):
        assert with_failed_row[key] == clean_row[key], key


def test_a_shard_of_only_failed_groups_is_refused(tiny_model_dir, tmp_path):
    rows = shard_rows(REWARDS[:2])
    for uid in ("g0-s0", "g1-s3"):
        with_failed(rows, uid)
    shard = make_shard(tmp_path / "all-failed", tiny_model_dir, rows)
    with pytest.raises(ShardSchemaError, match="every group .2. holds a failed sample"):
        load_rollouts([shard], tokenizer_hash=tokenizer_hash(tiny_model_dir), vocab_size=VOCAB)
