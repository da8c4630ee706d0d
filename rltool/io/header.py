"""The safetensors format: one dtype table, one header parser, one header writer.

Layout (safetensors spec): an 8-byte little-endian header length N, N bytes of JSON
`{name: {dtype, shape, data_offsets}, "__metadata__": {...}}` (may be padded with spaces), then
the data buffer; `data_offsets` are relative to the start of the buffer and tile it without holes.
The parser checks exactly that, plus that each tensor's size matches its dtype and shape, so every
reader in rltool (convert, delta, the engine's pull) relies on the same validated layout.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltool.errors import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Bound on the JSON header, as the official reader's (100 MB): a larger value means a corrupt file.
MAX_HEADER_BYTES = 100_000_000

# dtype code -> (torch dtype name, bytes per element). Codes torch lacks still parse and move as
# raw bytes (delta sync is dtype-blind); only building a torch tensor needs the name.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "C64": ("complex64", 8),
}


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype code (1 for codes the table does not know)."""
    return DTYPES[dtype][1] if dtype in DTYPES else 1


def torch_dtype(code: str) -> torch.dtype:
    import torch

    if code not in DTYPES or not hasattr(torch, DTYPES[code][0]):
        raise CheckpointError(f"unsupported safetensors dtype {code!r}")
    return getattr(torch, DTYPES[code][0])


def dtype_code(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    for code, (torch_name, _) in DTYPES.items():
        if torch_name == name:
            return code
    raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors")


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    if dtype not in DTYPES:
        raise CheckpointError(f"unsupported safetensors dtype {dtype!r}")
    return math.prod(shape) * element_size(dtype)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype code, shape and absolute byte range."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def parse_header(path: str | os.PathLike) -> tuple[list[TensorInfo], dict[str, str]]:
    """(tensors in data-offset order, __metadata__) of one file; CheckpointError when the file is
    missing, truncated, has trailing bytes or a header that does not tile its data buffer."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path} is not a safetensors file (truncated header)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path} is not a safetensors file (bad header length {n})")
            header = json.loads(f.read(n))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no such file") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (not an object)")
    base = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    infos = []
    try:
        for name, entry in header.items():
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            infos.append(TensorInfo(name, path, str(entry["dtype"]), shape, base + begin,
                                    base + end))
        metadata = {str(k): str(v) for k, v in dict(metadata).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header ({e!r})") from e
    infos.sort(key=lambda e: e.start)
    cursor = base
    for e in infos:
        if e.end > size:
            raise CheckpointError(f"{path}: tensor {e.name} runs past the end of the file "
                                  "(truncated?)")
        if (e.start != cursor or e.end < e.start or any(d < 0 for d in e.shape)
                or (e.dtype in DTYPES and math.prod(e.shape) * element_size(e.dtype) != e.nbytes)):
            raise CheckpointError(f"{path}: tensor {e.name!r} has inconsistent offsets or size")
        cursor = e.end
    if cursor != size:
        raise CheckpointError(f"{path}: tensors cover {cursor} of {size} bytes; the file is "
                              "truncated or has trailing bytes")
    return infos, metadata


def header_json(items: list[tuple[str, str, tuple[int, ...], int, int]],
                metadata: dict[str, str] | None) -> bytes:
    """Header JSON for (name, dtype, shape, begin, end) items relative to the data buffer."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, begin, end in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    return json.dumps(header, separators=(",", ":")).encode()


def header_bytes(entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None) -> bytes:
    """Length prefix + header (padded to a multiple of 8) for tensors stored back to back."""
    items, offset = [], 0
    for name, dtype, shape in entries:
        size = tensor_nbytes(dtype, shape)
        items.append((name, dtype, shape, offset, offset + size))
        offset += size
    raw = header_json(items, metadata)
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def shard_file_names(num_shards: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def index_json(weight_map: dict[str, str], *, total_size: int) -> dict[str, Any]:
    """HF's index layout; `total_size` is the sum of tensor data bytes (headers excluded)."""
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
