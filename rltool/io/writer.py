"""Writing safetensors files, the three ways rltool's stages need, each published atomically with
the mode of every other published file (rltool.atomic):

- `write_streaming` / `DirectWriter`: sequential, layout known up front, tensors consumed one at a
  time and written with O_DIRECT (convert, which writes a checkpoint once and reads it later);
- `BlobWriter`: sequential appends of 1-D uint8 blobs whose sizes are unknown up front (delta
  encode), the header written last into a reserved region;
- `output_like` / `OutputFile`: positional writes from several threads into a file laid out like
  another one (delta apply rebuilds a checkpoint with its base's exact layout).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltool import atomic
from rltool.faults import kill_point
from rltool.errors import CheckpointError
from rltool.io.header import dtype_code, header_bytes, header_json
from rltool.io.reader import SafetensorsFile

if TYPE_CHECKING:
    import torch


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
        out.write(memoryview(header_bytes(entries, metadata)))
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
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), atomic.FILE_MODE)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError:  # EINVAL: no O_DIRECT on this filesystem
            self.fd = os.open(path, flags, atomic.FILE_MODE)
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


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


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
        self.fd, self.tmp = atomic.create_temp(path)
        self.items: list[tuple[str, str, tuple[int, ...], int, int]] = []
        self.cursor = 0

    def append(self, name: str, blob: bytes | memoryview) -> None:
        n = len(blob)
        kill_point("tensor.write")
        pwrite_all(self.fd, blob, 8 + self.reserve + self.cursor)
        self.items.append((name, "U8", (n,), self.cursor, self.cursor + n))
        self.cursor += n

    def finish(self, metadata: dict[str, str] | None) -> None:
        header = header_json(self.items, metadata)
        if len(header) > self.reserve:
            raise AssertionError(f"header of {len(header)} bytes exceeds reservation {self.reserve}")
        header += b" " * (self.reserve - len(header))
        pwrite_all(self.fd, struct.pack("<Q", self.reserve) + header, 0)
        fd, self.fd = self.fd, -1
        atomic.commit_temp(fd, self.tmp, self.path)

    def abort(self) -> None:
        atomic.discard_temp(self.fd, self.tmp)
        self.fd = -1


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
        kill_point("tensor.write")
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
    with atomic.atomic_fd(path) as fd:
        size = like.path.stat().st_size
        os.ftruncate(fd, size)
        src = os.open(like.path, os.O_RDONLY)
        try:
            copy_range(src, fd, 0, min((e.start for e in like.entries.values()), default=size))
        finally:
            os.close(src)
        yield OutputFile(fd)
