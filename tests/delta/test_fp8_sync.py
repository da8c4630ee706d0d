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
from rltool.delta.publish import FP8_BLOCK, publish_version
from rltool.delta.pull import pull_weights
from rltool.engine import api
from rltool.engine.paged_runner import PagedRunner
from rltool.errors import BadInputError, ConfigError
from rltool.io.checkpoint import is_delta_dir
from rltool.io.hf_dir import write_hf_dir
from rltool.rundir import VERSION_FILE

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19]


def trained(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A training step's weights: fp32, a small update on a fraction of the entries."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in base.items():
        t = t.float()
        mask = torch.rand(t.shape, generator=g) < 0.3
        out[name] = t + mask * torch.randn(t.shape, generator=g) * 1e-2
    return out


def logits(path, dtype="bf16") -> torch.Tensor:
    return runner(path, dtype).full_pass_logits(SEQ, start=1)


def runner(path, dtype="bf16") -> PagedRunner:
    return PagedRunner(path, device="cpu", dtype=dtype, max_running=2, page_size=4,
                       max_total_tokens=64)


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    """(base model, trainer states of versions 1 and 2, `rltool convert fp8` of each trainer
    checkpoint written in bf16)."""
    base = tiny_model_factory("qwen2", 0)
    root = tmp_path_factory.mktemp("fp8sync")
    states = {1: trained(load_file(str(base / "model.safetensors")), 1)}
    states[2] = trained(states[1], 2)
    refs = {}
    for v, state in states.items():
        (root / f"ckpt{v}").mkdir()
        write_hf_dir(root / f"ckpt{v}", state, source_model_dir=base, dtype="bf16")
        quantize_checkpoint(Fp8Config(hf=root / f"ckpt{v}", out=root / f"ref{v}", workers=1))
        refs[v] = root / f"ref{v}"
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
    sync = SyncConfig(sync="delta", precision="fp8", full_every=10)
    pub = tmp_path / "weights"
    metrics = {v: publish_version(states[v], sync, publish_dir=pub, version=v,
                                  source_model_dir=base, dtype="bf16", workers=1)
               for v in (1, 2)}
    v1, v2 = pub / "weight_v000001", pub / "weight_v000002"
    assert metrics[1]["sync/mode"] == "full" and metrics[2]["sync/mode"] == "delta"
    assert is_delta_dir(v2) and not is_delta_dir(v1)
    assert {m["sync/precision"] for m in metrics.values()} == {"fp8"}
    assert json.loads((v1 / VERSION_FILE).read_text()) == {"version": 1, "precision": "fp8"}
    assert_same_checkpoint(v1, refs[1])
    local = tmp_path / "local"
    pull_weights(local_checkpoint_dir=local, source_dir=pub, target_version=2, workers=1)
    assert_same_checkpoint(local, refs[2])  # the delta of FP8 bytes and scales rebuilds exactly
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
