"""Encode a delta version directory from a base checkpoint and new weights (both formats).

Streaming: each worker thread reads one tensor chunk by chunk (`CHUNK_ELEMENTS` elements) from the
base and the new weights, hashes and encodes it; at most `2 * workers` encoded tensors wait to be
appended to the blob file, in a fixed order, so memory stays bounded by a few tensors' deltas.
"""

from __future__ import annotations

import collections
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from rltool import atomic
from rltool.delta import codec
from rltool.delta.deltadir import (CHECKSUM_FORMAT, DELTA_FILE, FORMATS, RLTOOL_ENCODING,
                                   SLIME_ENCODINGS, format_version)
from rltool.errors import BadInputError
from rltool.io.checkpoint import Checkpoint
from rltool.io.header import INDEX_NAME, element_size
from rltool.io.writer import BlobWriter, reserve_for
from rltool.progress import Progress


@dataclass
class _Encoded:
    name: str
    blob: bytes | None  # None: tensor unchanged
    checksum: str
    numel: int
    changed: int  # changed elements
    record: dict = field(default_factory=dict)


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _check_same_tensors(base: Checkpoint, new: Checkpoint) -> None:
    base_names, new_names = set(base.names()), set(new.names())
    if base_names != new_names:
        diff = sorted(base_names ^ new_names)[:3]
        raise BadInputError(f"base and new checkpoints hold different tensors (e.g. {diff}); "
                            "a delta needs identical names, dtypes and shapes: publish a full version")
    for name in base.names():
        if base.spec(name)[:2] != new.spec(name)[:2]:
            raise BadInputError(f"tensor {name!r} changed dtype or shape ({base.spec(name)[:2]} -> "
                                f"{new.spec(name)[:2]}); publish a full version")


def _encode_tensor(name: str, base: Checkpoint, new: Checkpoint, *, fmt: str,
                   encoding: str) -> _Encoded:
    dtype, shape, nbytes = new.spec(name)
    width = codec.element_width(element_size(dtype), nbytes)
    numel = nbytes // width
    step = codec.CHUNK_ELEMENTS * width
    digest = xxhash.xxh3_128()
    changed = 0
    parts: list[bytes] = []
    records: list[list] = []
    positions: list[np.ndarray] = []
    values: list[np.ndarray] = []
    slime_xor = codec.SlimeXorEncoder(nbytes) if (fmt, encoding) == ("slime", "xor") else None
    if (fmt, encoding) == ("slime", "overwrite") and nbytes >= 1 << 32:
        raise BadInputError(f"tensor {name!r} is {nbytes} bytes, past the 4 GiB the overwrite "
                            "encoding's u32 positions can address; use --encoding xor")
    for off in range(0, nbytes, step):
        n = min(step, nbytes - off)
        old, cur = base.view(name, offset=off, nbytes=n), new.view(name, offset=off, nbytes=n)
        if fmt == "rltool":
            rec, payload = codec.encode_chunk(old, cur, width=width, digest=digest)
            records.append(rec)
            parts.append(payload)
            changed += rec[2]
            continue
        digest.update(cur)
        x = old ^ cur
        changed += int(np.count_nonzero(x.view(codec.UINT[width])))
        if slime_xor is not None:
            slime_xor.update(x)
        else:
            pos = codec.changed_positions(x)
            positions.append(pos + off)
            values.append(cur[pos])
    blob = None
    if changed:
        if fmt == "rltool":
            blob = b"".join(parts)
        elif slime_xor is not None:
            blob = slime_xor.finish()
        else:
            blob = codec.encode_overwrite(np.concatenate(positions), np.concatenate(values))
    record = {"dtype": dtype, "shape": list(shape), "chunks": records}
    return _Encoded(name, blob, digest.hexdigest(), numel, changed, record)


def _extra_files(base: Checkpoint, new: Checkpoint) -> tuple[dict[str, Path], list[str]]:
    """Non-weight files that differ from the base (to ship) and those the new version dropped."""
    base_extra, new_extra = base.extra_paths(), new.extra_paths()
    changed = {rel: p for rel, p in new_extra.items()
               if rel not in base_extra or base_extra[rel].read_bytes() != p.read_bytes()}
    return changed, sorted(set(base_extra) - set(new_extra))


def write_delta(base: Checkpoint, new: Checkpoint, out: str | os.PathLike, *, version: int,
                base_version: int, fmt: str = "rltool", encoding: str = "xor",
                workers: int | None = None) -> dict:
    """Write `out` (a new directory, published atomically, index last) holding the delta that turns
    `base` into `new`. Returns stats: density, wire bytes, tensors changed, encode time."""
    if fmt not in FORMATS:
        raise BadInputError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "slime" and encoding not in SLIME_ENCODINGS:
        raise BadInputError(f"--encoding must be one of {', '.join(SLIME_ENCODINGS)} for the "
                            f"slime format, got {encoding!r}")
    out = Path(out)
    if out.exists():
        raise BadInputError(f"{out} already exists; pick a new --out directory")
    _check_same_tensors(base, new)
    t0 = time.perf_counter()
    names = base.names()
    workers = workers or default_workers()
    encoded: list[_Encoded] = []
    fname = DELTA_FILE.format(k=1, n=1)
    with atomic.publish_dir(out) as tmp, ThreadPoolExecutor(workers) as pool:
        writer = BlobWriter(tmp / fname, reserve_header_bytes=reserve_for(
            names, metadata_value_len=40 if fmt == "slime" else 0))
        try:
            window: collections.deque[Future] = collections.deque()
            pending = Progress("delta encode", total=len(names), unit="tensors").track(names)
            for name in pending:
                window.append(pool.submit(_encode_tensor, name, base, new, fmt=fmt,
                                          encoding=encoding))
                if len(window) >= 2 * workers:
                    _take(window.popleft().result(), writer, encoded)
            while window:
                _take(window.popleft().result(), writer, encoded)
            changed = [e for e in encoded if e.blob is not None]
            writer.finish({e.name: e.checksum for e in changed} if fmt == "slime" else None)
        except BaseException:
            writer.abort()
            for f in window:
                f.cancel()
            raise
        extras, removed = _extra_files(base, new)
        for rel, src in extras.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / rel)
        index = {
            "metadata": {"version": format_version(version),
                         "base_version": format_version(base_version),
                         "delta_encoding": RLTOOL_ENCODING if fmt == "rltool" else encoding,
                         "compression_format": "zstd", "checksum_format": CHECKSUM_FORMAT},
            "weight_map": {e.name: fname for e in changed},
        }
        if fmt == "rltool":
            index["rltool_delta"] = {
                "format_version": 1, "chunk_elements": codec.CHUNK_ELEMENTS,
                "tensors": {e.name: e.record for e in changed},
                "checksums": {e.name: e.checksum for e in encoded},
                "files": {rel: codec.checksum(p.read_bytes()) for rel, p in extras.items()},
                "removed_files": removed,
            }
        atomic.write_json(tmp / INDEX_NAME, index)
    numel = sum(e.numel for e in encoded)
    changed_elems = sum(e.changed for e in encoded)
    chunk_kinds = collections.Counter(r[0] for e in changed for r in e.record["chunks"])
    return {
        "format": fmt, "encoding": RLTOOL_ENCODING if fmt == "rltool" else encoding,
        "version": version, "base_version": base_version, "out": str(out),
        "tensors_total": len(encoded), "tensors_changed": len(changed),
        "numel": numel, "changed_elements": changed_elems,
        "density": changed_elems / numel if numel else 0.0,
        "full_bytes": sum(new.spec(n)[2] for n in names),
        "wire_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
        "chunk_encodings": dict(chunk_kinds), "encode_s": time.perf_counter() - t0,
        "workers": workers,
    }


def _take(e: _Encoded, writer: BlobWriter, encoded: list[_Encoded]) -> None:
    if e.blob is not None:
        writer.append(e.name, e.blob)
    encoded.append(e)
