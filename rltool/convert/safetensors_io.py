"""Streaming safetensors IO: read one tensor at a time, write a file tensor by tensor.

`safetensors.torch.save_file` serializes every tensor to `bytes` before writing, so saving a shard
needs about twice its size in memory; reading through `safe_open` maps the whole file, and touched
pages count in the process's resident set. Conversion wants peak memory near one tensor, so this
module speaks the (simple, documented) file format directly: an 8-byte little-endian header length,
a JSON header `{name: {dtype, shape, data_offsets}, "__metadata__": {...}}` padded with spaces to a
multiple of 8, then the raw little-endian tensor bytes. Files written here load with the official
`safetensors` readers (tests check it).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltool.errors import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Bound on the JSON header, as the official reader's (100 MB): a larger value means a corrupt file.
_MAX_HEADER_BYTES = 100_000_000

_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def torch_dtype(code: str) -> torch.dtype:
    import torch

    if code not in _DTYPE_NAMES:
        raise CheckpointError(f"unsupported safetensors dtype {code!r}")
    return getattr(torch, _DTYPE_NAMES[code])


def dtype_code(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    for code, torch_name in _DTYPE_NAMES.items():
        if torch_name == name:
            return code
    raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors")


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


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse one file's header: ({name: TensorInfo}, __metadata__). Raises CheckpointError if corrupt."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{path} is not a safetensors file (bad header length {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    base = 8 + n
    metadata = header.pop("__metadata__", None) or {}
    infos = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if base + end > size:
            raise CheckpointError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        infos[name] = TensorInfo(name, path, entry["dtype"], tuple(entry["shape"]), base + begin,
                                 base + end)
    return infos, metadata


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of an HF checkpoint: the index's files, or every *.safetensors file."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted({directory / f for f in weight_map.values()})
        missing = [str(p) for p in files if not p.exists()]
        if missing:
            raise CheckpointError(f"{index} names missing files: {', '.join(missing)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no *.safetensors files")
    return files


def checkpoint_tensors(directory: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of an HF checkpoint directory, by name, across its shards (headers only)."""
    out: dict[str, TensorInfo] = {}
    for path in checkpoint_files(directory):
        infos, _ = read_header(path)
        for name, info in infos.items():
            if name in out:
                raise CheckpointError(f"tensor {name} appears in both {out[name].path} and {path}")
            out[name] = info
    return out


@functools.cache
def _ignore_readonly_buffer_warning() -> None:
    """torch warns (once per process) that a read-only buffer makes a non-writable tensor; that is
    read_tensor's contract. One targeted filter, installed once: `warnings.catch_warnings` around
    each call would race between the conversion's worker threads."""
    import warnings

    warnings.filterwarnings("ignore", message="The given buffer is not writable",
                            category=UserWarning)


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """One tensor, mapped read-only from its file's byte range alone.

    Zero-copy from the page cache, and the mapping (so its pages in this process's RSS) lives only
    as long as the returned tensor: a conversion holds the tensors in flight, never a whole file.
    The tensor is READ-ONLY: writing to it faults (SIGSEGV); callers copy before changing it. A
    writable private mapping would be safe to write, but populating it copies every page
    (measured: 0.5 s of kernel time per 1.26 GB read, against 0.02 s read-only).
    """
    import mmap

    import torch

    _ignore_readonly_buffer_warning()
    dtype = torch_dtype(info.dtype)
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    aligned = info.start - info.start % mmap.ALLOCATIONGRANULARITY
    with open(info.path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), info.end - aligned, offset=aligned,
                           flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    data = torch.frombuffer(mapped, dtype=torch.uint8, offset=info.start - aligned,
                            count=info.nbytes)
    if (info.start - aligned) % dtype.itemsize:  # the format does not promise aligned data
        data = data.clone()
    return data.view(dtype).reshape(info.shape)


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    import math

    return math.prod(shape) * torch_dtype(dtype).itemsize


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...]]],
                  metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape in entries:
        size = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_streaming(path: str | os.PathLike, entries: list[tuple[str, str, tuple[int, ...]]],
                    tensors: Iterator[tuple[str, torch.Tensor]], *,
                    metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file whose layout (`entries`: name, dtype code, shape) is known up front,
    consuming `tensors` (name, tensor) in the same order, one at a time. Returns the data bytes.

    The caller wraps this in `atomic.atomic_path`; a tensor that does not match its entry raises
    CheckpointError before anything is published.
    """
    import torch

    total = 0
    out = DirectWriter(path)
    try:
        out.write(memoryview(_header_bytes(entries, metadata)))
        for (name, dtype, shape), (got_name, tensor) in zip(entries, tensors, strict=True):
            if got_name != name or dtype_code(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
                raise CheckpointError(
                    f"internal layout mismatch writing {path}: expected {name} {dtype} {shape}, "
                    f"got {got_name} {dtype_code(tensor.dtype)} {tuple(tensor.shape)}")
            data = tensor.contiguous().view(-1).view(torch.uint8)
            out.write(memoryview(data.numpy()))
            total += data.numel()
    finally:
        out.close()
    return total


class DirectWriter:
    """Sequential file writer that bypasses the page cache (O_DIRECT) where the filesystem allows.

    A checkpoint is written once and read later, so copying it into the page cache first only
    costs: on the benchmark VM the kernel's copy into freshly allocated cache pages took 2-4x the
    CPU per byte of the copy itself, varying run to run (freed memory goes back to the host). Bytes
    are staged in a page-aligned buffer and written in aligned `chunk_bytes` pieces; the tail is
    padded to the block size, then the file is truncated to its real length. Filesystems without
    O_DIRECT (tmpfs) get plain unbuffered writes. The caller still fsyncs (atomic.atomic_path).
    """

    ALIGN = 4096

    def __init__(self, path: str | os.PathLike, *, chunk_bytes: int = 8 << 20):
        import mmap

        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o666)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError:  # EINVAL: no O_DIRECT on this filesystem
            self.fd = os.open(path, flags, 0o666)
            self.direct = False
        self.buffer = mmap.mmap(-1, chunk_bytes) if self.direct else None
        self.used = 0
        self.size = 0

    def write(self, view: memoryview) -> None:
        view = view.cast("B")
        self.size += len(view)
        if not self.direct:
            _write_all(self.fd, view)
            return
        while view:
            n = min(len(view), len(self.buffer) - self.used)
            self.buffer[self.used:self.used + n] = view[:n]
            self.used += n
            view = view[n:]
            if self.used == len(self.buffer):
                _write_all(self.fd, memoryview(self.buffer))
                self.used = 0

    def close(self) -> None:
        try:
            if self.direct and self.used:
                padded = -(-self.used // self.ALIGN) * self.ALIGN
                self.buffer[self.used:padded] = bytes(padded - self.used)
                _write_all(self.fd, memoryview(self.buffer)[:padded])
                os.ftruncate(self.fd, self.size)
        finally:
            os.close(self.fd)
            if self.buffer is not None:
                self.buffer.close()


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def shard_file_names(num_shards: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def index_json(weight_map: dict[str, str], *, total_size: int) -> dict[str, Any]:
    """HF's index layout; `total_size` is the sum of tensor data bytes (headers excluded)."""
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
