"""`rltool shards inspect`: summary of a valid shard, and one clear error (exit 2) per defect."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from click.testing import CliRunner

from rltool.cli import main
from rltool.data.shards import MANIFEST, SCHEMA, write_shard
from tests.helpers.shards import random_rewards, shard_meta, shard_rows, write_raw_shard


def _inspect(path, *extra):
    return CliRunner().invoke(main, ["shards", "inspect", str(path), *extra])


def test_inspect_valid_shard(tmp_path):
    rows = shard_rows(random_rewards(3, 2), version=2)
    rows[0]["status"] = "truncated"
    rows[1]["weight_versions"] = [3] * len(rows[1]["weight_versions"])
    write_shard(tmp_path / "s", rows, shard_meta(step=4), rows_per_part=4)
    result = _inspect(tmp_path / "s", "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    rewards = [r["reward"] for r in rows]
    assert stats["rows"] == 6 and stats["groups"] == 3 and stats["step"] == 4
    assert stats["reward_mean"] == pytest.approx(sum(rewards) / 6)
    assert stats["status_counts"] == {"completed": 5, "truncated": 1}
    assert (stats["weight_version_min"], stats["weight_version_max"]) == (2, 3)
    assert stats["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    lengths = [len(r["response_token_ids"]) for r in rows]
    assert stats["response_len"]["max"] == max(lengths)

    human = _inspect(tmp_path / "s")
    assert human.exit_code == 0
    for text in ("rows", "6", "groups", "reward mean", "completed=5", "truncated=1", "2..3"):
        assert text in human.output


def _table(mutate=None):
    rows = shard_rows(random_rewards())
    if mutate:
        mutate(rows)
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def _set(i, **values):
    def mutate(rows):
        rows[i].update(values)
    return mutate


def _nullable_schema():
    return pa.schema([f.with_nullable(True) for f in SCHEMA])


def _rewrite_part(path, index, table, *, metadata):
    """Replace part `index` with `table` carrying `metadata`, keeping the manifest consistent."""
    import pyarrow.parquet as pq

    from rltool.data.shards import file_xxh3_128

    part = path / f"part-{index:05d}.parquet"
    pq.write_table(table.replace_schema_metadata(metadata), part)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["parts"][index]["xxh3_128"] = file_xxh3_128(part)
    (path / MANIFEST).write_text(json.dumps(manifest))


def _build(kind, path):
    """Write a shard at `path` with one defect of `kind`."""
    if kind == "missing-column":
        write_raw_shard(path, [_table().drop_columns(["loss_mask"])])
    elif kind == "wrong-type":
        t = _table()
        idx = t.schema.get_field_index("loss_mask")
        write_raw_shard(path, [t.set_column(idx, "loss_mask",
                                            t["loss_mask"].cast(pa.list_(pa.int32())))])
    elif kind in ("length-logprobs", "length-mask", "length-versions"):
        col = {"length-logprobs": "rollout_logprobs", "length-mask": "loss_mask",
               "length-versions": "weight_versions"}[kind]
        write_raw_shard(path, [_table(lambda rows: rows[4][col].append(rows[4][col][0]))])
    elif kind == "unknown-status":
        write_raw_shard(path, [_table(_set(2, status="exploded"))])
    elif kind == "nan-logprob":
        write_raw_shard(path, [_table(lambda rows: rows[1]["rollout_logprobs"].__setitem__(
            0, float("nan")))])
    elif kind == "inf-logprob":
        write_raw_shard(path, [_table(lambda rows: rows[1]["rollout_logprobs"].__setitem__(
            0, float("-inf")))])
    elif kind == "null-required":
        rows = shard_rows(random_rewards())
        rows[3]["prompt_id"] = None
        write_raw_shard(path, [pa.Table.from_pylist(rows, schema=_nullable_schema())])
    elif kind == "no-metadata":
        write_raw_shard(path, [_table()])
        _rewrite_part(path, 0, _table(), metadata=None)
    elif kind == "bad-metadata":
        write_raw_shard(path, [_table()])
        raw = shard_meta().to_parquet()
        raw[b"rltool.sampling"] = b"{not json"
        _rewrite_part(path, 0, _table(), metadata=raw)
    elif kind == "meta-mismatch":
        write_raw_shard(path, [_table(), _table()])
        _rewrite_part(path, 1, _table(), metadata=shard_meta(tokenizer_hash="f" * 16).to_parquet())
    else:
        write_shard(path, shard_rows(random_rewards(4, 3)), shard_meta(), rows_per_part=6)
        manifest = json.loads((path / MANIFEST).read_text())
        if kind == "missing-part":
            (path / "part-00001.parquet").unlink()
        elif kind == "checksum":
            part = path / "part-00000.parquet"
            data = bytearray(part.read_bytes())
            data[len(data) // 2] ^= 0xFF
            part.write_bytes(bytes(data))
        elif kind == "no-success":
            (path / MANIFEST).unlink()
        elif kind == "corrupt-manifest":
            (path / MANIFEST).write_text('{"parts": [')
        elif kind == "manifest-bad-part":
            manifest["parts"][0] = {"file": "../../etc/passwd", "rows": 1, "xxh3_128": "0"}
            (path / MANIFEST).write_text(json.dumps(manifest))
        elif kind == "total-rows":
            manifest["num_rows"] += 1
            (path / MANIFEST).write_text(json.dumps(manifest))
        elif kind == "part-rows":
            manifest["parts"][1]["rows"] += 1
            (path / MANIFEST).write_text(json.dumps(manifest))
        else:
            raise AssertionError(kind)


DEFECTS = {
    "missing-column": "missing column(s) loss_mask",
    "wrong-type": "column loss_mask has type list<element: int32>, expected list<item: int8>",
    "length-logprobs": "row 4 (uid g1-s1): rollout_logprobs has",
    "length-mask": "row 4 (uid g1-s1): loss_mask has",
    "length-versions": "row 4 (uid g1-s1): weight_versions has",
    "unknown-status": "row 2: unknown status 'exploded'",
    "nan-logprob": "rollout_logprobs contains non-finite values",
    "inf-logprob": "rollout_logprobs contains non-finite values",
    "null-required": "row 3: prompt_id is null",
    "no-metadata": "file metadata lacks",
    "bad-metadata": "corrupt rltool.* file metadata",
    "meta-mismatch": "part-00001.parquet: file metadata differs from the first part's",
    "missing-part": "part file part-00001.parquet listed in _SUCCESS is missing",
    "checksum": "checksum mismatch",
    "no-success": "no _SUCCESS manifest, so the shard is incomplete",
    "corrupt-manifest": "corrupt manifest",
    "manifest-bad-part": "corrupt manifest",
    "total-rows": "parts hold 12 rows but _SUCCESS says 13",
    "part-rows": "part-00001.parquet: has 6 rows but _SUCCESS says 7",
}


@pytest.mark.parametrize("kind", sorted(DEFECTS))
def test_each_defect_has_its_own_error_and_exit_2(tmp_path, kind):
    path = tmp_path / "shard"
    _build(kind, path)
    result = _inspect(path, "--json")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""  # nothing half-printed on stdout
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert DEFECTS[kind] in lines[0]
    # each defect's message is specific to it, not a catch-all
    assert not [k for k, msg in DEFECTS.items() if msg != DEFECTS[kind] and msg in lines[0]]


def test_not_a_shard_directory(tmp_path):
    result = _inspect(tmp_path / "nope")
    assert result.exit_code == 2 and "no such shard directory" in result.output
    (tmp_path / "file").write_text("x")
    assert _inspect(tmp_path / "file").exit_code == 2


def test_inspect_checks_the_tokenizer(tmp_path, tiny_model_dir):
    from rltool.data.tokenizer import tokenizer_hash

    rows = shard_rows(random_rewards())
    write_shard(tmp_path / "ok", rows, shard_meta(tokenizer_hash=tokenizer_hash(tiny_model_dir)))
    write_shard(tmp_path / "other", rows, shard_meta(tokenizer_hash="f" * 16))
    assert _inspect(tmp_path / "ok", "--tokenizer", str(tiny_model_dir)).exit_code == 0
    result = _inspect(tmp_path / "other", "--tokenizer", str(tiny_model_dir))
    assert result.exit_code == 2 and "written with tokenizer ffffffffffffffff" in result.output
    result = _inspect(tmp_path / "ok", "--tokenizer", str(tmp_path))
    assert result.exit_code == 2 and "has no tokenizer.json" in result.output
