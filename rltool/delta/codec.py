"""Tensor delta encodings on raw bytes. Pure functions of numpy buffers; numpy, zstd and xxhash
release the GIL on large buffers, so callers run them in threads.

rltool's own codec works per chunk of `CHUNK_ELEMENTS` elements at the tensor's element width
(2 bytes for bf16/fp16, 4 for fp32, 1 for fp8), picking per chunk:
  zero    the chunk did not change (no payload)
  sparse  changed positions as gaps (u8/u16/u32, the narrowest that fits) + the XOR of each changed
          element, both byte-plane shuffled, one zstd frame; for low densities
  xor     the XOR of every element, byte-plane shuffled, one zstd frame; for dense small changes
  raw     the new bytes verbatim, when compression would not shrink them
Byte-plane shuffling puts the (mostly zero) high bytes of XORs and gaps next to each other, which
zstd's entropy stage compresses far better than interleaved bytes.

The scans over each chunk run in `csrc/delta.c` (one pass instead of numpy's compare, count,
nonzero, gather, cast, cumsum and scatter passes) when rltool's native library is built; the numpy
path below computes the same bytes and runs when it is not (or with RLTOOL_NATIVE=0).

slime's codecs (docs/formats.md) work on a whole tensor's bytes, dtype-blind:
`xor` (one zstd frame of new^old, streamed) and `overwrite` (u32 count, u32 byte positions, bytes).
"""

from __future__ import annotations

import ctypes
import functools
import io
import logging
import sys

import numpy as np
import xxhash
import zstandard

from rltool import native
from rltool.errors import DeltaChainError

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 8 * 1024 * 1024
SPARSE_MAX_DENSITY = 0.125  # above it a shuffled dense XOR compresses better than gaps+values
ZSTD_LEVEL = 1
UINT = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def element_width(itemsize: int, nbytes: int) -> int:
    return itemsize if itemsize in UINT and nbytes % itemsize == 0 else 1


def checksum(buf: np.ndarray | bytes) -> str:
    return xxhash.xxh3_128_hexdigest(buf)


def _shuffle(values: np.ndarray) -> bytes:
    """Byte planes of little-endian elements: all bytes 0, then all bytes 1, ... Shifts with a
    truncating cast are ~5x faster than transposing a (n, w) byte view."""
    w = values.dtype.itemsize
    if w == 1:
        return values.tobytes()
    planes = np.empty((w, len(values)), dtype=np.uint8)
    for k in range(w):
        np.right_shift(values, 8 * k, out=planes[k], casting="unsafe")
    return planes.tobytes()


def _unshuffle(data: np.ndarray, width: int, count: int) -> np.ndarray:
    planes = data.reshape(width, count)
    out = planes[0].astype(UINT[width])
    for k in range(1, width):
        plane = planes[k].astype(UINT[width])
        plane <<= 8 * k
        out |= plane
    return out


def _decompress(payload: bytes | memoryview, size: int, what: str) -> bytes:
    try:
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as e:
        raise DeltaChainError(f"{what}: corrupt zstd payload ({e})") from e
    if len(out) != size:
        raise DeltaChainError(f"{what}: payload decodes to {len(out)} bytes, expected {size}")
    return out


# ---- native kernels (csrc/delta.c) ---------------------------------------------------------

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The native library with the delta kernels declared, or None (numpy path)."""
    lib = native.load()
    if lib is None or sys.byteorder != "little":  # the kernels read elements little-endian
        return None
    if not hasattr(lib, "rltool_delta_sparse_encode"):
        log.warning("rltool's native library was built before csrc/delta.c (rebuild it with "
                    "`pip install -e .`): delta chunks use the numpy path")
        return None
    lib.rltool_delta_sparse_encode.argtypes = [_ptr, _ptr, _i64, _i32, _i64, _ptr, _ptr, _ptr]
    lib.rltool_delta_sparse_encode.restype = _i64
    lib.rltool_delta_sparse_apply.argtypes = [_ptr, _i64, _i64, _i64, _i32, _ptr, _i32, _ptr,
                                              _i64, _ptr]
    lib.rltool_delta_sparse_apply.restype = _i32
    lib.rltool_delta_xor_planes.argtypes = [_ptr, _ptr, _i64, _i32, _ptr]
    lib.rltool_delta_xor_planes.restype = _i64
    lib.rltool_delta_xor_apply_planes.argtypes = [_ptr, _i64, _i32, _ptr, _i64]
    lib.rltool_delta_xor_apply_planes.restype = None
    return lib


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


# ---- rltool codec: one chunk ---------------------------------------------------------------

def changed_positions(x: np.ndarray) -> np.ndarray:
    """Indices of the nonzero elements of `x` (nonzero on a bool mask is ~4x faster than on
    the integers themselves)."""
    return np.flatnonzero(x != 0)


def _gap_width(top: int) -> int:
    return 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4


def _sparse_payload(gaps: np.ndarray, xors: np.ndarray, gw: int, cctx) -> bytes:
    return cctx.compress(_shuffle(gaps.astype(UINT[gw])) + _shuffle(xors))


def encode_chunk(old: np.ndarray, new: np.ndarray, *, width: int, digest=None
                 ) -> tuple[list, bytes]:
    """Encode one chunk (uint8 buffers of equal length), feeding `new` to `digest` on the way.
    Returns (record, payload), record = [encoding, payload_bytes, changed_elements, gap_width]."""
    if digest is not None:
        digest.update(new)
    lib = _lib()
    if lib is not None:
        return _encode_chunk_native(lib, old, new, width=width)
    # Positions come from `old != new` directly and only the changed elements are XORed: the
    # XOR of the whole chunk is built for dense chunks only (~25% faster at RL densities).
    o, n = old.view(UINT[width]), new.view(UINT[width])
    mask = o != n
    changed = int(np.count_nonzero(mask))
    if changed == 0:
        return ["zero", 0, 0, 0], b""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    if changed <= SPARSE_MAX_DENSITY * len(o):
        idx = np.flatnonzero(mask)
        gaps = np.diff(idx, prepend=-1) - 1
        gw = _gap_width(int(gaps.max()))
        payload = _sparse_payload(gaps, o[idx] ^ n[idx], gw, cctx)
        return ["sparse", len(payload), changed, gw], payload
    return _dense_record(_shuffle(o ^ n), changed, new, cctx)


def _dense_record(planes: bytes | np.ndarray, changed: int, new: np.ndarray, cctx
                  ) -> tuple[list, bytes]:
    payload = cctx.compress(planes)
    if len(payload) >= new.nbytes:
        return ["raw", new.nbytes, changed, 0], new.tobytes()
    return ["xor", len(payload), changed, 0], payload


def _encode_chunk_native(lib: ctypes.CDLL, old: np.ndarray, new: np.ndarray, *, width: int
                         ) -> tuple[list, bytes]:
    count = old.nbytes // width
    cap = int(SPARSE_MAX_DENSITY * count)  # changed <= cap  <=>  changed <= density * count
    gaps = np.empty(cap, dtype=np.uint32)
    xors = np.empty(cap * width, dtype=np.uint8)
    top = ctypes.c_uint32(0)
    changed = lib.rltool_delta_sparse_encode(_addr(old), _addr(new), count, width, cap,
                                             _addr(gaps), _addr(xors), ctypes.byref(top))
    if changed == 0:
        return ["zero", 0, 0, 0], b""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    if changed > 0:
        gw = _gap_width(top.value)
        payload = _sparse_payload(gaps[:changed], xors[:changed * width].view(UINT[width]), gw,
                                  cctx)
        return ["sparse", len(payload), int(changed), gw], payload
    planes = np.empty(old.nbytes, dtype=np.uint8)
    changed = lib.rltool_delta_xor_planes(_addr(old), _addr(new), count, width, _addr(planes))
    return _dense_record(planes, int(changed), new, cctx)


class ChunkPatch:
    """One chunk record's changes, applied to consecutive element ranges of the chunk in
    ascending order (`apply(x, first)` patches the elements [first, first + len(x)/width) held
    in the uint8 buffer x): decode streams through a tensor in cache-sized blocks, so each block
    is copied, patched, hashed and written while it is in cache. The payload is decompressed
    once, on construction."""

    def __init__(self, record: list, payload: memoryview, *, count: int, width: int, what: str):
        try:
            enc, size, changed, gw = record
            size, changed, gw = int(size), int(changed), int(gw)
        except (TypeError, ValueError) as e:
            raise DeltaChainError(f"{what}: malformed chunk record {record!r}") from e
        if len(payload) != size:
            raise DeltaChainError(f"{what}: chunk payload is {len(payload)} bytes, index says "
                                  f"{size}")
        self.enc, self.count, self.width, self.what, self.lib = enc, count, width, what, _lib()
        if enc == "zero":
            return
        if enc == "raw":
            if size != count * width:
                raise DeltaChainError(f"{what}: raw chunk of {size} bytes for {count * width}")
            self.data = np.frombuffer(payload, dtype=np.uint8)
        elif enc == "xor":
            self.data = np.frombuffer(_decompress(payload, count * width, what), dtype=np.uint8)
        elif enc == "sparse":
            if gw not in (1, 2, 4) or not 0 < changed <= count:
                raise DeltaChainError(f"{what}: malformed sparse chunk record {record!r}")
            self.data = np.frombuffer(_decompress(payload, changed * (gw + width), what),
                                      dtype=np.uint8)
            self.changed, self.gw = changed, gw
            if self.lib is not None:
                self.state = np.array([0, -1], dtype=np.int64)  # next entry, last position
            else:
                gaps = _unshuffle(self.data[:changed * gw], gw, changed)
                self.idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
                if self.idx[-1] >= count:
                    raise DeltaChainError(f"{what}: sparse positions run past the chunk")
                self.values = _unshuffle(self.data[changed * gw:], width, changed)
                self.next = 0
        else:
            raise DeltaChainError(f"{what}: unknown chunk encoding {enc!r}")

    def apply(self, x: np.ndarray, first: int) -> None:
        w, n = self.width, len(x) // self.width
        if self.enc == "zero":
            return
        if self.enc == "raw":
            x[:] = self.data[first * w:(first + n) * w]
        elif self.enc == "xor":
            if self.lib is not None:
                self.lib.rltool_delta_xor_apply_planes(_addr(x), n, w, _addr(self.data) + first,
                                                       self.count)
            else:
                planes = self.data.reshape(w, self.count)[:, first:first + n]
                x.view(UINT[w])[:] ^= _unshuffle(planes, w, n)
        elif self.lib is not None:
            start = _addr(self.data)
            if self.lib.rltool_delta_sparse_apply(_addr(x), first, first + n, self.count, w,
                                                  start, self.gw, start + self.changed * self.gw,
                                                  self.changed, _addr(self.state)):
                raise DeltaChainError(f"{self.what}: sparse positions run past the chunk")
        else:
            lo = self.next
            self.next = hi = int(np.searchsorted(self.idx, first + n))
            x.view(UINT[w])[self.idx[lo:hi] - first] ^= self.values[lo:hi]


# ---- slime codecs: one whole tensor each --------------------------------------------------------

class SlimeXorEncoder:
    """Streams chunks of new^old into one zstd frame (level 1), as slime's `xor` encoding."""

    def __init__(self, nbytes: int):
        self.cobj = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=nbytes)
        self.parts: list[bytes] = []

    def update(self, xor: np.ndarray) -> None:
        self.parts.append(self.cobj.compress(xor))

    def finish(self) -> bytes:
        self.parts.append(self.cobj.flush())
        return b"".join(self.parts)


class SlimeXorPatch:
    """A slime `xor` blob applied to consecutive byte ranges of its tensor, in order (the blob is
    one zstd frame, decompressed as a stream)."""

    def __init__(self, blob: memoryview, *, nbytes: int, what: str):
        self.reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob))
        self.nbytes, self.what = nbytes, what

    def apply(self, buf: np.ndarray, start: int) -> None:
        parts, got, n = [], 0, len(buf)
        try:
            while got < n:
                part = self.reader.read(n - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
        except zstandard.ZstdError as e:
            raise DeltaChainError(f"{self.what}: corrupt zstd payload ({e})") from e
        if got != n:
            raise DeltaChainError(f"{self.what}: xor payload shorter than the tensor "
                                  f"({self.nbytes} bytes)")
        buf ^= np.frombuffer(b"".join(parts), dtype=np.uint8)


def encode_overwrite(positions: np.ndarray, values: np.ndarray) -> bytes:
    """slime `overwrite`: u32 count C, C u32 byte positions, C new byte values; one zstd frame."""
    body = (np.array([len(positions)], dtype="<u4").tobytes()
            + positions.astype("<u4").tobytes() + values.astype(np.uint8).tobytes())
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(body)


class SlimeOverwritePatch:
    """A slime `overwrite` blob applied to consecutive byte ranges of its tensor, in order. The
    positions are sorted once (stably, so of repeated positions the last value still wins)."""

    def __init__(self, blob: memoryview, *, nbytes: int, what: str):
        try:
            body = zstandard.ZstdDecompressor().decompress(blob, max_output_size=4 + 5 * nbytes)
        except zstandard.ZstdError as e:
            raise DeltaChainError(f"{what}: corrupt zstd payload ({e})") from e
        if len(body) < 4:
            raise DeltaChainError(f"{what}: overwrite payload shorter than its count")
        count = int(np.frombuffer(body, dtype="<u4", count=1)[0])
        if len(body) != 4 + 5 * count:
            raise DeltaChainError(f"{what}: overwrite payload of {len(body)} bytes for {count} "
                                  "bytes")
        pos = np.frombuffer(body, dtype="<u4", count=count, offset=4).astype(np.int64)
        values = np.frombuffer(body, dtype=np.uint8, count=count, offset=4 + 4 * count)
        if count and int(pos.max()) >= nbytes:
            raise DeltaChainError(f"{what}: overwrite positions run past the tensor")
        if count and not bool(np.all(pos[1:] >= pos[:-1])):
            order = np.argsort(pos, kind="stable")
            pos, values = pos[order], values[order]
        self.pos, self.values, self.next = pos, values, 0

    def apply(self, buf: np.ndarray, start: int) -> None:
        lo = self.next
        self.next = hi = int(np.searchsorted(self.pos, start + len(buf)))
        buf[self.pos[lo:hi] - start] = self.values[lo:hi]
