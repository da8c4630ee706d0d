"""The memory plans under LoRA (rltool.train.memplan, rltool.train.memfit): the adapters'
parameter count and the torch backend's state bytes (frozen base, the adapters' parameters,
gradients, masters and AdamW moments) equal the real tensors of a LoRA TorchBackend."""

from __future__ import annotations

import pytest
import torch

from rltool.data.models import PRESETS
from rltool.errors import ConfigError
from rltool.train import memfit
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.memplan import Shape, plan
from rltool.train.torch_backend import TorchBackend
from tests.train.test_megatron_memplan import _nbytes

MB = MicroBatch([0], [[3, 9, 4, 17, 22, 5]], [3])


def _loss(out, mb):
    total = out.logprobs[0].sum()
    return total, {}


@pytest.mark.parametrize("arch,preset,targets", [
    ("qwen2", "tiny", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"]),
    ("qwen2", "small", ["all-linear"]),
    ("llama", "tiny", ["q_proj", "v_proj"]),
])
def test_lora_state_bytes_are_the_real_tensors(models, arch, preset, targets):
    model = models(arch, preset)
    for extra in ({}, dict(dtype="bf16", param_dtype="bf16"), dict(optimizer_cpu_offload=True)):
        options = BackendConfig(device="cpu", lora_rank=4, lora_target_modules=targets, **extra)
        backend = TorchBackend(model, options=options)
        backend.train_step([MB], _loss, temperature=1.0)
        shape = Shape.of(backend.config)
        params = list(backend.inner.parameters())
        adapters = [p for p in params if p.requires_grad]
        lora = memfit.lora_params(shape, options)
        assert lora == sum(p.numel() for p in adapters) > 0
        device, host = memfit.torch_state(shape.params, options, lora=lora)
        assert device["params"] == _nbytes(params)
        backend.inner(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.float().sum().backward()
        opt = backend.optimizer
        grads = opt.main_grads() if backend.masters else [p.grad for p in params]
        assert device["grads"] == _nbytes(g for g in grads if g is not None)
        moments = _nbytes(s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
        side = host if options.optimizer_cpu_offload else device
        assert side["optimizer"] == moments
        if backend.masters:
            assert side.get("master_weights", side.get("params")) == _nbytes(opt.masters)


def test_the_loop_plan_under_lora_keeps_the_frozen_base_without_gradients_or_moments():
    shape = Shape.of(PRESETS["qwen2.5-7b"], arch="qwen2")
    n = shape.params
    lora = shape.lora_params(16, ["all-linear"])
    # rank 16 on every linear of Qwen2.5-7B's 28 layers: 40,370,176 adapter parameters
    assert lora == 28 * 16 * (2 * 3584 + 2 * (3584 + 512) + 2 * 3584 + 3 * (3584 + 18944))
    knobs = dict(micro_batch_tokens=4096, recompute=True, kv_tokens=65536)
    full, adapted = plan(shape, offload="optimizer", **knobs), plan(
        shape, offload="optimizer", lora_params=lora, **knobs)
    assert adapted.train["params"] == 4 * (n + lora)
    assert adapted.train["grads"] == 4 * lora and adapted.train["optimizer"] == 8 * lora
    assert adapted.host["optimizer"] == 8 * lora
    assert adapted.rollout["trainer_params"] == 4 * (n + lora)
    assert full.peak("train") - adapted.peak("train") == 12 * n - 16 * lora
    with pytest.raises(ConfigError, match="c_attn: the memory plan knows the decoder linears"):
        shape.lora_params(8, ["c_attn"])
