"""Check a weights directory: a delta (structure, every blob decodes, and with a base every
checksum after rebuilding in memory) or a full checkpoint (headers, offsets, sizes)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import zstandard

from rltool.delta.apply import apply_chain, decode_tensor
from rltool.delta.deltadir import DeltaDir, open_delta
from rltool.errors import BadInputError, CheckpointError, DeltaChainError
from rltool.io.checkpoint import is_delta_dir, open_checkpoint
from rltool.io.header import DTYPES
from rltool.rundir import declared_version


def _check_blobs(delta: DeltaDir) -> None:
    """Decode every blob without a base: rltool chunks onto zeros, slime frames in full."""
    for name, t in delta.tensors.items():
        if delta.fmt == "rltool":
            rec = t.record
            try:
                nbytes = int(np.prod(rec["shape"], dtype=np.int64)) * DTYPES[rec["dtype"]][1]
            except (KeyError, TypeError, ValueError) as e:
                raise DeltaChainError(f"{delta.root}: bad record for {name!r}") from e
            decode_tensor(delta, name, np.zeros(nbytes, dtype=np.uint8), dtype=rec["dtype"])
            continue
        try:
            zstandard.ZstdDecompressor().decompress(delta.read_blob(name))
        except zstandard.ZstdError as e:
            raise DeltaChainError(f"{delta.root}:{name}: corrupt zstd payload ({e})") from e


def verify_dir(path: str | os.PathLike, *, base: str | os.PathLike | None = None,
               workers: int | None = None) -> dict:
    """Returns {"ok", "kind", "problems", ...}; raises BadInputError when `path` is not a weights
    directory at all or `base` is unusable."""
    path = Path(path)
    if not path.is_dir():
        raise BadInputError(f"{path} is not a directory")
    try:
        delta = is_delta_dir(path)
    except CheckpointError as e:
        return {"ok": False, "kind": "unknown", "path": str(path), "problems": [str(e)]}
    if not delta:
        if base is not None:
            raise BadInputError(f"{path} is a full checkpoint; --base only applies to a delta")
        try:
            ckpt = open_checkpoint(path)
        except CheckpointError as e:
            return {"ok": False, "kind": "full", "path": str(path), "problems": [str(e)]}
        return {"ok": True, "kind": "full", "path": str(path), "problems": [],
                "tensors": len(ckpt.tensor_file), "version": declared_version(path)}
    result: dict = {"kind": "delta", "path": str(path), "problems": [], "checked_checksums": False}
    try:
        d = open_delta(path)
        result.update(format=d.fmt, encoding=d.encoding, version=d.version,
                      base_version=d.base_version, tensors_changed=len(d.tensors))
        if base is None:
            _check_blobs(d)
        else:
            try:
                b = open_checkpoint(base)
            except CheckpointError as e:
                raise BadInputError(f"--base: {e}") from e
            apply_chain(b, [d], None, base_version=declared_version(base), workers=workers)
            result["checked_checksums"] = True
    except DeltaChainError as e:
        result["problems"].append(str(e))
    result["ok"] = not result["problems"]
    return result
