"""LoRA adapters made with PEFT itself for the engine's LoRA tests (CPU and GPU)."""

from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, out, *, r, alpha, targets, seed, device="cpu", dtype=torch.float32):
    """A PEFT LoRA adapter of the model at `model_dir` with random A and B (B non-zero, unlike
    PEFT's default init), saved to `out` (float32 tensors); returns (the PeftModel on `device`
    in `dtype`, out)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                     init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, cfg).eval()
    peft_model.save_pretrained(str(out))
    return peft_model.to(device=device, dtype=dtype), out
