"""The megatron memory plan under `--lora-rank` on one GPU, bf16: the state bytes (the frozen bf16
base, the fp32 adapters, their gradient buffer and Adam moments, no master weights) against the
real tensors of tiny qwen2 trainers, and the whole plan against `torch.cuda.max_memory_allocated`
of a train step on Qwen2.5-3B shapes (random init) with rank-16 adapters on every linear, at the
setting `--recompute auto` and the automatic cap choose for this device. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from rltool.train import megatron_memplan as mplan
from rltool.train import memfit
from rltool.train.config import BackendConfig, TrainConfig
from rltool.train.launch import process_group_scope
from tests.helpers.train_peak import measured_step_peak
from tests.train.test_megatron_memplan import MB, _megatron_bytes, loss_fn
from tests.train.test_memplan_gpu import MARGIN

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GIB = float(1 << 30)


@pytest.mark.parametrize("distributed", [False, True], ids=["tp1", "tp1-distopt"])
def test_bf16_lora_state_bytes_are_the_real_tensors(tiny_model_factory, distributed):
    from rltool.train.megatron_backend import MegatronBackend

    model = tiny_model_factory("qwen2")
    options = BackendConfig(backend="megatron", device="cuda", dtype="bf16", lora_rank=4,
                            use_distributed_optimizer=distributed)
    with process_group_scope():
        backend = MegatronBackend(model, options=options)
        backend.train_step([MB], loss_fn, temperature=1.0)
        real = _megatron_bytes(backend)
        dtypes = {p.dtype for p in backend.module.parameters() if not p.requires_grad}
    hf = json.loads((model / "config.json").read_text())
    device = mplan.state_bytes(mplan.ModelShape.of(hf), mplan.Layout.of(options, world_size=1),
                               dtype="bf16", lora=memfit.megatron_lora(options, hf))[0]
    assert dtypes == {torch.bfloat16}
    assert device == {"weights": real["weights"], "grads": real["grads"],
                      "optimizer": real["optimizer"]}


def test_the_lora_plan_is_the_measured_peak(model_3b):
    cfg = TrainConfig(rollouts=["unused"], load=str(model_3b), backend="megatron", dtype="bf16",
                      device="cuda", lr=1e-6, recompute="auto", max_tokens_per_microbatch=0,
                      use_distributed_optimizer=True, lora_rank=16)
    cfg = cfg.model_copy(update=memfit.fit(cfg, model_3b, longest=1))
    hf = json.loads((model_3b / "config.json").read_text())
    tokens = cfg.max_tokens_per_microbatch
    predicted = memfit.predictor(cfg, hf, world_size=1)(cfg.recompute, tokens)
    total = torch.cuda.get_device_properties(0).total_memory
    assert predicted <= memfit.room(total)
    peak = measured_step_peak(model_3b, cfg)
    print(f"megatron LoRA r16: recompute {cfg.recompute}, {tokens} tokens, logprob chunks of "
          f"{cfg.logprob_chunk_tokens}: measured {peak / GIB:.2f} GiB, planned "
          f"{predicted / GIB:.2f} GiB ({(peak - predicted) / predicted:+.1%}); device "
          f"{total / GIB:.1f} GiB, room {memfit.room(total) / GIB:.1f} GiB")
    assert abs(peak - predicted) <= MARGIN * predicted, (peak / GIB, predicted / GIB)
