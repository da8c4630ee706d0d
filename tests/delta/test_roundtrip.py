"""Bit-exact round trips: every dtype x every format, multi-chunk tensors, shards, extra files."""

from __future__ import annotations

import json

import pytest
import torch

from rltool.delta import codec
from rltool.delta.apply import apply_chain
from rltool.io.checkpoint import open_checkpoint
from rltool.delta.deltadir import open_delta
from rltool.delta.diff import write_delta
from rltool.errors import BadInputError
from tests.helpers.checkpoints import load_all, make_weights, perturb, same_bits, write_checkpoint

FORMATS = [("rltool", "xor"), ("slime", "xor"), ("slime", "overwrite")]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 elements, so tensors span several chunks and end in a partial one."""
    monkeypatch.setattr(codec, "CHUNK_ELEMENTS", 64)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("fmt,encoding", FORMATS)
@pytest.mark.parametrize("lr", [1e-4, 1e-2])
def test_round_trip_bit_exact(tmp_path, small_chunks, dtype, fmt, encoding, lr):
    w0 = make_weights(dtype, seed=0)
    w1 = perturb(w0, lr=lr, seed=1, keep=("norm",))
    if dtype != "fp8":  # special values survive byte-exactly (NaN payload, -0.0, inf)
        w1["odd"] = torch.tensor([float("nan"), -0.0, float("inf"), 0.0, 1.0, -1.0, 1e-30],
                                 dtype=w0["odd"].dtype)
    base = write_checkpoint(tmp_path / "base", w0, version=0)
    new = write_checkpoint(tmp_path / "new", w1, version=1)
    stats = write_delta(open_checkpoint(base), open_checkpoint(new), tmp_path / "delta",
                        version=1, base_version=0, fmt=fmt, encoding=encoding, workers=2)
    changed = [k for k in w0 if not same_bits({k: w0[k]}, {k: w1[k]})]
    assert stats["tensors_changed"] == len(changed) and "norm" not in changed
    assert "norm" not in json.loads((tmp_path / "delta/model.safetensors.index.json").read_text())[
        "weight_map"]
    apply_chain(open_checkpoint(base), [open_delta(tmp_path / "delta")], tmp_path / "out",
                base_version=0, workers=2)
    assert same_bits(load_all(tmp_path / "out"), w1)
    assert json.loads((tmp_path / "out/rltool_version.json").read_text()) == {"version": 1}


def test_rltool_picks_encoding_by_density(tmp_path, small_chunks):
    """Sparse for a few changed elements, xor for dense small changes, raw for noise, zero for
    untouched chunks; and the result is still bit-exact."""
    g = torch.Generator().manual_seed(0)
    w0 = {"t": (torch.randn(4 * 64, generator=g) * 0.02).to(torch.bfloat16)}
    t = w0["t"].clone()
    t[0:64][::16] = 1.0                                         # chunk 0: 4 of 64 changed
    t[64:128] = (t[64:128].float() * 1.01).to(torch.bfloat16)    # chunk 1: dense, small
    t[128:192] = torch.randn(64, generator=g).to(torch.bfloat16)   # chunk 2: unrelated values
    w1 = {"t": t}                                                # chunk 3: untouched
    base = write_checkpoint(tmp_path / "b", w0)
    new = write_checkpoint(tmp_path / "n", w1)
    write_delta(open_checkpoint(base), open_checkpoint(new), tmp_path / "d", version=1,
                base_version=0)
    index = json.loads((tmp_path / "d/model.safetensors.index.json").read_text())
    kinds = [c[0] for c in index["rltool_delta"]["tensors"]["t"]["chunks"]]
    assert kinds[0] == "sparse" and kinds[3] == "zero"
    assert kinds[1] == "xor" and kinds[2] in ("xor", "raw")
    apply_chain(open_checkpoint(base), [open_delta(tmp_path / "d")], tmp_path / "o", base_version=0)
    assert same_bits(load_all(tmp_path / "o"), w1)


@pytest.mark.parametrize("fmt,encoding", FORMATS)
def test_sharded_checkpoint_and_extra_files(tmp_path, fmt, encoding):
    w0 = make_weights("bf16", seed=3)
    w1 = perturb(w0, lr=1e-3, seed=4)
    base = write_checkpoint(tmp_path / "b", w0, shards=3, extra={"tokenizer.json": "{}",
                                                                  "old.txt": "x"})
    new = write_checkpoint(tmp_path / "n", w1, shards=3, extra={"tokenizer.json": '{"v": 2}'})
    write_delta(open_checkpoint(base), open_checkpoint(new), tmp_path / "d", version=5,
                base_version=4, fmt=fmt, encoding=encoding)
    assert (tmp_path / "d/tokenizer.json").read_text() == '{"v": 2}'  # changed file shipped
    assert not (tmp_path / "d/config.json").exists()  # unchanged file not shipped
    apply_chain(open_checkpoint(base), [open_delta(tmp_path / "d")], tmp_path / "o", base_version=4)
    assert same_bits(load_all(tmp_path / "o"), w1)
    assert sorted(p.name for p in (tmp_path / "o").glob("*.safetensors")) == sorted(
        p.name for p in base.glob("*.safetensors"))
    assert (tmp_path / "o/tokenizer.json").read_text() == '{"v": 2}'
    assert (tmp_path / "o/old.txt").exists() == (fmt == "slime")  # only rltool records removals


def test_mismatched_tensors_refused_and_nothing_written(tmp_path):
    w0 = make_weights("fp32", seed=0)
    w1 = dict(w0)
    w1["embed"] = w1["embed"][:10]
    base, new = write_checkpoint(tmp_path / "b", w0), write_checkpoint(tmp_path / "n", w1)
    with pytest.raises(BadInputError, match="shape"):
        write_delta(open_checkpoint(base), open_checkpoint(new), tmp_path / "d", version=1,
                    base_version=0)
    assert not (tmp_path / "d").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("fmt,encoding", FORMATS)
def test_scalar_empty_and_integer_tensors(tmp_path, fmt, encoding):
    w0 = {"empty": torch.zeros(0, dtype=torch.bfloat16), "scalar": torch.tensor(1.5),
          "ids": torch.arange(10, dtype=torch.int64)}
    w1 = {"empty": torch.zeros(0, dtype=torch.bfloat16), "scalar": torch.tensor(2.5),
          "ids": torch.arange(10, dtype=torch.int64) * 3}
    base, new = write_checkpoint(tmp_path / "b", w0), write_checkpoint(tmp_path / "n", w1)
    stats = write_delta(open_checkpoint(base), open_checkpoint(new), tmp_path / "d", version=1,
                        base_version=0, fmt=fmt, encoding=encoding)
    assert stats["tensors_changed"] == 2
    apply_chain(open_checkpoint(base), [open_delta(tmp_path / "d")], tmp_path / "o", base_version=0)
    assert same_bits(load_all(tmp_path / "o"), w1)
