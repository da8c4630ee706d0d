"""Helpers to build valid shard rows in tests (imported by tests of several areas)."""

from __future__ import annotations

import random

from rltool.data.shards import ShardMeta, make_row


def fake_rows(num_groups: int = 2, group_size: int = 3, *, seed: int = 0, vocab: int = 50,
              version: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for g in range(num_groups):
        prompt_ids = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]
        for i in range(group_size):
            n = rng.randint(1, 8)
            rows.append(make_row(
                uid=f"g{g}-s{i}", prompt_id=f"p{g}", group_id=g, sample_index=i,
                prompt=f"prompt {g}", prompt_token_ids=prompt_ids, response="r" * n,
                response_token_ids=[rng.randrange(vocab) for _ in range(n)],
                rollout_logprobs=[-rng.random() for _ in range(n)], loss_mask=[1] * n,
                weight_versions=[version] * n, reward=float(rng.random() > 0.5),
                status="completed", finish_reason="stop", label="x"))
    return rows


def fake_meta(*, tokenizer_hash: str = "0" * 16, step: int = 0) -> ShardMeta:
    return ShardMeta(tokenizer_hash=tokenizer_hash, step=step, producer="test",
                     sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})


def write_raw_shard(out, tables, *, meta: ShardMeta | None = None) -> dict:
    """Write pyarrow tables as part files + a correct `_SUCCESS` manifest WITHOUT the writer's
    validation, to build malformed shards for reader tests. Returns the manifest."""
    import json
    from pathlib import Path

    import pyarrow.parquet as pq

    from rltool.data.shards import MANIFEST, SCHEMA_VERSION, file_xxh3_128

    out = Path(out)
    out.mkdir(parents=True)
    meta = meta or fake_meta()
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
