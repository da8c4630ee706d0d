"""The readers of files a stage is handed, under generated input: safetensors headers, checkpoint
and delta indexes, rollout shards and TOML configs. Each must answer a typed rltool error (exit
2, one line) or succeed, never raise anything else, and write nothing. Example counts are fixed
(EXAMPLES) so the test's time is bounded; docs/reliability.md records the totals."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rltool.config import read_toml
from rltool.delta.deltadir import open_delta
from rltool.errors import EXIT_BAD_INPUT, RltoolError
from rltool.io.checkpoint import open_checkpoint
from rltool.io.header import INDEX_NAME, parse_header

EXAMPLES = 150
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
NAMES = st.sampled_from(["model.safetensors", "../x", "/etc/passwd", "a/../../b", "", ".",
                         "model-00001-of-00002.safetensors", "x" * 300, "\x00"])
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | NAMES
JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8) | NAMES, inner, max_size=4),
                    max_leaves=16)
KEYS = st.sampled_from(["weight_map", "metadata", "rltool_delta", "files", "removed_files",
                        "format", "version", "base_version", "dtype", "shape", "data_offsets",
                        "__metadata__", "xxh3_128", "encoding", "total_size"])
INDEX = st.dictionaries(KEYS, JSON | st.dictionaries(KEYS | NAMES, JSON, max_size=4), max_size=6)


def refused_or_read(call, *, where: Path) -> None:
    before = sorted(p.name for p in where.rglob("*"))
    try:
        call()
    except RltoolError as e:
        assert e.exit_code == EXIT_BAD_INPUT and "\n" not in str(e) and str(e), repr(e)
    assert sorted(p.name for p in where.rglob("*")) == before


@pytest.fixture()
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def header_file(header: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + body


@SETTINGS
@given(data=st.binary(max_size=200) | st.builds(
    lambda h, b: header_file(json.dumps(h).encode(), b),
    st.dictionaries(st.text(max_size=6), st.dictionaries(KEYS, JSON, max_size=3), max_size=3),
    st.binary(max_size=64)))
def test_safetensors_header_reader_under_generated_files(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("st")
    (d / "model.safetensors").write_bytes(data)
    refused_or_read(lambda: parse_header(d / "model.safetensors"), where=d)
    refused_or_read(lambda: open_checkpoint(d).tensors(), where=d)


@SETTINGS
@given(index=INDEX | JSON, raw=st.binary(max_size=40), use_raw=st.booleans())
def test_checkpoint_and_delta_index_readers_under_generated_indexes(tmp_path_factory, index, raw,
                                                                    use_raw):
    d = tmp_path_factory.mktemp("idx")
    (d / INDEX_NAME).write_bytes(raw if use_raw else json.dumps(index).encode())
    refused_or_read(lambda: open_checkpoint(d).tensors(), where=d)
    refused_or_read(lambda: open_delta(d), where=d)


@SETTINGS
@given(text=st.text(max_size=200) | st.builds(
    lambda k, v: f"[{k}]\n{v}", st.sampled_from(["rollout", "train", "loop", "model", "x"]),
    st.text(max_size=80)))
def test_config_loader_under_generated_toml(tmp_path_factory, text):
    d = tmp_path_factory.mktemp("toml")
    (d / "run.toml").write_bytes(text.encode("utf-8", "surrogatepass"))
    refused_or_read(lambda: read_toml(d / "run.toml"), where=d)


@SETTINGS
@given(manifest=INDEX | JSON, part=st.binary(max_size=200), keep_part=st.booleans())
def test_shard_reader_under_generated_manifests_and_parts(shard_template, tmp_path_factory,
                                                          manifest, part, keep_part):
    from rltool.data.shards import MANIFEST, open_shard

    d = tmp_path_factory.mktemp("shard") / "step-000000"
    shutil.copytree(shard_template, d)
    if keep_part:
        (d / MANIFEST).write_text(json.dumps(manifest))
    else:
        next(d.glob("*.parquet")).write_bytes(part)
    refused_or_read(lambda: open_shard(d).read(), where=d)


@pytest.fixture(scope="module")
def shard_template(tiny_model_dir, tmp_path_factory) -> Path:
    from rltool.data.shards import ShardMeta, make_row, write_shard

    out = tmp_path_factory.mktemp("tpl") / "step-000000"
    meta = ShardMeta(step=0, producer="test", tokenizer_hash="h", sampling={})
    write_shard(out, [make_row(uid="g0-s0", prompt_id="p0", group_id=0, sample_index=0,
                               prompt="p", prompt_token_ids=[5, 6], response="x",
                               response_token_ids=[7], rollout_logprobs=[-0.5], loss_mask=[1],
                               weight_versions=[0], reward=1.0, status="completed",
                               finish_reason="stop", label="x")], meta)
    return out
