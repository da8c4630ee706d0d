"""The on-disk delta version directory (both formats): constants, index layout and its reader.

A version directory is a delta when its `model.safetensors.index.json` metadata carries
`delta_encoding` (slime's rule). `metadata` holds exactly slime's keys; rltool's own format adds a
top-level `rltool_delta` object (per-tensor chunk records, every tensor's checksum, extra files).
Blobs live in `model-{k:05d}-of-{n:05d}.safetensors` files as 1-D uint8 tensors keyed by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rltool.errors import CheckpointError, DeltaChainError
from rltool.io.checkpoint import read_index
from rltool.io.header import INDEX_NAME, TensorInfo
from rltool.io.reader import SafetensorsFile, read_header, read_range

RLTOOL_ENCODING = "rltool-v1"
SLIME_ENCODINGS = ("xor", "overwrite")
FORMATS = ("rltool", "slime")
CHECKSUM_FORMAT = "xxh3-128"
DELTA_FILE = "model-{k:05d}-of-{n:05d}.safetensors"


def format_version(version: int) -> str:
    return f"{version:06d}"


def parse_version(value: int | str) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError) as e:
        raise DeltaChainError(f"weight version {value!r} is not an integer") from e
    if v < 0:
        raise DeltaChainError(f"weight version {value!r} is negative")
    return v


@dataclass(frozen=True)
class DeltaTensor:
    blob: TensorInfo  # the uint8 blob inside its delta file
    file: SafetensorsFile
    checksum: str  # of the tensor's new bytes
    record: dict | None  # rltool format: dtype, shape, chunks


@dataclass(frozen=True)
class DeltaDir:
    root: Path
    fmt: str  # "rltool" | "slime"
    encoding: str  # "rltool-v1" | "xor" | "overwrite"
    version: int
    base_version: int
    tensors: dict[str, DeltaTensor]
    chunk_elements: int
    all_checksums: dict[str, str] | None  # rltool: every tensor of the reconstructed version
    files: dict[str, str | None]  # extra file -> checksum; None: slime's format has none
    removed_files: list[str]

    def read_blob(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        try:
            return read_range(t.file.path, t.blob.start, t.blob.nbytes)
        except CheckpointError as e:
            raise DeltaChainError(str(e)) from e

    def wire_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())


def _is_checksum(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _require(cond: bool, root: Path, msg: str) -> None:
    if not cond:
        raise DeltaChainError(f"{root}: {msg}")


def open_delta(root: str | os.PathLike) -> DeltaDir:
    """Parse and structurally validate a delta version directory (checksums are checked on apply)."""
    root = Path(root)
    try:
        index = read_index(root / INDEX_NAME)
    except CheckpointError as e:
        raise DeltaChainError(f"{root}: delta index unreadable: {e}") from e
    meta = index.get("metadata")
    _require(isinstance(meta, dict) and "delta_encoding" in meta, root,
             "index has no delta metadata; this is a full checkpoint")
    encoding = meta["delta_encoding"]
    _require(encoding in SLIME_ENCODINGS + (RLTOOL_ENCODING,), root,
             f"unknown delta_encoding {encoding!r}")
    _require(meta.get("compression_format") == "zstd", root,
             f"unsupported compression_format {meta.get('compression_format')!r}")
    _require(meta.get("checksum_format") == CHECKSUM_FORMAT, root,
             f"unsupported checksum_format {meta.get('checksum_format')!r} (rltool checks "
             f"{CHECKSUM_FORMAT})")
    version, base_version = parse_version(meta.get("version")), parse_version(meta.get("base_version"))
    fmt = "rltool" if encoding == RLTOOL_ENCODING else "slime"
    extra: dict = {}
    if fmt == "rltool":
        extra = index.get("rltool_delta")
        _require(isinstance(extra, dict) and isinstance(extra.get("tensors"), dict)
                 and isinstance(extra.get("checksums"), dict), root, "rltool_delta section missing")
        for what, sums in (("tensor", extra["checksums"]), ("file", extra.get("files", {}))):
            bad = sorted(n for n, c in sums.items() if not _is_checksum(c))
            _require(not bad, root, f"{what} {bad[:1]} has a missing or empty checksum; the delta "
                     "cannot be verified (rewrite it with `rltool delta diff`)")
    files: dict[str, SafetensorsFile] = {}
    tensors: dict[str, DeltaTensor] = {}
    for name, fname in index["weight_map"].items():
        if fname not in files:
            try:
                files[fname] = read_header(root / fname)
            except CheckpointError as e:
                raise DeltaChainError(f"{root}: delta file unreadable: {e}") from e
        f = files[fname]
        _require(name in f.entries and f.entries[name].dtype == "U8", root,
                 f"tensor {name!r} missing from {fname} or not a uint8 blob")
        if fmt == "rltool":
            record = extra["tensors"].get(name)
            _require(isinstance(record, dict) and name in extra["checksums"], root,
                     f"no record or checksum for {name!r}")
            tensors[name] = DeltaTensor(f.entries[name], f, extra["checksums"][name], record)
        else:
            _require(_is_checksum(f.metadata.get(name)), root,
                     f"no checksum (or an empty one) for {name!r} in {fname} __metadata__")
            tensors[name] = DeltaTensor(f.entries[name], f, f.metadata[name], None)
    if fmt == "rltool":
        return DeltaDir(root, fmt, encoding, version, base_version, tensors,
                        int(extra.get("chunk_elements", 0)), dict(extra["checksums"]),
                        dict(extra.get("files", {})), list(extra.get("removed_files", [])))
    weight_files = set(files) | {INDEX_NAME}
    present = {p.relative_to(root).as_posix(): None for p in root.rglob("*")
               if p.is_file() and p.relative_to(root).as_posix() not in weight_files
               and not p.name.startswith(".")}
    return DeltaDir(root, fmt, encoding, version, base_version, tensors, 0, None, present, [])
