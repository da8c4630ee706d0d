"""`[sync] precision = "fp8"`: every publish block-quantizes the trainer's weights, and after a
full, delta or tensor sync the engine serves bit for bit what serving `rltool convert fp8` of the
trainer's checkpoint serves; the version records its precision; bad input is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rltool.convert.fp8 import Fp8Config, quantize_checkpoint
from rltool.delta import tensor_sync
from rltool.delta.config import SyncConfig
from rltool.delta.publish import FP8_BLOCK
from rltool.engine import api
from rltool.errors import BadInputError, ConfigError
from rltool.rundir import VERSION_FILE
from tests.helpers.precision_sync import (SEQ, converted_versions, logits,
                                          publish_full_and_delta, runner)


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    """(base model, trainer states of versions 1 and 2, `rltool convert fp8` of each trainer
    checkpoint written in bf16)."""
    base = tiny_model_factory("qwen2", 0)
    states, refs = converted_versions(
        base, tmp_path_factory.mktemp("fp8sync"),
        lambda hf, out: quantize_checkpoint(Fp8Config(hf=hf, out=out, workers=1)))
    return base, states, refs


def assert_same_checkpoint(got, want) -> None:
    a, b = load_file(str(got / "model.safetensors")), {}
    for f in sorted(want.glob("*.safetensors")):
        b.update(load_file(str(f)))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(
            a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    qc = json.loads((got / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((want / "config.json").read_text())["quantization_config"]


def test_full_and_delta_versions_are_convert_fp8(setup, tmp_path):
    base, states, refs = setup
    v1, v2, local = publish_full_and_delta(base, states, refs, tmp_path, "fp8",
                                           assert_same_checkpoint)
    for path in (v2, local):
        assert json.loads((path / VERSION_FILE).read_text()) == {"version": 2, "precision": "fp8"}
    engine = runner(base)
    for v, path in ((1, v1), (2, local)):
        engine.load_weights(path)
        assert torch.equal(engine.full_pass_logits(SEQ, start=1), logits(refs[v]))


def test_tensor_sync_serves_convert_fp8(setup):
    """Buckets smaller than most tensors: every FP8 weight still shares its bucket with its
    scales; the engine (dequantizing at arrival) serves what it serves from the converted
    checkpoint."""
    base, states, refs = setup
    named = tensor_sync.quantize_named(list(states[1].items()), dtype=torch.bfloat16,
                                       block=FP8_BLOCK)
    engine = runner(base)
    groups = tensor_sync.buckets(named, bucket_bytes=4096)
    assert len(groups) > 4
    with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=4096)) as seg:
        for bucket in groups:
            names = {n for n, _ in bucket}
            assert all(n.removesuffix("_scale_inv") in names for n in names)
            message = seg.write(bucket) | {"weight_block_size": list(FP8_BLOCK)}
            with tensor_sync.open_message(api.TensorMessage.model_validate(message)) as got:
                engine.load_named_tensors(got, block=message["weight_block_size"])
    assert torch.equal(engine.full_pass_logits(SEQ, start=1), logits(refs[1]))


def test_refusals(setup):
    base, states, _ = setup
    with pytest.raises(ConfigError, match="not sent over --sync distributed") as e:
        SyncConfig(sync="distributed", precision="fp8")
    assert "\n" not in str(e.value)
    named = tensor_sync.quantize_named(list(states[1].items()), dtype=torch.bfloat16,
                                       block=FP8_BLOCK)
    engine = runner(base)
    before = engine.full_pass_logits(SEQ, start=1)
    wide = next(n for n, t in named if t.dtype == torch.float8_e4m3fn and t.shape[1] > 64)
    for block, needle in (((64, 64), "for weight_block_size [64, 64]"),
                          ((0, 128), "must be two positive integers")):
        with pytest.raises(BadInputError, match=needle.replace("[", r"\[")) as e:
            engine.load_named_tensors(named, block=block)
        assert "\n" not in str(e.value) and (block[0] == 0 or wide in str(e.value))
    with pytest.raises(BadInputError, match="has dtype torch.float8_e4m3fn"):
        engine.load_named_tensors(named)  # FP8 without its block: refused, not misread
    assert torch.equal(engine.full_pass_logits(SEQ, start=1), before)
