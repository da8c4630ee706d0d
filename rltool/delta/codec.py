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

slime's codecs (`reference/slime-delta-format.md`) work on a whole tensor's bytes, dtype-blind:
`xor` (one zstd frame of new^old, streamed) and `overwrite` (u32 count, u32 byte positions, bytes).
"""

from __future__ import annotations

import io

import numpy as np
import xxhash
import zstandard

from rltool.errors import DeltaChainError

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


def _unshuffle(data: memoryview | bytes, width: int, count: int) -> np.ndarray:
    planes = np.frombuffer(data, dtype=np.uint8, count=width * count).reshape(width, count)
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


# ---- rltool codec: one chunk ---------------------------------------------------------------

def changed_positions(x: np.ndarray) -> np.ndarray:
    """Indices of the nonzero elements of `x` (nonzero on a bool mask is ~4x faster than on
    the integers themselves)."""
    return np.flatnonzero(x != 0)


def encode_chunk(old: np.ndarray, new: np.ndarray, *, width: int, digest=None
                 ) -> tuple[list, bytes]:
    """Encode one chunk (uint8 buffers of equal length), feeding `new` to `digest` on the way.
    Returns (record, payload), record = [encoding, payload_bytes, changed_elements, gap_width].

    Positions come from `old != new` directly and only the changed elements are XORed: the XOR of
    the whole chunk is built for dense chunks only (~25% faster at RL densities)."""
    o, n = old.view(UINT[width]), new.view(UINT[width])
    if digest is not None:
        digest.update(new)
    mask = o != n
    changed = int(np.count_nonzero(mask))
    if changed == 0:
        return ["zero", 0, 0, 0], b""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    if changed <= SPARSE_MAX_DENSITY * len(o):
        idx = np.flatnonzero(mask)
        gaps = np.diff(idx, prepend=-1) - 1
        top = int(gaps.max())
        gw = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
        payload = cctx.compress(_shuffle(gaps.astype(UINT[gw])) + _shuffle(o[idx] ^ n[idx]))
        return ["sparse", len(payload), changed, gw], payload
    payload = cctx.compress(_shuffle(o ^ n))
    if len(payload) >= new.nbytes:
        return ["raw", new.nbytes, changed, 0], new.tobytes()
    return ["xor", len(payload), changed, 0], payload


def decode_chunk(record: list, payload: memoryview, old: np.ndarray, *, width: int,
                 what: str) -> np.ndarray:
    """Apply one chunk record to `old` (uint8, modified in place and returned)."""
    try:
        enc, size, changed, gw = record
        size, changed, gw = int(size), int(changed), int(gw)
    except (TypeError, ValueError) as e:
        raise DeltaChainError(f"{what}: malformed chunk record {record!r}") from e
    if len(payload) != size:
        raise DeltaChainError(f"{what}: chunk payload is {len(payload)} bytes, index says {size}")
    u = UINT[width]
    x = old.view(u)
    if enc == "zero":
        return old
    if enc == "raw":
        if size != old.nbytes:
            raise DeltaChainError(f"{what}: raw chunk of {size} bytes for {old.nbytes}")
        old[:] = np.frombuffer(payload, dtype=np.uint8)
        return old
    if enc == "xor":
        x ^= _unshuffle(_decompress(payload, old.nbytes, what), width, len(x))
        return old
    if enc == "sparse":
        if gw not in (1, 2, 4) or not 0 < changed <= len(x):
            raise DeltaChainError(f"{what}: malformed sparse chunk record {record!r}")
        data = memoryview(_decompress(payload, changed * (gw + width), what))
        gaps = _unshuffle(data[:changed * gw], gw, changed)
        values = _unshuffle(data[changed * gw:], width, changed)
        idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
        if idx[-1] >= len(x):
            raise DeltaChainError(f"{what}: sparse positions run past the chunk")
        x[idx] ^= values
        return old
    raise DeltaChainError(f"{what}: unknown chunk encoding {enc!r}")


# ---- slime codecs: one whole tensor ---------------------------------------------------------

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


def slime_xor_reader(blob: memoryview, *, nbytes: int, what: str):
    """Return read(n) -> bytes over the decompressed stream of a slime `xor` blob."""
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob))

    def read(n: int) -> np.ndarray:
        parts, got = [], 0
        try:
            while got < n:
                part = reader.read(n - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
        except zstandard.ZstdError as e:
            raise DeltaChainError(f"{what}: corrupt zstd payload ({e})") from e
        if got != n:
            raise DeltaChainError(f"{what}: xor payload shorter than the tensor ({nbytes} bytes)")
        return np.frombuffer(b"".join(parts), dtype=np.uint8)

    return read


def encode_overwrite(positions: np.ndarray, values: np.ndarray) -> bytes:
    """slime `overwrite`: u32 count C, C u32 byte positions, C new byte values; one zstd frame."""
    body = (np.array([len(positions)], dtype="<u4").tobytes()
            + positions.astype("<u4").tobytes() + values.astype(np.uint8).tobytes())
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(body)


def decode_overwrite(blob: memoryview, old: np.ndarray, *, what: str) -> np.ndarray:
    try:
        body = zstandard.ZstdDecompressor().decompress(blob, max_output_size=4 + 5 * old.nbytes)
    except zstandard.ZstdError as e:
        raise DeltaChainError(f"{what}: corrupt zstd payload ({e})") from e
    if len(body) < 4:
        raise DeltaChainError(f"{what}: overwrite payload shorter than its count")
    count = int(np.frombuffer(body, dtype="<u4", count=1)[0])
    if len(body) != 4 + 5 * count:
        raise DeltaChainError(f"{what}: overwrite payload of {len(body)} bytes for {count} bytes")
    pos = np.frombuffer(body, dtype="<u4", count=count, offset=4)
    if count and int(pos.max()) >= old.nbytes:
        raise DeltaChainError(f"{what}: overwrite positions run past the tensor")
    old[pos] = np.frombuffer(body, dtype=np.uint8, count=count, offset=4 + 4 * count)
    return old
