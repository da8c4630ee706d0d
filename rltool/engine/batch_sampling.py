"""Batched sampling on the logits' device with one device-to-host transfer per step.

Same semantics as the reference sampler (`sample` in tests/helpers/sampling.py): logprobs of the temperature-scaled
distribution before top-k / top-p / min-p; logit_bias and suppressed ids only change what is drawn;
the draw is the exponential race argmax(p / E). What differs is where it runs: every op stays on
the device over the whole batch, and the chosen tokens, their logprobs and any requested top-k come
back in one copy.

With the Triton sampler (`use_kernel`: CUDA, or CPU under TRITON_INTERPRET=1) every row of a batch
is sampled by `sampling_kernel.sample_rows` from a per-row seed (no generator objects): rows with
top-k / top-p / min-p, logit_bias or masked stop ids race over `draw_logits`, a fixed number of
batched launches whatever B, built from the batch's `DrawParams`. Without it (CPU) the torch path
draws each seeded request's noise from its own generator and the others' from a shared one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rltool import trace
from rltool.engine.sampling import SamplingParams, bias_logits, filter_mask, filter_probs
from rltool.logprobs import effective_temperature


@dataclass
class Drawn:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token
    top: list[list[tuple[float, int]] | None]  # per row, when asked for
    ids_logprobs: list[list[tuple[float, int]] | None]


@dataclass
class DrawParams:
    """A batch's parameters that change what it draws but not its logprobs, as device tensors
    (built once per batch on the host; `draw_logits` only reads them, so it can be replayed)."""

    temps: torch.Tensor  # [B] float32, the effective temperatures
    filtered: torch.Tensor | None  # [B] bool: rows with top-k / top-p / min-p (None: no row)
    top_k: torch.Tensor | None  # [B] int64, the vocabulary size when off
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    bias_ids: torch.Tensor | None  # [B, NB] int64, rows padded with (0, 0.0)
    bias_values: torch.Tensor | None  # [B, NB] float32
    stop_ids: torch.Tensor | None  # [B, NS] int64, rows padded with their first id (or 0)
    stop_rows: torch.Tensor | None  # [B] bool: rows that have stop ids to mask
    max_k: int | None = None  # every filtered row's top_k is at most this (None: some has none)

    @staticmethod
    def build(params: list[SamplingParams], *, temps: list[float], stop_ids: list[list[int]],
              vocab: int, device: torch.device) -> "DrawParams | None":
        """None when no row filters, biases or masks a token (the plain race suffices)."""
        biases, stops = draw_lists(params, stop_ids=stop_ids, vocab=vocab)
        filtered = [p.needs_filter for p in params]
        if not any(filtered) and not any(biases) and not any(stops):
            return None

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype)
            if device.type == "cuda":  # a copy from pageable memory waits for queued work
                host = host.pin_memory()  # (a decode block in flight)
            return host.to(device, non_blocking=True)

        out = DrawParams(dev(temps, torch.float32), *[None] * 8)
        if any(filtered):
            out.filtered = dev(filtered, torch.bool)
            out.top_k = dev([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64)
            out.top_p = dev([p.top_p for p in params], torch.float32)
            out.min_p = dev([p.min_p for p in params], torch.float32)
            ks = [p.top_k for p, f in zip(params, filtered) if f]
            out.max_k = max(ks) if min(ks) > 0 else None
        if any(biases):
            width = max(len(b) for b in biases)
            pad = [b + [(0, 0.0)] * (width - len(b)) for b in biases]
            out.bias_ids = dev([[t for t, _ in row] for row in pad], torch.int64)
            out.bias_values = dev([[v for _, v in row] for row in pad], torch.float32)
        if any(stops):
            # Padding repeats a row's first id, so every write to an index writes the same value.
            width = max(len(s) for s in stops)
            out.stop_ids = dev([s + [s[0] if s else 0] * (width - len(s)) for s in stops],
                               torch.int64)
            out.stop_rows = dev([bool(s) for s in stops], torch.bool)
        return out


def draw_lists(params: list[SamplingParams], *, stop_ids: list[list[int]], vocab: int
               ) -> tuple[list[list[tuple[int, float]]], list[list[int]]]:
    """Per row, the (token id, bias) pairs of its logit_bias and the stop ids to mask, ids
    outside the vocabulary dropped."""
    biases = [[(int(t), b) for t, b in (p.logit_bias or {}).items() if 0 <= int(t) < vocab]
              for p in params]
    return biases, [[t for t in ids if 0 <= t < vocab] for ids in stop_ids]


def draw_logits(logits: torch.Tensor, params: DrawParams,
                suppress: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 logits a batch races over: logit_bias added, the stop ids of rows in
    `suppress` ([B] bool on the device; None: every row with stop ids) at -inf, then the tokens
    top-k / top-p / min-p remove (from the biased, temperature-scaled distribution) at -inf. A
    fixed number of batched launches whatever B, no host synchronisation."""
    x = logits.float().clone()
    if params.bias_ids is not None:
        x.scatter_add_(1, params.bias_ids, params.bias_values)
    if params.stop_ids is not None:
        rows = params.stop_rows if suppress is None else params.stop_rows & suppress
        masked = torch.where(rows.unsqueeze(1), float("-inf"), x.gather(1, params.stop_ids))
        x.scatter_(1, params.stop_ids, masked)
    if params.filtered is not None:
        probs = torch.softmax(x / params.temps.unsqueeze(1), dim=-1)
        remove = filter_mask(probs, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                             max_k=params.max_k)
        x.masked_fill_(remove & params.filtered.unsqueeze(1), float("-inf"))
    return x


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], *,
                 generators: list[torch.Generator | None], suppressed: list[list[int]],
                 top_n: list[int], token_ids: list[list[int] | None],
                 shared_generator: torch.Generator | None = None,
                 seeds: list[int] | None = None, use_kernel: bool = False) -> Drawn:
    """logits [B, V] float32 on any device. top_n[i] > 0 asks row i for its top logprobs;
    token_ids[i] for the logprobs of given ids. With `use_kernel` and per-row `seeds` (31-bit,
    already mixed with the step) every row goes through `sampling_kernel.sample_rows`; else the
    torch path draws with `generators` and `shared_generator`."""
    B, V = logits.shape
    dev = logits.device
    temps = [effective_temperature(p.temperature) for p in params]
    if use_kernel and seeds is not None:
        from rltool.engine.sampling_kernel import sample_rows

        meta = torch.from_numpy(np.asarray([temps, seeds, [p.greedy for p in params]],
                                           dtype=np.float64))
        meta = meta.to(dev, non_blocking=True)
        draw = DrawParams.build(params, temps=temps, stop_ids=suppressed, vocab=V, device=dev)
        tokens, chosen = sample_rows(logits, meta[0].float(), meta[1].int(), meta[2].int(),
                                     draw=None if draw is None else draw_logits(logits, draw))
    else:
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
