"""Batched /generate bodies: many single-turn samples in one HTTP request.

The default generate function sends one prompt per request; the collector sends the samples of
the groups that start together as one body instead, in SGLang's batch contract (`input_ids` a
list of prompts, one `sampling_params` entry and one `rid` per prompt; the answer is a list in
the same order). Every sample keeps its own sampling seed and request id, and the engine expands
the body into one request per prompt, so a seeded sample is the one a request of its own gives.

`pack` cuts a wave of groups into requests: consecutive groups while a request stays within
`--samples-per-request` samples and within an even share of the wave over the live engines (so
every engine gets a request to balance with). A group is never split: one larger than the limit
goes alone.
"""

from __future__ import annotations

import math
from typing import Any

# Engine-side bound: with --concurrency 32 bodies per engine this is at most 2,048 samples in
# flight per engine, within the builtin engine's default queue (--max-queued-requests 4096
# beyond the running ones), so a rollout's bodies are never refused as a full queue (429).
DEFAULT_SAMPLES_PER_REQUEST = 64


def pack(sizes: list[int], *, limit: int, engines: int = 1) -> list[list[int]]:
    """The indices of the groups (their sample counts `sizes`, in order) of each request."""
    share = math.ceil(sum(sizes) / max(engines, 1))
    cap = max(1, min(limit, share))
    requests: list[list[int]] = []
    held = 0
    for i, n in enumerate(sizes):
        if requests and requests[-1] and held + n <= cap:
            requests[-1].append(i)
            held += n
        else:
            requests.append([i])
            held = n
    return requests


def batch_body(items: list[dict[str, Any]], *, rids: list[str],
               fields: dict[str, Any]) -> dict[str, Any]:
    """One /generate body holding `items` (single-prompt bodies of the default generate function,
    rltool.rollout.generate.single_turn_request), with `fields` (the stage's extra fields) added."""
    return {**fields, "input_ids": [item["input_ids"] for item in items],
            "return_logprob": True,
            "sampling_params": [item["sampling_params"] for item in items], "rid": rids}
