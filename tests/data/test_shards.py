"""Shard writer and reader: round trip, file metadata, pandas interop, stats, refusals."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltool.data.shards import (COLUMNS, MANIFEST, SCHEMA, STATUSES, ShardMeta,
                                decode_routed_experts, encode_routed_experts, make_row,
                                open_shard, shard_stats, write_shard)
from rltool.errors import BadInputError, ShardSchemaError, TokenizerMismatchError
from tests.helpers.shards import random_rewards, shard_meta, shard_rows, write_raw_shard

DOCUMENTED_COLUMNS = ["uid", "prompt_id", "group_id", "sample_index", "prompt", "prompt_token_ids",
                      "response", "response_token_ids", "rollout_logprobs", "loss_mask",
                      "weight_versions", "reward", "rewards", "status", "finish_reason", "label",
                      "teacher_logprobs", "metadata", "rollout_routed_experts", "turn_rewards",
                      "turn_starts"]


def _rows():
    rows = shard_rows(random_rewards(3, 4, seed=1), seed=1)
    rows[0]["rewards"] = {"exact": 1.0, "format": 0.5}
    rows[1]["teacher_logprobs"] = [-0.5] * len(rows[1]["response_token_ids"])
    rows[2]["status"] = "truncated"
    rows[3]["metadata"] = json.dumps({"turns": 2})
    rows[3]["loss_mask"][0] = 0
    rows[3]["rollout_logprobs"][0] = 0.0
    rows[3]["weight_versions"][0] = -1
    rows[4]["label"] = None
    return rows


def test_round_trip_multiple_parts_and_row_groups(tmp_path):
    rows = _rows()
    manifest = write_shard(tmp_path / "s", rows, shard_meta(step=7), rows_per_part=5,
                           row_group_size=2)
    assert [p["rows"] for p in manifest["parts"]] == [5, 5, 2]
    assert manifest["num_rows"] == 12 and manifest["step"] == 7
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        MANIFEST, "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert json.loads((tmp_path / "s" / MANIFEST).read_text()) == manifest
    assert pq.ParquetFile(tmp_path / "s" / "part-00000.parquet").num_row_groups == 3

    shard = open_shard(tmp_path / "s", expected_tokenizer_hash="0" * 16)
    assert shard.num_rows == 12 and shard.meta == shard_meta(step=7)
    back = shard.rows()
    assert len(back) == len(rows)
    for want, got in zip(rows, back):
        for col in COLUMNS:
            w, g = want[col], got[col]
            if col == "rewards" and g is not None:
                g = dict(g)  # pyarrow returns a map as a list of (key, value) pairs
            if col in ("rollout_logprobs", "teacher_logprobs") and w is not None:
                assert g == pytest.approx(w, abs=1e-6)  # stored as float32
            else:
                assert g == w, col
    assert json.loads(back[3]["metadata"]) == {"turns": 2}
    # streaming: one batch per row group, column projection
    batches = list(shard.iter_batches(columns=["uid", "reward"]))
    assert [b.num_rows for b in batches] == [2, 2, 1, 2, 2, 1, 2]
    assert batches[0].schema.names == ["uid", "reward"]


def test_file_metadata_keys(tmp_path):
    meta = ShardMeta(tokenizer_hash="abcdef0123456789", step=3, producer="rltool rollout",
                     sampling={"temperature": 0.7, "top_p": 0.9, "top_k": 20},
                     extra={"engine": "builtin"})
    write_shard(tmp_path / "s", shard_rows(random_rewards()), meta)
    md = pq.read_metadata(tmp_path / "s" / "part-00000.parquet").metadata
    kv = {k.decode(): v.decode() for k, v in md.items() if k.startswith(b"rltool.")}
    assert kv == {"rltool.schema_version": "1.2", "rltool.tokenizer_hash": "abcdef0123456789",
                  "rltool.step": "3", "rltool.producer": "rltool rollout",
                  "rltool.sampling": '{"temperature": 0.7, "top_k": 20, "top_p": 0.9}',
                  "rltool.extra": '{"engine": "builtin"}'}
    assert open_shard(tmp_path / "s").meta == meta


def test_pandas_reads_the_documented_columns(tmp_path):
    import pandas as pd

    rows = _rows()
    write_shard(tmp_path / "s", rows, shard_meta(), rows_per_part=5)
    assert list(SCHEMA.names) == DOCUMENTED_COLUMNS
    df = pd.read_parquet(tmp_path / "s")  # the whole directory: _SUCCESS is ignored
    assert list(df.columns) == DOCUMENTED_COLUMNS and len(df) == len(rows)
    assert str(df["group_id"].dtype) == "int64" and str(df["sample_index"].dtype) == "int32"
    assert str(df["reward"].dtype) == "float32"
    assert df["uid"].tolist() == [r["uid"] for r in rows]
    assert [list(x) for x in df["response_token_ids"]] == [r["response_token_ids"] for r in rows]
    assert df["loss_mask"].iloc[3].dtype.name == "int8"
    assert pd.isna(df["label"].iloc[4]) and df["teacher_logprobs"].iloc[0] is None


def test_stats_match_an_independent_computation(tmp_path):
    rows = _rows()
    rows[5]["weight_versions"] = [4] * len(rows[5]["weight_versions"])
    write_shard(tmp_path / "s", rows, shard_meta(step=2), rows_per_part=5)
    stats = shard_stats(open_shard(tmp_path / "s"))
    rewards = [r["reward"] for r in rows]
    mean = sum(rewards) / len(rewards)
    lengths = sorted(len(r["response_token_ids"]) for r in rows)
    assert stats["rows"] == 12 and stats["groups"] == 3 and stats["step"] == 2
    assert stats["reward_mean"] == pytest.approx(mean)
    assert stats["reward_std"] == pytest.approx(
        math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)))
    assert stats["response_len"] == {"mean": pytest.approx(sum(lengths) / 12), "min": lengths[0],
                                     "max": lengths[-1], "p50": lengths[6]}
    assert stats["status_counts"] == {"completed": 11, "truncated": 1}
    assert (stats["weight_version_min"], stats["weight_version_max"]) == (0, 4)  # -1 = not generated


def test_empty_shard(tmp_path):
    manifest = write_shard(tmp_path / "s", [], shard_meta())
    assert manifest["num_rows"] == 0 and len(manifest["parts"]) == 1
    stats = shard_stats(open_shard(tmp_path / "s"))
    assert stats["rows"] == 0 and stats["weight_version_min"] is None


def test_writer_refuses_existing_and_leaves_nothing_on_a_bad_row(tmp_path):
    write_shard(tmp_path / "s", shard_rows(random_rewards()), shard_meta())
    with pytest.raises(BadInputError, match="already a complete shard"):
        write_shard(tmp_path / "s", shard_rows(random_rewards()), shard_meta())
    (tmp_path / "partial").mkdir()
    with pytest.raises(BadInputError, match="not a complete shard"):
        write_shard(tmp_path / "partial", shard_rows(random_rewards()), shard_meta())
    rows = shard_rows(random_rewards(4, 3))
    rows[-1]["status"] = "exploded"  # in the second part: the first part was already written
    with pytest.raises(ShardSchemaError, match="unknown status 'exploded'"):
        write_shard(tmp_path / "bad", rows, shard_meta(), rows_per_part=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["partial", "s"]


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.update(uid=None), "uid is null"),
    (lambda r: r.pop("status"), "status is null"),
    (lambda r: r.update(response_token_ids="abc"), "does not fit the shard schema"),
    (lambda r: r.update(weight_versions=r["weight_versions"][:-1]), "weight_versions has"),
    (lambda r: r.update(rollout_logprobs=[None] * len(r["rollout_logprobs"])), "null element"),
    (lambda r: r.update(reward=float("inf")), "reward contains non-finite"),
    (lambda r: r.update(teacher_logprobs=[0.0]), "teacher_logprobs length"),
])
def test_writer_rejects_bad_rows(tmp_path, mutate, match):
    rows = shard_rows(random_rewards())
    mutate(rows[1])
    with pytest.raises(ShardSchemaError, match=match):
        write_shard(tmp_path / "s", rows, shard_meta())
    assert not (tmp_path / "s").exists()


def test_tokenizer_mismatch(tmp_path):
    write_shard(tmp_path / "s", shard_rows(random_rewards()), shard_meta(tokenizer_hash="a" * 16))
    with pytest.raises(TokenizerMismatchError, match="a" * 16):
        open_shard(tmp_path / "s", expected_tokenizer_hash="b" * 16)


def test_reader_rejects_foreign_parquet_without_metadata(tmp_path):
    table = pa.Table.from_pylist(shard_rows(random_rewards()), schema=SCHEMA)
    write_raw_shard(tmp_path / "s", [table])
    pq.write_table(table, tmp_path / "plain.parquet")  # no rltool.* metadata
    (tmp_path / "s" / "part-00000.parquet").write_bytes((tmp_path / "plain.parquet").read_bytes())
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    from rltool.data.shards import file_xxh3_128

    manifest["parts"][0]["xxh3_128"] = file_xxh3_128(tmp_path / "s" / "part-00000.parquet")
    (tmp_path / "s" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardSchemaError, match="file metadata lacks"):
        open_shard(tmp_path / "s")


def test_statuses_and_make_row():
    assert STATUSES == ("completed", "truncated", "aborted", "failed")
    row = make_row(uid="u", metadata={"b": 1, "a": 2})
    assert row["metadata"] == '{"a": 2, "b": 1}' and row["label"] is None


def test_docs_formats_column_table_matches_the_schema():
    """docs/formats.md documents exactly the columns, types and nullability of SCHEMA."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "formats.md").read_text()
    section = text.split("### Columns", 1)[1].split("###", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \| `([^`]+)` \| (yes|no) \|", section, flags=re.M)
    assert [name for name, _, _ in documented] == DOCUMENTED_COLUMNS == list(SCHEMA.names)
    for name, arrow_type, nullable in documented:
        field = SCHEMA.field(name)
        assert str(field.type).replace("<item: ", "<") == arrow_type.replace("float32", "float"), name
        assert field.nullable == (nullable == "yes"), name


def test_round_trip_property(tmp_path_factory):
    """Any valid rows, any part/row-group sizes: what is read back is what was written."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    token = st.integers(0, 2**31 - 1)
    logprob = st.floats(-50.0, 0.0, width=32)

    @st.composite
    def row(draw, i):
        n = draw(st.integers(0, 6))
        return make_row(
            uid=f"u{i}", prompt_id=draw(st.text(max_size=5)), group_id=draw(st.integers(0, 2**40)),
            sample_index=draw(st.integers(0, 2**31 - 1)), prompt=draw(st.text(max_size=20)),
            prompt_token_ids=draw(st.lists(token, max_size=5)), response=draw(st.text(max_size=20)),
            response_token_ids=draw(st.lists(token, min_size=n, max_size=n)),
            rollout_logprobs=draw(st.lists(logprob, min_size=n, max_size=n)),
            loss_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
            weight_versions=draw(st.lists(st.integers(-1, 1000), min_size=n, max_size=n)),
            reward=draw(st.floats(-10, 10, width=32)), status=draw(st.sampled_from(STATUSES)),
            finish_reason="stop", label=draw(st.none() | st.text(max_size=5)),
            rewards=draw(st.none() | st.dictionaries(st.text(max_size=4), st.floats(-1, 1, width=32),
                                                       max_size=2)),
            teacher_logprobs=draw(st.none() | st.lists(logprob, min_size=n, max_size=n)),
            metadata={"i": i})

    rows_st = st.integers(0, 9).flatmap(lambda k: st.tuples(*[row(i) for i in range(k)]))

    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(rows=rows_st, rows_per_part=st.integers(1, 5), row_group_size=st.integers(1, 4))
    def check(rows, rows_per_part, row_group_size):
        out = tmp_path_factory.mktemp("prop") / "s"
        manifest = write_shard(out, list(rows), shard_meta(), rows_per_part=rows_per_part,
                               row_group_size=row_group_size)
        assert manifest["num_rows"] == len(rows)
        back = open_shard(out).rows()
        for want, got in zip(rows, back, strict=True):
            if got["rewards"] is not None:
                got["rewards"] = dict(got["rewards"])
            assert got == want

    check()


def test_routed_experts_column_round_trip_and_refusals(tmp_path):
    """rollout_routed_experts (schema 1.1): uint16 [tokens - 1, layers x k], -1 (a dense layer,
    or a token after the engine's last turn) stored as 0xFFFF; a value of the wrong size is
    refused by the writer and the reader."""
    import numpy as np

    rows = shard_rows(random_rewards(1, 2, seed=3), seed=3)
    tokens = len(rows[0]["prompt_token_ids"]) + len(rows[0]["response_token_ids"])
    ids = np.arange((tokens - 2) * 4).reshape(tokens - 2, 4) % 300  # one token short
    ids[0, 1] = -1
    rows[0]["rollout_routed_experts"] = encode_routed_experts(ids, tokens)
    write_shard(tmp_path / "s", rows, shard_meta())
    back = open_shard(tmp_path / "s").rows()
    got = decode_routed_experts(back[0]["rollout_routed_experts"], tokens)
    assert got.shape == (tokens - 1, 4) and got.dtype == np.int32
    np.testing.assert_array_equal(got[:-1], ids)
    assert (got[-1] == -1).all() and back[1]["rollout_routed_experts"] is None
    with pytest.raises(BadInputError, match="do not fit"):
        encode_routed_experts(np.zeros((tokens, 4)), tokens)
    rows[1]["rollout_routed_experts"] = b"\x00" * 6
    with pytest.raises(ShardSchemaError, match="rollout_routed_experts holds 6 bytes"):
        write_shard(tmp_path / "bad", rows, shard_meta())


def test_a_shard_of_schema_1_0_still_reads(tmp_path):
    """A shard written before rollout_routed_experts existed (schema version "1", no column)
    reads with the column null; a newer major version or minor is refused."""
    table = pa.Table.from_pylist(shard_rows(random_rewards(1, 2)), schema=SCHEMA)
    old = table.drop_columns(["rollout_routed_experts", "turn_rewards", "turn_starts"])
    meta = shard_meta()
    meta.schema_version = "1"
    write_raw_shard(tmp_path / "old", [old], meta=meta)
    shard = open_shard(tmp_path / "old")
    assert [r["rollout_routed_experts"] for r in shard.rows()] == [None, None]
    assert [(r["turn_rewards"], r["turn_starts"]) for r in shard.rows()] == [(None, None)] * 2
    assert shard.read(columns=["uid", "rollout_routed_experts"]).num_rows == 2
    for version in ("2", "1.3", "x"):
        meta.schema_version = version
        write_raw_shard(tmp_path / version, [old], meta=meta)
        with pytest.raises(ShardSchemaError, match=f"schema version {version} is not"):
            open_shard(tmp_path / version)
