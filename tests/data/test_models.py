"""rltool.data.models: the CPU init is transformers' own, seeded; `device` draws it elsewhere."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from rltool.cli import main
from rltool.data import models
from rltool.data.models import build_config, build_model, init_model
from rltool.errors import BadInputError


def test_cpu_init_is_transformers_own_seeded_init(tmp_path):
    """The file holds exactly what transformers' init draws on the CPU after manual_seed(seed):
    the `device` option leaves the CPU output as it was."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = init_model(tmp_path / "m", arch="qwen3", seed=5, dtype="bf16", device="cpu")
    torch.manual_seed(5)
    want = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)),
                                            dtype=torch.bfloat16).state_dict()
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in got)


def test_build_model_initialises_on_the_device_in_the_dtype():
    """Nothing is materialised on the CPU, nor in fp32: every tensor is born on the device."""
    config = build_config("qwen2", "qwen2.5-7b", vocab_size=64, eos_token_id=1, pad_token_id=0)
    model = build_model(config, seed=0, dtype=torch.bfloat16, device=torch.device("meta"))
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) > 7e9
    assert {(p.device.type, p.dtype) for p in params.values()} == {("meta", torch.bfloat16)}
    assert {b.device.type for b in model.buffers()} == {"meta"}


@pytest.mark.parametrize("device,match", [("tpu", "unknown --device 'tpu'"),
                                          ("cuda:x", "unknown --device 'cuda:x'"),
                                          ("cuda", "torch sees no CUDA GPU; use --device cpu")])
def test_bad_device_changes_nothing(tmp_path, monkeypatch, device, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BadInputError, match=match):
        init_model(tmp_path / "m", device=device)
    result = CliRunner().invoke(main, ["init-model", "--device", "cuda", "--out",
                                       str(tmp_path / "m")])
    assert result.exit_code == 2 and "torch sees no CUDA GPU" in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_init_is_seeded_sharded_released_and_distributed_as_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "DEVICE_SHARD_SIZE", "2MB")  # the small preset in several shards
    a = init_model(tmp_path / "a", preset="small", dtype="bf16", seed=1, device="cuda")
    torch.cuda.synchronize()
    # Measured after the first call: the first CUDA work of a process leaves a 512-byte block
    # (the generator's state) behind, whatever it was.
    before = torch.cuda.memory_allocated()
    b = init_model(tmp_path / "b", preset="small", dtype="bf16", seed=1, device="cuda")
    assert torch.cuda.memory_allocated() == before  # the model is freed
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert len(shards) > 1 and (a / "model.safetensors.index.json").is_file()
    assert shards == sorted(p.name for p in b.glob("*.safetensors"))
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in shards)  # same seed
    cpu = init_model(tmp_path / "c", preset="small", dtype="bf16", seed=1)
    got = {k: v for n in shards for k, v in load_file(str(a / n)).items()}
    want = load_file(str(cpu / "model.safetensors"))
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        if w.unique().numel() == 1:  # norms and biases: constants
            assert torch.equal(g, w), name
        else:  # N(0, initializer_range) matrices: another draw of the same distribution
            assert not torch.equal(g, w), name
            assert abs(g.float().std() / w.float().std() - 1) < 0.05, name
            assert abs(g.float().mean()) < 2e-3, name
