"""LoRA on the torch backend on one GPU: the packed layout's forward equals PEFT's on the same
adapter (fp32), a bf16 step moves only the adapters, and the memory plan under LoRA
(rltool.train.memfit with `--lora-rank`) is within MARGIN of the measured peak of a step on
Qwen2.5-3B shapes (random init). Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from rltool.train import lora, memfit
from rltool.train.backend import MicroBatch
from rltool.train.config import LORA_DEFAULT_TARGETS, BackendConfig, TrainConfig
from rltool.train.torch_backend import TorchBackend
from tests.helpers.train_peak import measured_step_peak

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GIB = float(1 << 30)
MARGIN = 0.05
TOKENS = [[3, 9, 4, 17, 22, 5, 8, 30], [3, 9, 4, 11, 2, 7], [6, 12, 13, 14, 15, 16, 18, 19, 20]]
STARTS = [4, 4, 5]


def _loss(out, mb):
    total = sum((lp * (1.0 if k % 2 else -1.0)).sum() for k, lp in enumerate(out.logprobs))
    return total, {}


def test_packed_forward_equals_peft_on_the_gpu(tiny_model_dir):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    backend = TorchBackend(tiny_model_dir, options=BackendConfig(device="cuda", lora_rank=4))
    assert backend.layout == "packed"
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in backend.inner.named_parameters():
            if name.endswith(".lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(
        LORA_DEFAULT_TARGETS))).to("cuda").eval()
    set_peft_model_state_dict(peft, lora.peft_tensors(backend.export_adapter()))
    out = backend.forward_logprobs(MicroBatch([0, 1, 2], TOKENS, STARTS), temperature=1.0)
    for got, tokens, start in zip(out.logprobs, TOKENS, STARTS):
        with torch.no_grad():
            logits = peft(input_ids=torch.tensor([tokens], device="cuda")).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        want = torch.stack([logp[j - 1, tokens[j]] for j in range(start, len(tokens))])
        assert torch.allclose(got.double().cuda(), want, atol=1e-4)


def test_a_bf16_step_moves_only_the_adapters(tiny_model_dir):
    # lora_B starts at zero, so lora_A first moves in the second step, by about lr: at 1e-2 that
    # is a change a bf16 parameter of ~0.1 (an ulp of ~5e-4) shows.
    backend = TorchBackend(tiny_model_dir, options=BackendConfig(
        device="cuda", lora_rank=4, dtype="bf16", param_dtype="bf16", lr=1e-2))
    before = {k: v.clone() for k, v in backend.inner.state_dict().items()}
    for _ in range(2):
        backend.train_step([MicroBatch([0, 1, 2], TOKENS, STARTS)], _loss, temperature=1.0)
    after = backend.inner.state_dict()
    for key, value in before.items():
        assert torch.equal(value, after[key]) != lora.is_adapter_key(key), key
    assert all(v.dtype == torch.bfloat16 for v in after.values())


@pytest.mark.parametrize("extra", [dict(), dict(param_dtype="bf16")],
                         ids=["fp32-params", "bf16-params"])
def test_the_lora_plan_is_the_measured_peak(model_3b, extra):
    cfg = TrainConfig(rollouts=["unused"], load=str(model_3b), dtype="bf16", device="cuda",
                      lr=1e-5, recompute="auto", max_tokens_per_microbatch=0, lora_rank=16,
                      **extra)
    cfg = cfg.model_copy(update=memfit.fit(cfg, model_3b, longest=1))
    hf = json.loads((model_3b / "config.json").read_text())
    tokens = cfg.max_tokens_per_microbatch
    predicted = memfit.predictor(cfg, hf, world_size=1)(cfg.recompute, tokens)
    peak = measured_step_peak(model_3b, cfg)
    print(f"LoRA {extra}: recompute {cfg.recompute}, {tokens} tokens: measured "
          f"{peak / GIB:.2f} GiB, planned {predicted / GIB:.2f} GiB "
          f"({(peak - predicted) / predicted:+.1%})")
    assert abs(peak - predicted) <= MARGIN * predicted, (peak / GIB, predicted / GIB)
