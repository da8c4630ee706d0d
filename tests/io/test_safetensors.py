"""rltool's streaming safetensors reader/writer against the official library."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rltool.io.header import dtype_code
from rltool.io.reader import read_header, read_tensor
from rltool.io.writer import write_streaming
from rltool.errors import CheckpointError


def test_streaming_writer_and_mapped_reader_agree_with_safetensors(tmp_path):
    tensors = {"a": torch.arange(3, dtype=torch.uint8),  # 3 bytes: "b" starts unaligned
               "b": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
               "c": torch.randn(4, 5).to(torch.float8_e4m3fn), "d": torch.zeros(0, 7)}
    entries = [(n, dtype_code(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "x.safetensors"
    total = write_streaming(path, entries, iter(tensors.items()), metadata={"format": "pt"})
    assert total == sum(t.numel() * t.element_size() for t in tensors.values())
    with safe_open(str(path), framework="pt") as f:
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name).view(torch.uint8), t.view(torch.uint8))
    parsed = read_header(path)
    infos, meta = parsed.entries, parsed.metadata
    assert meta == {"format": "pt"}
    for name, t in tensors.items():
        got = read_tensor(infos[name])
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    got = read_tensor(infos["b"])
    got.add_(1)  # copy-on-write: the file keeps its bytes
    assert torch.equal(read_tensor(infos["b"]), tensors["b"])


def test_reader_refuses_corrupt_and_truncated_files(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="truncated header"):
        read_header(bad)
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(64)}, str(good))
    data = good.read_bytes()
    good.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="runs past the end"):
        read_header(good)
