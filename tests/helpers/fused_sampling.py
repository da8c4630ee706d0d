"""References and drivers for the fused sampler's tests (tests/engine/test_sampling_fused.py on
CPU under Triton's interpreter, tests/gpu/test_gpu_sampling.py on CUDA): an independent numpy
version of the kernel's draw (the exponential race in log space, argmax of logit / T plus
-log(-log U), U from the counter-based hash of (seed, token id)), the filters by plain loops, and
a scheduler run of filtered requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rltool.engine.sampling import SamplingParams, make_generator
from rltool.logprobs import effective_temperature
from tests.helpers.scheduling import run_all

M32 = 0xFFFF_FFFF
STOP = 17  # the stop id the min_new_tokens request of `decode_filtered` biases to win
FILTERED_PARAMS = [
    SamplingParams(max_new_tokens=7, top_k=5, top_p=0.9, ignore_eos=True),
    SamplingParams(max_new_tokens=7, min_p=0.1, temperature=0.8, ignore_eos=True),
    SamplingParams(max_new_tokens=7, min_new_tokens=3, stop_token_ids=[STOP],
                   logit_bias={str(STOP): 100.0}, ignore_eos=True),
    SamplingParams(max_new_tokens=7, ignore_eos=True)]


def fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def ref_keys(logits: np.ndarray, *, temp: float, seed: int, greedy: bool) -> np.ndarray:
    """The race keys of one row in float32: x = logit * (1 / T), plus -log(-log U) unless greedy."""
    x = logits.astype(np.float32) * (np.float32(1.0) / np.float32(temp))
    if greedy:
        return x
    offs = np.arange(len(logits), dtype=np.uint64)
    h = fmix32((offs * 0x9E3779B1 + 0x7F4A7C15) & M32)
    h = fmix32(h ^ np.uint64(seed))
    u = ((h >> 8).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)
    u = np.minimum(u, np.float32(1.0 - 2.0**-24))  # the largest hash rounds to U = 1
    return x - np.log(-np.log(np.maximum(u, np.float32(1e-20))))


def ref_removed(probs: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Tokens top-k / top-p / min-p remove from one row, by plain loops in float64: walk the
    tokens by descending probability (ties by id); a token goes when its rank is past top_k, the
    mass before it is past top_p, or it is below min_p times the top; the top always stays."""
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    removed = np.zeros(len(probs), dtype=bool)
    mass = 0.0
    for rank, t in enumerate(order):
        if rank > 0 and ((p.top_k != -1 and rank >= p.top_k) or mass > p.top_p
                         or probs[t] < p.min_p * probs[order[0]]):
            removed[t] = True
        mass += float(probs[t])
    return removed


def ref_token(logits: np.ndarray, p: SamplingParams, *, seed: int, suppressed: list[int]) -> int:
    """The token the fused sampler draws for one row: the race over the biased logits (stop ids
    at -inf) with the filtered-out tokens at -inf."""
    biased = logits.astype(np.float32).copy()
    for tok, bias in (p.logit_bias or {}).items():
        if int(tok) < len(biased):  # ids outside the vocabulary are ignored
            biased[int(tok)] += np.float32(bias)
    biased[suppressed] = -np.inf
    temp = effective_temperature(p.temperature)
    if p.needs_filter:
        z = biased.astype(np.float64) / temp
        probs = np.exp(z - z.max())
        biased[ref_removed(probs / probs.sum(), p)] = -np.inf
    keys = ref_keys(biased, temp=temp, seed=seed, greedy=p.greedy)
    return int(np.argmax(keys))


def decode_filtered(model_dir: Path, *, device: str, overlap: bool, steps: int,
                    cuda_graph: bool = False):
    """FILTERED_PARAMS' requests (seeds 40..43) through a paged scheduler, submitted together:
    ([(output ids, output logprobs)] per request, the scheduler's DecodeOverlap)."""
    from rltool.engine.paged_runner import PagedRunner
    from rltool.engine.paged_scheduler import PagedScheduler
    from rltool.engine.request import Request

    runner = PagedRunner(model_dir, device=device, dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256, disable_cuda_graph=not cuda_graph)
    sched = PagedScheduler(runner, max_running=4, overlap=overlap,
                           num_continuous_decode_steps=steps)
    reqs = [Request(rid=f"r{i}", prompt_ids=[5 + i, 9, 3, 12], params=p, return_logprob=True,
                    generator=make_generator(40 + i))
            for i, p in enumerate(FILTERED_PARAMS)]
    run_all(sched, reqs, wait=300)
    return [(r.output_ids, r.output_logprobs) for r in reqs], sched.batch.blocks
