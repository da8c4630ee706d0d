"""Shard rows and shards for tests of every area: one row factory, the shard writer around it,
and a raw writer that skips validation (for malformed-shard tests)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from rltool.data.shards import ShardMeta, make_row, write_shard

VOCAB = 60  # the tiny test models' vocabulary
# 12 samples in 3 groups of 4: both signs of advantage in every group, a fractional reward.
REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.5, 0.0], [1.0, 1.0, 0.0, 0.25]]


def shard_rows(rewards: list[list[float]], *, seed: int = 0, vocab: int = VOCAB,
               prompt_len: int = 5, max_response: int = 6, version: int = 0) -> list[dict]:
    """Valid rows, one group per inner list of `rewards`: a random prompt per group, distinct
    random responses of 2..max_response tokens (ids from 4 up, clear of the special tokens),
    loss mask 1 except token 1 of responses longer than 3 (a tool-output-like token the policy
    did not generate: logprob 0, weight version -1)."""
    rng = random.Random(seed)
    rows = []
    for g, group in enumerate(rewards):
        prompt = [rng.randrange(4, vocab) for _ in range(prompt_len)]
        for i, reward in enumerate(group):
            n = rng.randint(2, max_response)
            mask = [1] * n
            if n > 3:
                mask[1] = 0
            rows.append(make_row(
                uid=f"g{g}-s{i}", prompt_id=f"p{g}", group_id=g, sample_index=i,
                prompt=f"prompt {g}", prompt_token_ids=prompt, response="x" * n,
                response_token_ids=[rng.randrange(4, vocab) for _ in range(n)],
                rollout_logprobs=[-rng.random() if m else 0.0 for m in mask], loss_mask=mask,
                weight_versions=[version if m else -1 for m in mask], reward=reward,
                status="completed", finish_reason="stop", label="x"))
    return rows


def random_rewards(num_groups: int = 2, group_size: int = 3, *, seed: int = 0) -> list[list[float]]:
    """0/1 rewards for `num_groups` groups of `group_size` samples (for `shard_rows`)."""
    rng = random.Random(seed)
    return [[float(rng.random() > 0.5) for _ in range(group_size)] for _ in range(num_groups)]


def shard_meta(*, tokenizer_hash: str = "0" * 16, step: int = 0,
               temperature: float = 1.0) -> ShardMeta:
    return ShardMeta(tokenizer_hash=tokenizer_hash, step=step, producer="test",
                     sampling={"temperature": temperature, "top_p": 1.0, "top_k": -1})


def make_shard(path: Path, model_dir: Path, rows: list[dict], *, temperature: float = 1.0,
               step: int = 1, tok_hash: str | None = None) -> Path:
    """Write `rows` as a shard for the model in `model_dir` (its tokenizer hash unless given)."""
    from rltool.data.tokenizer import tokenizer_hash

    write_shard(path, rows, shard_meta(tokenizer_hash=tok_hash or tokenizer_hash(model_dir),
                                       step=step, temperature=temperature))
    return path


def write_raw_shard(out, tables, *, meta: ShardMeta | None = None) -> dict:
    """Write pyarrow tables as part files + a correct `_SUCCESS` manifest WITHOUT the writer's
    validation, to build malformed shards for reader tests. Returns the manifest."""
    import pyarrow.parquet as pq

    from rltool.data.shards import MANIFEST, SCHEMA_VERSION, file_xxh3_128

    out = Path(out)
    out.mkdir(parents=True)
    meta = meta or shard_meta()
    parts = []
    for i, table in enumerate(tables):
        name = f"part-{i:05d}.parquet"
        pq.write_table(table.replace_schema_metadata(meta.to_parquet()), out / name)
        parts.append({"file": name, "rows": table.num_rows, "xxh3_128": file_xxh3_128(out / name)})
    manifest = {"schema_version": SCHEMA_VERSION, "num_rows": sum(p["rows"] for p in parts),
                "parts": parts, "step": meta.step, "producer": meta.producer,
                "tokenizer_hash": meta.tokenizer_hash}
    (out / MANIFEST).write_text(json.dumps(manifest))
    return manifest
