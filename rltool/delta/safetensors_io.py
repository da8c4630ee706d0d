"""Raw, dtype-blind access to safetensors files: header parsing, positional reads, streaming writes.

Delta encodings work on raw tensor bytes, so this module never builds torch tensors: it reads the
header itself and moves bytes with `os.preadv` / `os.pwrite` (both release the GIL, so worker
threads overlap IO with numpy and zstd). Layout (safetensors spec): 8-byte little-endian header
length N, N bytes of JSON (may be padded with spaces), then the data buffer; `data_offsets` are
relative to the start of the buffer and must tile it without holes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import struct
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rltool.atomic import fsync_dir
from rltool.convert import safetensors_io as convert_io
from rltool.convert.safetensors_io import TensorInfo
from rltool.errors import CheckpointError

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "C64": 8,
}
_MAP_LOCK = threading.Lock()


@dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    entries: dict[str, TensorInfo]  # in data-offset order
    metadata: dict[str, str]
    _map: list = field(default_factory=list, compare=False, repr=False)

    def view(self, name: str, *, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Read-only zero-copy view of tensor bytes through a shared read-only mmap: page-cache
        hits cost no copy. Safe because published files are only ever replaced by rename."""
        with _MAP_LOCK:
            if not self._map:
                with open(self.path, "rb") as f:
                    # MAP_POPULATE maps the page-cache pages up front: one kernel pass instead
                    # of a page fault per 4 KiB on first touch.
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                    self._map.append(np.frombuffer(
                        mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ),
                        dtype=np.uint8))
        e = self.entries[name]
        n = e.nbytes - offset if nbytes is None else nbytes
        return self._map[0][e.start + offset:e.start + offset + n]

    def read(self, name: str, *, out: np.ndarray | None = None) -> np.ndarray:
        """Raw bytes of tensor `name` as a private writable uint8 array (`out` if given)."""
        e = self.entries[name]
        buf = np.empty(e.nbytes, dtype=np.uint8) if out is None else out
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pread_into(fd, buf, e.start)
        finally:
            os.close(fd)
        return buf


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CheckpointError(f"unexpected end of file (fd {fd}) at byte {offset + done}; "
                                  "the file is truncated")
        done += got


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def element_size(dtype: str) -> int:
    return DTYPE_SIZES.get(dtype, 1)


def read_header(path: str | os.PathLike) -> SafetensorsFile:
    """Parse a safetensors header (rltool.convert's parser) and check what a delta relies on:
    tensors tile the data buffer exactly and each size matches its dtype and shape."""
    path = Path(path)
    try:
        infos, metadata = convert_io.read_header(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no such file") from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header ({e!r})") from e
    entries = sorted(infos.values(), key=lambda e: e.start)
    size = path.stat().st_size
    with open(path, "rb") as f:
        cursor = 8 + struct.unpack("<Q", f.read(8))[0]
    for e in entries:
        numel = int(np.prod(e.shape, dtype=np.int64))
        if e.start != cursor or e.end < e.start or (e.dtype in DTYPE_SIZES
                                                    and numel * element_size(e.dtype) != e.nbytes):
            raise CheckpointError(f"{path}: tensor {e.name!r} has inconsistent offsets or size")
        cursor = e.end
    if cursor != size:
        raise CheckpointError(f"{path}: tensors cover {cursor} of {size} bytes; the file is "
                              "truncated or has trailing bytes")
    return SafetensorsFile(path, {e.name: e for e in entries},
                           {str(k): str(v) for k, v in metadata.items()})


def header_json(items: list[tuple[str, str, tuple[int, ...], int, int]],
                metadata: dict[str, str] | None) -> bytes:
    """Header JSON for (name, dtype, shape, begin, end) items relative to the data buffer."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, begin, end in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    return json.dumps(header, separators=(",", ":")).encode()


def reserve_for(names: list[str], *, metadata_value_len: int = 0, extra_metadata: int = 512) -> int:
    """Upper bound of a header's size for 1-D tensors with these names (for BlobWriter)."""
    per = 96 + 2 * 20  # {"dtype":"U8","shape":[..],"data_offsets":[..,..]} with 20-digit numbers
    return sum(len(json.dumps(n)) + per + len(json.dumps(n)) + metadata_value_len + 8
               for n in names) + extra_metadata


class BlobWriter:
    """Writes one safetensors file of 1-D uint8 tensors appended in order, sizes unknown up front.

    The header region is reserved first (`reserve_header_bytes`), blobs are appended after it, and
    on `finish` the header is written into the reservation padded with spaces (the spec allows
    trailing whitespace), the file is fsynced and renamed into place: readers see it whole or not
    at all.
    """

    def __init__(self, path: Path, *, reserve_header_bytes: int):
        self.path = path
        self.reserve = (reserve_header_bytes + 7) // 8 * 8
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self.fd, self.tmp = fd, Path(tmp)
        self.items: list[tuple[str, str, tuple[int, ...], int, int]] = []
        self.cursor = 0

    def append(self, name: str, blob: bytes | memoryview) -> None:
        n = len(blob)
        pwrite_all(self.fd, blob, 8 + self.reserve + self.cursor)
        self.items.append((name, "U8", (n,), self.cursor, self.cursor + n))
        self.cursor += n

    def finish(self, metadata: dict[str, str] | None) -> None:
        header = header_json(self.items, metadata)
        if len(header) > self.reserve:
            raise AssertionError(f"header of {len(header)} bytes exceeds reservation {self.reserve}")
        header += b" " * (self.reserve - len(header))
        pwrite_all(self.fd, struct.pack("<Q", self.reserve) + header, 0)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


def copy_range(src_fd: int, dst_fd: int, start: int, end: int) -> None:
    """Copy bytes [start, end) between files at the same offsets inside the kernel
    (copy_file_range): no user-space buffers, and threads copy disjoint ranges in parallel."""
    done = start
    while done < end:
        n = os.copy_file_range(src_fd, dst_fd, end - done, done, done)
        if n == 0:
            raise CheckpointError(f"fd {src_fd} ended at byte {done} while being copied")
        done += n


def _sync_file_range():
    """libc's sync_file_range (Linux), or None. ctypes releases the GIL around the call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it
_PAGE = mmap.PAGESIZE
WRITEBACK_BYTES = 8 << 20


class OutputFile:
    """Positional writes into one output file from several threads.

    Writes go under a lock (two threads pwriting one file contend on the inode lock, and the
    kernel spins on it: ~10% of decode's CPU went there). Each thread's contiguous run of writes
    is handed to writeback every `WRITEBACK_BYTES` with sync_file_range(SYNC_FILE_RANGE_WRITE):
    the disk works while later tensors decode, and the closing fsync only waits for the tail.
    Only whole pages inside a run are kicked; edge pages shared with a neighbour are left to
    that fsync, so no page is rewritten while under writeback."""

    def __init__(self, fd: int):
        self.fd = fd
        self._lock = threading.Lock()
        self._run = threading.local()  # this thread's written-but-not-kicked [start, end)

    def write(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            pwrite_all(self.fd, view, offset)
        start, end = getattr(self._run, "range", (offset, offset))
        if end != offset:
            self._start_writeback(start, end)
            start = offset
        end = offset + len(view)
        if end - start >= WRITEBACK_BYTES:
            self._start_writeback(start, end)
            start = end
        self._run.range = (start, end)

    def _start_writeback(self, start: int, end: int) -> None:
        begin, stop = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
        if _SYNC_FILE_RANGE is not None and stop > begin:
            # Advisory: on failure the closing fsync still writes (and reports) everything.
            _SYNC_FILE_RANGE(self.fd, begin, stop - begin, _SYNC_FILE_RANGE_WRITE)


@contextlib.contextmanager
def output_like(path: Path, *, like: SafetensorsFile) -> Iterator[OutputFile]:
    """Yield an OutputFile over a temporary file next to `path` with `like`'s size and header
    (same offsets); workers write every tensor's bytes at `like`'s offsets. On success the file
    is fsynced and renamed onto `path`; on error it is removed.

    Plain pwrite from a reused buffer, not a writable mmap: on ext4 the first write to each mapped
    page takes a page_mkwrite fault, which cost more than the copy it saves."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        size = like.path.stat().st_size
        os.ftruncate(fd, size)
        src = os.open(like.path, os.O_RDONLY)
        try:
            copy_range(src, fd, 0, min((e.start for e in like.entries.values()), default=size))
        finally:
            os.close(src)
        yield OutputFile(fd)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
