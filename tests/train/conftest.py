"""Fixtures of the train tests: shards made for the tiny model (vocab 60) and config helpers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rltool.data.shards import ShardMeta, make_row, write_shard
from rltool.data.tokenizer import tokenizer_hash

VOCAB = 60


def rows_for_groups(rewards: list[list[float]], *, seed: int = 0, prompt_len: int = 5,
                    max_response: int = 6) -> list[dict]:
    """One group per inner list; distinct random responses; loss mask 1 except a masked token."""
    rng = random.Random(seed)
    rows = []
    for g, group in enumerate(rewards):
        prompt = [rng.randrange(4, VOCAB) for _ in range(prompt_len)]
        for i, reward in enumerate(group):
            n = rng.randint(2, max_response)
            mask = [1] * n
            if n > 3:
                mask[1] = 0  # a tool-output-like token the policy did not generate
            rows.append(make_row(
                uid=f"g{g}-s{i}", prompt_id=f"p{g}", group_id=g, sample_index=i,
                prompt=f"prompt {g}", prompt_token_ids=prompt, response="x" * n,
                response_token_ids=[rng.randrange(4, VOCAB) for _ in range(n)],
                rollout_logprobs=[-rng.random() if m else 0.0 for m in mask], loss_mask=mask,
                weight_versions=[0 if m else -1 for m in mask], reward=reward,
                status="completed", finish_reason="stop", label="x"))
    return rows


def make_shard(path: Path, model_dir: Path, rows: list[dict], *, temperature: float = 1.0,
               step: int = 1, tok_hash: str | None = None) -> Path:
    meta = ShardMeta(tokenizer_hash=tok_hash or tokenizer_hash(model_dir), step=step,
                     producer="test", sampling={"temperature": temperature, "top_p": 1.0,
                                                "top_k": -1})
    write_shard(path, rows, meta)
    return path


REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.5, 0.0], [1.0, 1.0, 0.0, 0.25]]


@pytest.fixture(scope="session")
def train_shard(tiny_model_dir, tmp_path_factory):
    """12 samples in 3 groups of 4, sampled at temperature 0.8."""
    return make_shard(tmp_path_factory.mktemp("train") / "rollouts" / "step-000001",
                      tiny_model_dir, rows_for_groups(REWARDS), temperature=0.8)
