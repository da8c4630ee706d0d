"""The reference sampler the engine's samplers are tested against (`batch_sampling.sample_batch`,
the Triton kernel): the semantics rltool.engine.sampling describes, with the noise drawn row by
row from each request's own generator, so a difference in a batched or fused path shows up as a
different token."""

from __future__ import annotations

import torch

from rltool.engine.sampling import SamplingParams, bias_logits, filter_probs
from rltool.logprobs import effective_temperature


def scaled_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [B, V] -> float32 logprobs of the temperature-scaled distribution, per row."""
    temps = torch.tensor([effective_temperature(p.temperature) for p in params],
                         dtype=torch.float32).unsqueeze(1)
    return torch.log_softmax(logits.float() / temps, dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], *,
           generators: list[torch.Generator | None], suppressed: list[list[int]],
           shared_generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (tokens [B], logprobs [B, V] by the convention).

    Rows with a generator draw their noise from it (deterministic mode); the others share
    `shared_generator` (or torch's default one).
    """
    logits = logits.float()
    logprobs = scaled_logprobs(logits, params)
    biased = bias_logits(logits, params, suppressed=suppressed)
    draw_logprobs = logprobs if biased is logits else scaled_logprobs(biased, params)
    tokens = draw_logprobs.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return tokens, logprobs
    rows = torch.tensor(sampled_rows)
    sub_params = [params[i] for i in sampled_rows]
    probs = draw_logprobs[rows].exp()
    if any(p.needs_filter for p in sub_params):
        probs = filter_probs(probs, sub_params)
    noise = torch.empty_like(probs)
    shared_rows = [j for j, i in enumerate(sampled_rows) if generators[i] is None]
    if shared_rows:
        noise[shared_rows] = torch.empty(len(shared_rows), probs.shape[-1]).exponential_(
            generator=shared_generator)
    for j, i in enumerate(sampled_rows):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens, logprobs
