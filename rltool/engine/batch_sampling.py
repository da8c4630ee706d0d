"""Batched sampling on the logits' device with one device-to-host transfer per step.

Same semantics as the reference sampler (`sample` in tests/helpers/sampling.py): logprobs of the temperature-scaled
distribution before top-k / top-p / min-p; logit_bias and suppressed ids only change what is drawn;
the draw is the exponential race argmax(p / E). What differs is where it runs: every op stays on
the device over the whole batch, and the chosen tokens, their logprobs and any requested top-k come
back in one copy. Requests with their own generator (a seed) draw their noise from it, on the
device; others share one device generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rltool import trace
from rltool.engine.sampling import SamplingParams, bias_logits, filter_probs
from rltool.logprobs import effective_temperature


@dataclass
class Drawn:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token
    top: list[list[tuple[float, int]] | None]  # per row, when asked for
    ids_logprobs: list[list[tuple[float, int]] | None]


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], *,
                 generators: list[torch.Generator | None], suppressed: list[list[int]],
                 top_n: list[int], token_ids: list[list[int] | None],
                 shared_generator: torch.Generator | None = None,
                 seeds: list[int] | None = None, use_kernel: bool = False) -> Drawn:
    """logits [B, V] float32 on any device. top_n[i] > 0 asks row i for its top logprobs;
    token_ids[i] for the logprobs of given ids. With `use_kernel` (CUDA) and per-row `seeds`
    (31-bit, already mixed with the step), plain rows go through `sampling_kernel.sample_rows`."""
    B = logits.shape[0]
    dev = logits.device
    temps = [effective_temperature(p.temperature) for p in params]
    fast = [i for i, p in enumerate(params) if use_kernel and seeds is not None
            and not p.needs_filter and not p.logit_bias and not suppressed[i]]
    if len(fast) == B:
        from rltool.engine.sampling_kernel import sample_rows

        meta = torch.from_numpy(np.asarray([temps, seeds, [p.greedy for p in params]],
                                           dtype=np.float64))
        meta = meta.to(dev, non_blocking=True)
        tokens, chosen = sample_rows(logits, meta[0].float(), meta[1].int(), meta[2].int())
    else:  # a mixed batch: the torch path for all rows (same distribution, other noise)
        with trace.span("decode.sample", cat="engine", batch=B):
            tokens, chosen = _torch_sample(logits, params, temps, generators=generators,
                                           suppressed=suppressed,
                                           shared_generator=shared_generator)
    logprobs = None
    if any(top_n) or any(token_ids):
        temp_t = torch.tensor(temps, dtype=torch.float32).to(dev, non_blocking=True).unsqueeze(1)
        logprobs = torch.log_softmax(logits / temp_t, dim=-1)
    parts = [tokens.to(torch.float64), chosen.to(torch.float64)]
    k = max(top_n) if top_n else 0
    if k > 0:
        values, idx = logprobs.topk(k, dim=-1)
        parts += [values.to(torch.float64).flatten(), idx.to(torch.float64).flatten()]
    id_rows = [i for i, ids in enumerate(token_ids) if ids]
    for i in id_rows:
        parts.append(logprobs[i, torch.tensor(token_ids[i]).to(dev)].to(torch.float64))
    flat = torch.cat(parts).cpu().tolist()  # the step's one synchronisation
    out_tokens = [int(t) for t in flat[:B]]
    out_lp = flat[B:2 * B]
    at = 2 * B
    top: list[list[tuple[float, int]] | None] = [None] * B
    if k > 0:
        vals, ids = flat[at:at + B * k], flat[at + B * k:at + 2 * B * k]
        at += 2 * B * k
        for i, n in enumerate(top_n):
            if n > 0:
                top[i] = [(vals[i * k + j], int(ids[i * k + j])) for j in range(n)]
    ids_lp: list[list[tuple[float, int]] | None] = [None] * B
    for i in id_rows:
        n = len(token_ids[i])
        ids_lp[i] = list(zip(flat[at:at + n], token_ids[i]))
        at += n
    return Drawn(out_tokens, out_lp, top, ids_lp)


def _torch_sample(logits: torch.Tensor, params: list[SamplingParams], temps: list[float], *,
                  generators: list[torch.Generator | None], suppressed: list[list[int]],
                  shared_generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference sampler with every op on the logits' device: (tokens [B], chosen
    logprobs [B])."""
    B = logits.shape[0]
    dev = logits.device
    temp_t = torch.tensor(temps, dtype=torch.float32).to(dev, non_blocking=True).unsqueeze(1)
    logprobs = torch.log_softmax(logits / temp_t, dim=-1)
    biased = bias_logits(logits, params, suppressed=suppressed)
    draw = logprobs if biased is logits else torch.log_softmax(biased / temp_t, dim=-1)
    tokens = draw.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled).to(dev, non_blocking=True)
        sub = [params[i] for i in sampled]
        probs = draw[rows].exp() if len(sampled) < B else draw.exp()
        if any(p.needs_filter for p in sub):
            probs = filter_probs(probs, sub)
        noise = torch.empty_like(probs).exponential_(generator=shared_generator)
        for j, i in enumerate(sampled):
            if generators[i] is not None:
                noise[j].exponential_(generator=generators[i])
        drawn = (probs / noise).argmax(dim=-1)
        tokens = drawn if len(sampled) == B else tokens.index_copy(0, rows, drawn)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
