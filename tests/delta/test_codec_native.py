"""The native chunk kernels (csrc/delta.c) against the numpy path: same records, same payload
bytes, same reconstruction, for every element width, density and tail length; the sparse
format itself against a plain-loop reading of its bytes; and whole chains streamed through
blocks that straddle chunks, both paths."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from rltool.delta import apply, codec
from rltool.io.checkpoint import open_checkpoint
from rltool.delta.deltadir import open_delta
from rltool.delta.diff import write_delta
from rltool.errors import DeltaChainError
from tests.helpers.checkpoints import load_all, make_weights, perturb, same_bits, write_checkpoint

WIDTHS = (1, 2, 4, 8)
# Around the sparse/dense threshold (1/8) on both sides, empty, and every element changed.
DENSITIES = (0.0, 0.001, 0.02, 0.124, 0.126, 0.5, 1.0)
# Element counts with and without a tail past the 64-byte blocks the scan works on.
COUNTS = (1, 7, 33, 64, 1000, 4099)


@pytest.fixture(scope="module")
def native_lib():
    lib = codec._lib()
    assert lib is not None, ("rltool's native library with the delta kernels is not built: "
                             "run `pip install -e .`")
    return lib


def _pair(rng: np.random.Generator, count: int, width: int, density: float
          ) -> tuple[np.ndarray, np.ndarray]:
    old = rng.integers(0, 256, count * width, dtype=np.uint8)
    new = old.copy()
    changed = rng.random(count) < density
    flip = rng.integers(0, 256, (count, width), dtype=np.uint8)
    flip[np.arange(count), rng.integers(0, width, count)] |= 1  # a changed element really differs
    new.reshape(count, width)[changed] ^= flip[changed]
    return old, new


def _decode(rec: list, payload: bytes, old: np.ndarray, width: int) -> np.ndarray:
    """Apply the chunk in ranges of 1, 2, 3, ... elements (decode streams blocks through it)."""
    out, first, step = old.copy(), 0, 1
    patch = codec.ChunkPatch(rec, memoryview(payload), count=len(old) // width, width=width,
                             what="t")
    while first * width < len(out):
        end = min(len(out) // width, first + step)
        patch.apply(out[first * width:end * width], first)
        first, step = end, step + 1
    return out


def _with(monkeypatch, lib):
    monkeypatch.setattr(codec, "_lib", lambda: lib)


def test_native_encode_and_decode_match_numpy(monkeypatch, native_lib):
    rng = np.random.default_rng(0)
    kinds = set()
    for width in WIDTHS:
        for density in DENSITIES:
            for count in COUNTS:
                old, new = _pair(rng, count, width, density)
                _with(monkeypatch, native_lib)
                rec, payload = codec.encode_chunk(old, new, width=width)
                _with(monkeypatch, None)
                assert codec.encode_chunk(old, new, width=width) == (rec, payload), \
                    (width, density, count)
                kinds.add(rec[0])
                for lib in (native_lib, None):
                    _with(monkeypatch, lib)
                    assert np.array_equal(_decode(rec, payload, old, width), new), \
                        (width, density, count, lib)
    assert kinds == {"zero", "sparse", "xor", "raw"}


def _sparse_by_loops(old: bytes, new: bytes, width: int) -> tuple[list[int], list[int]]:
    gaps, xors, prev = [], [], -1
    for i in range(len(old) // width):
        a = int.from_bytes(old[i * width:(i + 1) * width], "little")
        b = int.from_bytes(new[i * width:(i + 1) * width], "little")
        if a != b:
            gaps.append(i - prev - 1)
            xors.append(a ^ b)
            prev = i
    return gaps, xors


def _planes_by_loops(data: bytes, width: int, count: int) -> list[int]:
    return [sum(data[k * count + c] << (8 * k) for k in range(width)) for c in range(count)]


@pytest.mark.parametrize("use_native", [True, False])
def test_sparse_payload_bytes_by_plain_loops(monkeypatch, native_lib, use_native):
    _with(monkeypatch, native_lib if use_native else None)
    rng = np.random.default_rng(1)
    for width in WIDTHS:
        old, new = _pair(rng, 2000, width, 0.03)
        old[:width] ^= 0xFF  # element 0 changed: a gap of 0 right at the start
        rec, payload = codec.encode_chunk(old, new, width=width)
        assert rec[0] == "sparse"
        gaps, xors = _sparse_by_loops(old.tobytes(), new.tobytes(), width)
        changed, gw = rec[2], rec[3]
        assert changed == len(gaps)
        assert gw == (1 if max(gaps) < 256 else 2 if max(gaps) < 65536 else 4)
        body = zstandard.ZstdDecompressor().decompress(payload)
        assert len(body) == changed * (gw + width)
        assert _planes_by_loops(body[:changed * gw], gw, changed) == gaps
        assert _planes_by_loops(body[changed * gw:], width, changed) == xors


@pytest.mark.parametrize("use_native", [True, False])
def test_sparse_positions_past_the_chunk_are_refused(monkeypatch, native_lib, use_native):
    _with(monkeypatch, native_lib if use_native else None)
    old, new = _pair(np.random.default_rng(2), 500, 2, 0.02)
    rec, payload = codec.encode_chunk(old, new, width=2)
    assert rec[0] == "sparse"
    with pytest.raises(DeltaChainError, match="run past the chunk"):
        _decode(rec, payload, old[:800], 2)


def test_dense_chunk_counts_changed_elements_natively(monkeypatch, native_lib):
    """The dense kernel's count of changed elements (the record's third field) is exact."""
    _with(monkeypatch, native_lib)
    for width in WIDTHS:
        old, new = _pair(np.random.default_rng(3), 3001, width, 0.4)
        rec, _ = codec.encode_chunk(old, new, width=width)
        want = int(np.count_nonzero((old != new).reshape(-1, width).any(axis=1)))
        assert rec[0] in ("xor", "raw") and rec[2] == want


@pytest.mark.parametrize("fmt,encoding", [("rltool", "xor"), ("slime", "xor"),
                                          ("slime", "overwrite")])
def test_chain_streamed_in_odd_blocks_both_paths(tmp_path, monkeypatch, native_lib, fmt,
                                                 encoding):
    """A 2-delta chain rebuilt in 24-byte blocks (straddling the 64-element chunks) is bit-exact
    with the native kernels and with numpy, and both paths write byte-identical deltas."""
    monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(apply, "BLOCK_BYTES", 24)
    w0 = make_weights("bf16", seed=0)
    w1 = perturb(w0, lr=1e-3, seed=1, keep=("norm",))
    w2 = perturb(w1, lr=1e-2, seed=2)
    dirs = [write_checkpoint(tmp_path / f"w{k}", w, version=k) for k, w in enumerate((w0, w1, w2))]
    for tag, lib in (("native", native_lib), ("numpy", None)):
        _with(monkeypatch, lib)
        for k in (1, 2):
            write_delta(open_checkpoint(dirs[k - 1]), open_checkpoint(dirs[k]),
                        tmp_path / f"{tag}-d{k}", version=k, base_version=k - 1, fmt=fmt,
                        encoding=encoding, workers=2)
        apply.apply_chain(open_checkpoint(dirs[0]),
                          [open_delta(tmp_path / f"{tag}-d{k}") for k in (1, 2)],
                          tmp_path / f"{tag}-out", base_version=0, workers=2)
        assert same_bits(load_all(tmp_path / f"{tag}-out"), w2), tag
    for k in (1, 2):
        assert ((tmp_path / f"native-d{k}/model-00001-of-00001.safetensors").read_bytes()
                == (tmp_path / f"numpy-d{k}/model-00001-of-00001.safetensors").read_bytes())
