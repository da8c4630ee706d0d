"""Workload pieces several benchmarks share: random token samples, the trainer's micro-batches
over them, and one transformers `generate` call as the engines' baseline."""

from __future__ import annotations

import random
import time
from typing import Any

from benchmarks import harness


def make_samples(vocab: int, *, num: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """`num` samples of random token ids (4..vocab-1, clear of the special ids), each of a length
    drawn uniformly from `lengths` (inclusive), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def micro_batches(samples: list[list[int]], *, cap: int, response_starts: list[int]) -> list:
    """The DP schedule's micro-batches of at most `cap` tokens over `samples` on one rank;
    sample i's response starts at `response_starts[i]`."""
    from rltool.train.backend import MicroBatch
    from rltool.train.dp_schedule import schedule

    plan = schedule([len(s) for s in samples], dp_size=1, max_tokens_per_microbatch=cap)[0]
    return [MicroBatch(indices=list(mb), tokens=[samples[i] for i in mb],
                       response_starts=[response_starts[i] for i in mb]) for mb in plan]


def hf_generate(model: Any, prompts: list[list[int]], *, max_new_tokens: int, pad_token_id: int,
                **generate_kwargs: Any) -> tuple[list[list[int]], float]:
    """One left-padded `model.generate` over `prompts` on the model's device: the generated ids
    of each row (padding included) and the seconds it took (between device syncs)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts],
                       device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)
    harness.sync(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_token_id, **generate_kwargs)
    harness.sync(model.device)
    return out[:, width:].tolist(), time.perf_counter() - start
