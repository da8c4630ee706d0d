"""The one logprob convention shared by the rollout engine and the trainers.

The convention: log-probabilities of the temperature-scaled distribution before top-p/top-k filtering.
A temperature below 1e-6 means greedy sampling; its logprobs are reported at temperature 1.0.

`sequence_logprobs` is *the* layout both sides use when exact alignment matters: one unpadded
forward pass over prompt + response (batch of one), logits in float32. The builtin engine in
deterministic mode returns logprobs computed this way, and the torch trainer computes them the
same way, so the two agree bit for bit on CPU in fp32 (see docs/align.md).
"""

from __future__ import annotations

from typing import Any

import torch

GREEDY_TEMPERATURE = 1e-6


def effective_temperature(temperature: float) -> float:
    return 1.0 if temperature < GREEDY_TEMPERATURE else float(temperature)


def scaled_logits(logits: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """float32 logits / the effective temperature (at 1 the division is skipped: x / 1.0 == x
    exactly, and a pass over [tokens, vocab] float32 is saved)."""
    temp = effective_temperature(temperature)
    scaled = logits.float()
    return scaled if temp == 1.0 else scaled / temp


def logits_to_logprobs(logits: torch.Tensor, targets: torch.Tensor, *,
                       temperature: float) -> torch.Tensor:
    """logits [..., T, V], targets [..., T] -> logprobs [..., T] (float32)."""
    return torch.log_softmax(scaled_logits(logits, temperature=temperature), dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sequence_logprobs(model: Any, token_ids: list[int] | torch.Tensor, *, response_start: int,
                      temperature: float) -> torch.Tensor:
    """Logprobs of tokens[response_start:] given everything before them, one unpadded pass.

    Returns a float32 tensor of length len(token_ids) - response_start.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=_device_of(model)).unsqueeze(0)
    if not 1 <= response_start <= ids.shape[1]:
        raise ValueError(f"response_start {response_start} outside [1, {ids.shape[1]}]")
    logits = model(input_ids=ids, use_cache=False).logits[0]
    return logits_to_logprobs(logits[response_start - 1:-1], ids[0, response_start:],
                              temperature=temperature)


def _device_of(model: Any) -> torch.device:
    return next(model.parameters()).device
