"""Rollout shards: Parquet part files + a `_SUCCESS` manifest, one row per sample.

Schema and file metadata: docs/formats.md. A shard directory is published atomically (built under a
temporary name, `_SUCCESS` written last, renamed), so a directory that exists is complete; readers
still verify the manifest: part files present, row counts and xxh3-128 checksums equal, columns
and per-row invariants valid. Any defect raises `ShardSchemaError` naming the shard and the defect.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from rltool import atomic
from rltool.faults import kill_point
from rltool.errors import BadInputError, ShardSchemaError, TokenizerMismatchError

# "major.minor": a reader takes its own major version and any minor up to its own (a minor
# version only adds optional columns; a part file without one reads it as nulls).
SCHEMA_VERSION = "1.2"
MANIFEST = "_SUCCESS"
STATUSES = ("completed", "truncated", "aborted", "failed")
PER_TOKEN_COLUMNS = ("rollout_logprobs", "loss_mask", "weight_versions")
META_PREFIX = "rltool."

SCHEMA = pa.schema([
    pa.field("uid", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("group_id", pa.int64(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response", pa.string(), nullable=False),
    pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("weight_versions", pa.list_(pa.int32()), nullable=False),
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("rewards", pa.map_(pa.string(), pa.float32()), nullable=True),
    pa.field("status", pa.string(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("label", pa.string(), nullable=True),
    pa.field("teacher_logprobs", pa.list_(pa.float32()), nullable=True),
    pa.field("metadata", pa.string(), nullable=False),
    pa.field("rollout_routed_experts", pa.binary(), nullable=True),  # since 1.1
    # Agentic episodes (rltool.rollout.episode), since 1.2: each model turn's reward, and the
    # response-token offset where each model turn starts; null for single-turn samples.
    pa.field("turn_rewards", pa.list_(pa.float32()), nullable=True),
    pa.field("turn_starts", pa.list_(pa.int32()), nullable=True),
])
COLUMNS = tuple(SCHEMA.names)
OPTIONAL_COLUMNS = ("rollout_routed_experts", "turn_rewards", "turn_starts")  # absent from files
# of an older minor version
NO_EXPERT = 0xFFFF  # rollout_routed_experts: a dense layer, or a token the engine did not route


@dataclass
class ShardMeta:
    """File-level metadata stored in every part file's Parquet key/value metadata."""

    tokenizer_hash: str
    step: int
    producer: str
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, top_k, ...
    schema_version: str = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_parquet(self) -> dict[bytes, bytes]:
        items = {"schema_version": str(self.schema_version), "tokenizer_hash": self.tokenizer_hash,
                 "step": str(self.step), "producer": self.producer,
                 "sampling": json.dumps(self.sampling, sort_keys=True),
                 "extra": json.dumps(self.extra, sort_keys=True)}
        return {(META_PREFIX + k).encode(): v.encode() for k, v in items.items()}

    @classmethod
    def from_parquet(cls, raw: dict[bytes, bytes] | None, *, where: str) -> "ShardMeta":
        raw = raw or {}
        kv = {k.decode()[len(META_PREFIX):]: v.decode() for k, v in raw.items()
              if k.decode().startswith(META_PREFIX)}
        missing = [k for k in ("schema_version", "tokenizer_hash", "step", "producer", "sampling")
                   if k not in kv]
        if missing:
            raise ShardSchemaError(f"{where}: file metadata lacks {', '.join(missing)}; "
                                   "the shard was not written by rltool's shard writer")
        if not readable_version(kv["schema_version"]):
            raise ShardSchemaError(f"{where}: schema version {kv['schema_version']} is not "
                                   f"{SCHEMA_VERSION} or an older 1.x; re-create the shard with "
                                   "this rltool, or read it with the rltool that wrote it")
        try:
            return cls(tokenizer_hash=kv["tokenizer_hash"], step=int(kv["step"]),
                       producer=kv["producer"], sampling=json.loads(kv["sampling"]),
                       schema_version=kv["schema_version"],
                       extra=json.loads(kv.get("extra", "{}")))
        except ValueError as e:  # a non-integer step, or sampling/extra that is not JSON
            raise ShardSchemaError(f"{where}: corrupt rltool.* file metadata ({e})") from e


def readable_version(version: str) -> bool:
    """Whether this reader takes a file of schema `version` ("1" is "1.0")."""
    want_major, want_minor = (int(x) for x in SCHEMA_VERSION.split("."))
    major, _, minor = version.partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        return False
    return int(major) == want_major and int(minor or "0") <= want_minor


def encode_routed_experts(ids: Any, num_tokens: int) -> bytes:
    """The `rollout_routed_experts` value of a sample of `num_tokens` tokens: expert ids [n, W]
    (n <= num_tokens - 1 routed tokens, W = MoE layers x top-k; -1 for none) as little-endian
    uint16 [num_tokens - 1, W], tokens past n marked NO_EXPERT."""
    import numpy as np

    ids = np.asarray(ids, dtype=np.int64).reshape(len(ids), -1)
    rows = max(num_tokens - 1, 0)
    if len(ids) > rows or (ids >= NO_EXPERT).any():
        raise BadInputError(f"routed experts of {len(ids)} tokens with ids up to "
                            f"{int(ids.max(initial=0))} do not fit a sample of {num_tokens} tokens "
                            f"(at most {rows} tokens, ids below {NO_EXPERT})")
    out = np.full((rows, ids.shape[1]), NO_EXPERT, dtype="<u2")
    out[:len(ids)] = np.where(ids < 0, NO_EXPERT, ids)
    return out.tobytes()


def decode_routed_experts(raw: bytes, num_tokens: int) -> Any:
    """int32 [num_tokens - 1, W] (-1: none) from a `rollout_routed_experts` value."""
    import numpy as np

    ids = np.frombuffer(raw, dtype="<u2").astype(np.int32).reshape(max(num_tokens - 1, 0), -1)
    ids[ids == NO_EXPERT] = -1
    return ids


def file_xxh3_128(path: str | os.PathLike) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def make_row(**values: Any) -> dict[str, Any]:
    """A row with the optional columns defaulted; `metadata` may be a dict (stored as JSON)."""
    row = {"rewards": None, "label": None, "teacher_logprobs": None, "metadata": "{}",
           "rollout_routed_experts": None, "turn_rewards": None, "turn_starts": None, **values}
    if not isinstance(row["metadata"], str):
        row["metadata"] = json.dumps(row["metadata"], sort_keys=True)
    return row


def write_shard(out: str | os.PathLike, rows: Iterable[dict[str, Any]], meta: ShardMeta, *,
                rows_per_part: int = 4096, row_group_size: int = 512) -> dict[str, Any]:
    """Write rows as a complete shard directory; refuses to replace an existing one.

    Returns the manifest. Rows are validated on the way in, so a bad producer fails here rather
    than in the trainer.
    """
    out = Path(out)
    if (out / MANIFEST).exists():
        raise BadInputError(f"{out} is already a complete shard; choose a new --out or delete it")
    if out.exists():
        raise BadInputError(f"{out} exists but is not a complete shard; delete it or choose "
                            "a new --out")
    parts: list[dict[str, Any]] = []
    with atomic.publish_dir(out) as tmp:
        buf: list[dict[str, Any]] = []

        def flush() -> None:
            try:
                table = pa.Table.from_pylist(buf, schema=SCHEMA)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                raise ShardSchemaError(f"{out} (being written): a row does not fit the shard "
                                       f"schema: {e}") from e
            table = table.replace_schema_metadata(meta.to_parquet())
            _validate_table(table, where=f"{out} (being written)")
            name = f"part-{len(parts):05d}.parquet"
            pq.write_table(table, tmp / name, row_group_size=row_group_size, compression="zstd")
            parts.append({"file": name, "rows": table.num_rows,
                          "xxh3_128": file_xxh3_128(tmp / name)})
            buf.clear()
            kill_point("shard.part")

        for row in rows:
            buf.append(row)
            if len(buf) >= rows_per_part:
                flush()
        if buf or not parts:
            flush()
        manifest = {"schema_version": SCHEMA_VERSION, "num_rows": sum(p["rows"] for p in parts),
                    "parts": parts, "step": meta.step, "producer": meta.producer,
                    "tokenizer_hash": meta.tokenizer_hash}
        atomic.write_json(tmp / MANIFEST, manifest)
    return manifest


def _check_schema(schema: pa.Schema, *, where: str) -> None:
    missing = [c for c in COLUMNS if c not in schema.names and c not in OPTIONAL_COLUMNS]
    if missing:
        raise ShardSchemaError(f"{where}: missing column(s) {', '.join(missing)}")
    for name in COLUMNS:
        if name not in schema.names:
            continue
        want = SCHEMA.field(name).type
        got = schema.field(name).type
        if got != want:
            raise ShardSchemaError(f"{where}: column {name} has type {got}, expected {want}")


def _with_optional_columns(table: pa.Table) -> pa.Table:
    """A table of an older minor version with the columns it predates, all null."""
    missing = [name for name in OPTIONAL_COLUMNS if name not in table.schema.names]
    if not missing:
        return table
    for name in missing:
        table = table.append_column(SCHEMA.field(name),
                                    pa.nulls(table.num_rows, SCHEMA.field(name).type))
    # In the schema's order, so batches of old and new files concatenate.
    return table.select([n for n in SCHEMA.names if n in table.schema.names])


def _validate_table(table: pa.Table, *, where: str) -> None:
    _check_schema(table.schema, where=where)
    if table.num_rows == 0:
        return
    for f in SCHEMA:
        # Parquet files from other writers may declare every column nullable; the schema's
        # non-null columns must hold no nulls, and no list may hold null elements.
        column = table[f.name]
        if not f.nullable and column.null_count:
            i = pc.index(pc.is_null(column), True).as_py()
            raise ShardSchemaError(f"{where}: row {i}: {f.name} is null; it is required")
        if pa.types.is_list(f.type) and pc.list_flatten(column).null_count:
            i = next(i for i, v in enumerate(column.to_pylist()) if v and None in v)
            raise ShardSchemaError(f"{where}: row {i}: {f.name} holds a null element")
    resp_len = pc.list_value_length(table["response_token_ids"])
    for name in PER_TOKEN_COLUMNS:
        bad = pc.not_equal(pc.list_value_length(table[name]), resp_len)
        if pc.any(bad).as_py():
            i = pc.index(bad, True).as_py()
            raise ShardSchemaError(
                f"{where}: row {i} (uid {table['uid'][i].as_py()}): {name} has "
                f"{len(table[name][i])} entries but the response has {resp_len[i].as_py()} tokens")
    teacher = table["teacher_logprobs"]
    if teacher.null_count < len(teacher):
        bad = pc.and_(pc.is_valid(teacher),
                      pc.not_equal(pc.list_value_length(teacher), resp_len))
        if pc.any(bad).as_py():
            i = pc.index(bad, True).as_py()
            raise ShardSchemaError(f"{where}: row {i}: teacher_logprobs length differs from "
                                   "the response length")
    routed = table["rollout_routed_experts"]
    if routed.null_count < len(routed):  # uint16 [tokens - 1, W] per row
        tokens = pc.add(pc.list_value_length(table["prompt_token_ids"]), resp_len).to_pylist()
        for i, (n, t) in enumerate(zip(pc.binary_length(routed).to_pylist(), tokens)):
            if n is not None and (n % (2 * max(t - 1, 1)) or (t <= 1 and n)):
                raise ShardSchemaError(f"{where}: row {i}: rollout_routed_experts holds {n} "
                                       f"bytes, not 2 x {max(t - 1, 0)} (tokens - 1) x the "
                                       "experts per token")
    _validate_turns(table, resp_len, where=where)
    bad_status = pc.invert(pc.is_in(table["status"], value_set=pa.array(STATUSES)))
    if pc.any(bad_status).as_py():
        i = pc.index(bad_status, True).as_py()
        raise ShardSchemaError(f"{where}: row {i}: unknown status {table['status'][i].as_py()!r}; "
                               f"expected one of {', '.join(STATUSES)}")
    for name in ("rollout_logprobs", "teacher_logprobs"):
        flat = pc.list_flatten(table[name])
        if len(flat) and not pc.all(pc.is_finite(flat)).as_py():
            raise ShardSchemaError(f"{where}: {name} contains non-finite values (NaN or inf)")
    rewards = table["reward"]
    if len(rewards) and not pc.all(pc.is_finite(rewards)).as_py():
        raise ShardSchemaError(f"{where}: reward contains non-finite values (NaN or inf)")


def _validate_turns(table: pa.Table, resp_len: pa.Array, *, where: str) -> None:
    """turn_rewards and turn_starts: both null or both set, one entry per turn, starts rising
    from 0 within the response, rewards finite."""
    rewards, starts = table["turn_rewards"], table["turn_starts"]
    if rewards.null_count == len(rewards) and starts.null_count == len(starts):
        return
    for i, (r, s, n) in enumerate(zip(rewards.to_pylist(), starts.to_pylist(),
                                      resp_len.to_pylist())):
        if r is None and s is None:
            continue
        if r is None or s is None or len(r) != len(s):
            raise ShardSchemaError(f"{where}: row {i}: turn_rewards and turn_starts must both "
                                   "be set with one entry per turn")
        if any(b <= a for a, b in zip(s, s[1:])) or (s and (s[0] < 0 or s[-1] > n)):
            raise ShardSchemaError(f"{where}: row {i}: turn_starts {s[:8]} must rise within "
                                   f"the response's {n} tokens")
        if not all(math.isfinite(x) for x in r):
            raise ShardSchemaError(f"{where}: row {i}: turn_rewards holds a non-finite value")


@dataclass
class Shard:
    """A verified shard directory: its manifest and metadata; rows are read on demand."""

    path: Path
    manifest: dict[str, Any]
    meta: ShardMeta

    @property
    def num_rows(self) -> int:
        return int(self.manifest["num_rows"])

    def part_paths(self) -> list[Path]:
        return [self.path / p["file"] for p in self.manifest["parts"]]

    def iter_batches(self, *, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
        """Stream record batches (one per row group), validating each part as it is read."""
        for part in self.part_paths():
            pf = pq.ParquetFile(part)
            for i in range(pf.num_row_groups):
                table = _with_optional_columns(pf.read_row_group(i))
                _validate_table(table, where=str(part))
                if columns is not None:
                    table = table.select(columns)
                yield from table.to_batches()

    def read(self, *, columns: list[str] | None = None) -> pa.Table:
        batches = list(self.iter_batches(columns=columns))
        schema = SCHEMA if columns is None else pa.schema([SCHEMA.field(c) for c in columns])
        return pa.Table.from_batches(batches, schema=schema)

    def rows(self) -> list[dict[str, Any]]:
        return self.read().to_pylist()


def open_shard(path: str | os.PathLike, *, expected_tokenizer_hash: str | None = None) -> Shard:
    """Verify a shard's manifest, part files and checksums; return a `Shard` for reading."""
    path = Path(path)
    if not path.is_dir():
        raise ShardSchemaError(f"{path}: no such shard directory; pass the directory that holds "
                               f"part-*.parquet and {MANIFEST}")
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise ShardSchemaError(f"{path}: no {MANIFEST} manifest, so the shard is incomplete; "
                               "re-run the stage that writes it")
    try:
        manifest = json.loads(manifest_path.read_text())
        parts = manifest["parts"]
        num_rows = int(manifest["num_rows"])
        for part in parts:
            # A part name is a plain file name inside the shard, never a path out of it.
            if (not isinstance(part["file"], str) or Path(part["file"]).name != part["file"]
                    or not isinstance(part["xxh3_128"], str)):
                raise ValueError(f"bad part entry {part!r}")
            part["rows"] = int(part["rows"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ShardSchemaError(f"{manifest_path}: corrupt manifest ({e!r}); re-create the "
                               "shard") from e
    meta = None
    total = 0
    for part in parts:
        p = path / part["file"]
        if not p.exists():
            raise ShardSchemaError(f"{path}: part file {part['file']} listed in {MANIFEST} is "
                                   "missing; re-create the shard")
        digest = file_xxh3_128(p)
        if digest != part["xxh3_128"]:
            raise ShardSchemaError(f"{p}: checksum mismatch (xxh3-128 {digest}, manifest says "
                                   f"{part['xxh3_128']}); the file is corrupt or truncated")
        try:
            md = pq.read_metadata(p)
        except (pa.ArrowInvalid, OSError) as e:
            raise ShardSchemaError(f"{p}: not a readable Parquet file ({e})") from e
        if md.num_rows != part["rows"]:
            raise ShardSchemaError(f"{p}: has {md.num_rows} rows but {MANIFEST} says {part['rows']}")
        _check_schema(md.schema.to_arrow_schema(), where=str(p))
        total += md.num_rows
        part_meta = ShardMeta.from_parquet(md.metadata, where=str(p))
        if meta is not None and part_meta != meta:
            raise ShardSchemaError(f"{p}: file metadata differs from the first part's (tokenizer, "
                                   "step, producer or sampling); parts of one shard must agree")
        meta = meta or part_meta
    if total != num_rows:
        raise ShardSchemaError(f"{path}: parts hold {total} rows but {MANIFEST} says {num_rows}")
    if meta is None:
        raise ShardSchemaError(f"{path}: {MANIFEST} lists no part files")
    if expected_tokenizer_hash is not None and meta.tokenizer_hash != expected_tokenizer_hash:
        raise TokenizerMismatchError(
            f"{path}: written with tokenizer {meta.tokenizer_hash} but the model's tokenizer is "
            f"{expected_tokenizer_hash}; use the tokenizer the rollouts were made with")
    return Shard(path=path, manifest=manifest, meta=meta)


def shard_stats(shard: Shard) -> dict[str, Any]:
    """Rows, groups, reward mean/std, response length stats, status counts, weight-version range."""
    table = shard.read(columns=["group_id", "reward", "response_token_ids", "status",
                                "weight_versions"])
    rewards = table["reward"].to_pylist()
    lengths = pc.list_value_length(table["response_token_ids"]).to_pylist()
    versions = [v for v in pc.list_flatten(table["weight_versions"]).to_pylist() if v >= 0]
    statuses: dict[str, int] = {}
    for s in table["status"].to_pylist():
        statuses[s] = statuses.get(s, 0) + 1
    n = len(rewards)
    mean = sum(rewards) / n if n else 0.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n) if n else 0.0
    sorted_len = sorted(lengths)
    return {
        "path": str(shard.path), "rows": n, "groups": len(set(table["group_id"].to_pylist())),
        "step": shard.meta.step, "producer": shard.meta.producer,
        "tokenizer_hash": shard.meta.tokenizer_hash, "sampling": shard.meta.sampling,
        "reward_mean": mean, "reward_std": std,
        "response_len": {"mean": sum(lengths) / n if n else 0.0,
                         "min": sorted_len[0] if n else 0, "max": sorted_len[-1] if n else 0,
                         "p50": sorted_len[n // 2] if n else 0},
        "status_counts": statuses,
        "weight_version_min": min(versions) if versions else None,
        "weight_version_max": max(versions) if versions else None,
    }
