"""Reference outputs from transformers for the engine tests (CPU, fp32)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(model_dir, prompt, n):
    """transformers' greedy continuation of `prompt`: its n tokens and their logprobs, one full
    pass per token."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            out.append(tok)
            ids.append(tok)
    return out, lps
