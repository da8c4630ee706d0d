"""The backuper's SSD tier: one weight snapshot per safetensors file, checksummed, memory-mapped.

```
<dir>/<tag>.safetensors     safetensors; __metadata__ = {"format": "rltool-weight-snapshot",
                            "format_version": "1", "checksum": "xxh3_128:<32 hex>"}
```
The checksum covers the data section (every tensor's bytes, in header order). The file is written
once through `rltool.atomic.atomic_path` (temporary name, fsync, rename) in one pass, with
O_DIRECT where the filesystem allows (rltool.io.writer.DirectWriter): the header
goes out with a placeholder checksum of the same width, which is overwritten in place once the
data is written, before the rename. A reader maps the file read-only, hashes the data section and
refuses the file (CheckpointError) when the hash differs, before any byte reaches its caller. A
reader that kept the checksum `write_snapshot` returned passes it too: a file whose own checksum
is another (a different snapshot, however self-consistent) is refused before it is mapped.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from rltool import atomic
from rltool.errors import CheckpointError
from rltool.io.header import dtype_code, header_bytes, parse_header, torch_dtype
from rltool.io.reader import ignore_readonly_buffer_warning
from rltool.io.writer import DirectWriter, pwrite_all

if TYPE_CHECKING:
    import torch

FORMAT = "rltool-weight-snapshot"
FORMAT_VERSION = "1"
SUFFIX = ".safetensors"
_ALGO = "xxh3_128:"
_PLACEHOLDER = _ALGO + "0" * 32


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (host, contiguous)."""
    import torch

    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def write_snapshot(path: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]], *,
                   layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> str:
    """Write `tensors` (host tensors, in `layout` order) atomically; returns the checksum.

    `tensors` may be a generator that copies one device tensor at a time to the host, so a
    snapshot larger than the host budget goes to disk with one tensor in host memory."""
    entries = [(name, dtype_code(dtype), tuple(shape)) for name, dtype, shape in layout]
    header = header_bytes(entries, {"format": FORMAT, "format_version": FORMAT_VERSION,
                                     "checksum": _PLACEHOLDER})
    at = header.find(_PLACEHOLDER.encode())
    hasher = xxhash.xxh3_128()
    with atomic.atomic_path(path) as tmp:
        # O_DIRECT: a spilled tag is the least recently used one, so its pages are not worth
        # the page cache's copy (nor the memory they would take from the host budget).
        out = DirectWriter(tmp)
        try:
            out.write(memoryview(header))
            for (name, code, shape), (got, tensor) in zip(entries, tensors, strict=True):
                if got != name or dtype_code(tensor.dtype) != code or tuple(tensor.shape) != shape:
                    raise CheckpointError(f"internal layout mismatch writing {path}: expected "
                                          f"{name} {code} {shape}, got {got}")
                view = _bytes_view(tensor)
                hasher.update(view)
                out.write(view)
        finally:
            out.close()
        checksum = _ALGO + hasher.hexdigest()
        fd = os.open(tmp, os.O_WRONLY)
        try:
            pwrite_all(fd, checksum.encode(), at)
        finally:
            os.close(fd)
    return checksum


class MappedSnapshot:
    """A verified snapshot file mapped read-only; `tensors` are zero-copy views into the mapping.

    The views are READ-ONLY (writing faults): callers copy them into their own buffers. Keep the
    object alive while the views are in use; `close()` unmaps. `checksum`: the one the file was
    written with (`write_snapshot`'s result); a file with another is refused."""

    def __init__(self, path: str | os.PathLike, *, checksum: str | None = None):
        import torch

        self.path = Path(path)
        try:  # the layout checks (tiling, truncation, trailing bytes) are rltool.io's
            infos, meta = parse_header(self.path)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read the weight snapshot ({e})") from e
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{self.path} is not an rltool weight snapshot (format "
                                  f"{meta.get('format')!r} {meta.get('format_version')!r})")
        self.checksum = meta.get("checksum", "")
        if checksum is not None and self.checksum != checksum:
            raise CheckpointError(f"{self.path} is not the weight snapshot written there (its "
                                  f"checksum {self.checksum!r}, written {checksum!r}): the file "
                                  "was replaced; refusing it: drop the tag and back it up again")
        base = infos[0].start if infos else 0
        end = infos[-1].end if infos else 0
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            # MAP_POPULATE: one sequential read-ahead instead of a page fault per 4 KiB.
            self._map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                  prot=mmap.PROT_READ) if size else None
        if self._map is not None and xxhash.xxh3_128_hexdigest(
                memoryview(self._map)[base:end]) != self.checksum.removeprefix(_ALGO):
            self.close()
            raise CheckpointError(f"{self.path}: checksum mismatch (the weight snapshot is "
                                  "corrupt); refusing it: drop the tag and back it up again")
        ignore_readonly_buffer_warning()
        self.tensors: dict[str, torch.Tensor] = {}
        for info in infos:
            dtype = torch_dtype(info.dtype)
            if info.nbytes == 0 or self._map is None:
                self.tensors[info.name] = torch.empty(info.shape, dtype=dtype)
                continue
            data = torch.frombuffer(self._map, dtype=torch.uint8, offset=info.start,
                                    count=info.nbytes)
            if info.start % dtype.itemsize:  # the format does not promise aligned data
                data = data.clone()
            self.tensors[info.name] = data.view(dtype).reshape(info.shape)

    def close(self) -> None:
        self.tensors = {}
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive; the mapping goes with its last view
                pass
            self._map = None

    def __enter__(self) -> "MappedSnapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
