"""`[sync] precision = "int4"`: every publish re-quantizes the trainer's weights as `rltool convert
int4` does (its defaults for the model), bit for bit; after a full, delta or tensor sync the engine
serves the logprobs it serves from that checkpoint loaded fresh; the distributed transport and
mismatched INT4 updates are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rltool.convert import int4
from rltool.delta import tensor_sync
from rltool.delta.config import SyncConfig
from rltool.delta.publish import int4_format, publish_version
from rltool.engine import api
from rltool.errors import BadInputError, ConfigError
from tests.helpers.precision_sync import (SEQ, converted_versions, logits,
                                          publish_full_and_delta, runner)


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe"])
def setup(request, tiny_model_factory, tmp_path_factory):
    """(base model, trainer states of versions 1 and 2, `rltool convert int4` of each trainer
    checkpoint written in bf16)."""
    base = tiny_model_factory(request.param, 0)
    states, refs = converted_versions(
        base, tmp_path_factory.mktemp(f"int4sync-{request.param}"),
        lambda hf, out: int4.quantize_checkpoint(int4.Int4Config(hf=hf, out=out, workers=1)))
    return base, states, refs


def assert_same_checkpoint(got, want) -> None:
    a, b = {}, {}
    for d, out in ((got, a), (want, b)):
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(str(f)))
    assert a.keys() == b.keys()
    assert any(n.endswith(".weight_packed") for n in a)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    qc = json.loads((got / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((want / "config.json").read_text())["quantization_config"]


def test_full_and_delta_versions_are_convert_int4(setup, tmp_path):
    base, states, refs = setup
    v1, _, local = publish_full_and_delta(base, states, refs, tmp_path, "int4",
                                          assert_same_checkpoint)
    engine = runner(v1)  # serving an INT4 version, as the loop's engines do
    for v, path in ((1, v1), (2, local)):
        engine.load_weights(path)
        assert torch.equal(engine.full_pass_logits(SEQ, start=1), logits(refs[v]))


def test_publishing_a_directory_reads_and_quantizes_it(setup, tmp_path):
    """Version 0 from the model's own (unquantized) directory, as the loop publishes it."""
    base, _, _ = setup
    publish_version(base, SyncConfig(sync="full", precision="int4"), publish_dir=tmp_path / "w",
                    version=0, workers=1)
    ref = tmp_path / "ref"
    int4.quantize_checkpoint(int4.Int4Config(hf=base, out=ref, workers=1))
    assert_same_checkpoint(tmp_path / "w" / "weight_v000000", ref)


def test_tensor_sync_serves_convert_int4(setup):
    """Buckets smaller than most tensors: every INT4 weight still shares its bucket with its
    scale and shape; an engine that serves the INT4 version 1 takes version 2 in memory and then
    serves what it serves from version 2's converted checkpoint loaded fresh."""
    base, states, refs = setup
    fmt = int4_format(base)
    named = tensor_sync.quantize_named_int4(list(states[2].items()), dtype=torch.bfloat16,
                                            fmt=fmt)
    engine = runner(refs[1])
    groups = tensor_sync.buckets(named, bucket_bytes=2048)
    assert len(groups) > 4
    with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=2048)) as seg:
        for bucket in groups:
            names = {n for n, _ in bucket}
            assert all(n.rpartition(".")[0] + ".weight_packed" in names for n in names
                       if n.endswith((".weight_scale", ".weight_shape")))
            message = seg.write(bucket, dtype=torch.bfloat16)
            with tensor_sync.open_message(api.TensorMessage.model_validate(message)) as got:
                engine.load_named_tensors(got)
    assert torch.equal(engine.full_pass_logits(SEQ, start=1), logits(refs[2]))


def test_refusals(setup):
    base, states, refs = setup
    with pytest.raises(ConfigError, match="int4 is not sent over --sync distributed") as e:
        SyncConfig(sync="distributed", precision="int4")
    assert "\n" not in str(e.value)
    named = tensor_sync.quantize_named_int4(list(states[1].items()), dtype=torch.bfloat16,
                                            fmt=int4_format(base))
    engine = runner(refs[1])
    before = engine.full_pass_logits(SEQ, start=1)
    packed = next(n for n, _ in named if n.endswith(".weight_packed"))
    without_scale = [(n, t) for n, t in named if n != packed.replace("_packed", "_scale")]
    with pytest.raises(BadInputError, match="comes without weight_scale") as e:
        engine.load_named_tensors(without_scale)
    assert "\n" not in str(e.value)
    orphan = [(n, t) for n, t in named if n != packed]
    with pytest.raises(BadInputError, match="belongs to no weight_packed"):
        engine.load_named_tensors(orphan)
    assert torch.equal(engine.full_pass_logits(SEQ, start=1), before)
