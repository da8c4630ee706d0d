"""slime's on-disk delta format, both directions, as docs/formats.md describes it
literally with independent tools (safetensors.numpy, zstandard, xxhash), not rltool's IO."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy

from rltool.delta.apply import apply_chain
from rltool.io.checkpoint import open_checkpoint
from rltool.delta.deltadir import open_delta
from rltool.delta.diff import write_delta
from tests.helpers.checkpoints import load_all, make_weights, perturb, same_bits, write_checkpoint


def raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def hand_made_slime_delta(path, w0, w1, *, encoding: str, version: int, base_version: int):
    """A slime delta version written from the reference text alone."""
    path.mkdir()
    blobs, checksums = {}, {}
    for name in w0:
        old, new = raw(w0[name]), raw(w1[name])
        if np.array_equal(old, new):
            continue  # "Unchanged tensors are absent."
        if encoding == "xor":
            body = (new ^ old).tobytes()
        else:  # u32 count C, C u32 byte positions, C new byte values (little-endian)
            pos = np.flatnonzero(new != old)
            body = (struct.pack("<I", len(pos)) + pos.astype("<u4").tobytes()
                    + new[pos].tobytes())
        blob = zstandard.ZstdCompressor(level=1).compress(body)  # level 1, one frame
        blobs[name] = np.frombuffer(blob, dtype=np.uint8)
        checksums[name] = xxhash.xxh3_128_hexdigest(new.tobytes())
    fname = "model-00001-of-00001.safetensors"
    save_numpy(blobs, str(path / fname), metadata=checksums)
    (path / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"version": f"{version:06d}", "base_version": f"{base_version:06d}",
                     "delta_encoding": encoding, "compression_format": "zstd",
                     "checksum_format": "xxh3-128"},
        "weight_map": {name: fname for name in blobs}}))
    return path


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp8"])
def test_rltool_applies_slime_delta(tmp_path, encoding, dtype):
    w0 = make_weights(dtype, seed=0)
    w1 = perturb(w0, lr=1e-2, seed=1, keep=("norm",))
    base = write_checkpoint(tmp_path / "weight_v000041", w0)
    delta = hand_made_slime_delta(tmp_path / "weight_v000042", w0, w1, encoding=encoding,
                                  version=42, base_version=41)
    apply_chain(open_checkpoint(base), [open_delta(delta)], tmp_path / "out", base_version=41)
    assert same_bits(load_all(tmp_path / "out"), w1)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_slime_reader_applies_rltool_slime_output(tmp_path, encoding):
    """An independent reader (what a slime-patched SGLang does) decodes rltool's slime output."""
    w0 = make_weights("bf16", seed=5)
    w1 = perturb(w0, lr=1e-3, seed=6, keep=("norm",))
    base = write_checkpoint(tmp_path / "weight_v000006", w0)
    new = write_checkpoint(tmp_path / "n", w1)
    out = tmp_path / "weight_v000007"
    write_delta(open_checkpoint(base), open_checkpoint(new), out, version=7, base_version=6,
                fmt="slime", encoding=encoding)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"version": "000007", "base_version": "000006",
                                 "delta_encoding": encoding, "compression_format": "zstd",
                                 "checksum_format": "xxh3-128"}
    files = set(index["weight_map"].values())
    assert files == {"model-00001-of-00001.safetensors"}
    assert "norm" not in index["weight_map"]
    for fname in files:
        with safe_open(str(out / fname), framework="numpy") as f:
            meta = f.metadata()
            for name in f.keys():
                blob = f.get_tensor(name)
                assert blob.dtype == np.uint8 and blob.ndim == 1
                frame = blob.tobytes()
                assert zstandard.get_frame_parameters(frame).content_size > 0
                body = zstandard.ZstdDecompressor().decompress(frame)
                new_bytes = raw(w0[name]).copy()
                if encoding == "xor":
                    new_bytes ^= np.frombuffer(body, dtype=np.uint8)
                else:
                    (count,) = struct.unpack_from("<I", body)
                    pos = np.frombuffer(body, dtype="<u4", count=count, offset=4)
                    new_bytes[pos] = np.frombuffer(body, dtype=np.uint8, offset=4 + 4 * count)
                assert np.array_equal(new_bytes, raw(w1[name]))
                assert meta[name] == xxhash.xxh3_128_hexdigest(new_bytes.tobytes())
