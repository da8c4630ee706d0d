"""Workload-aware serving settings from a profile's requests: concurrency per engine and the
chunked-prefill size, each naming the measurement it rests on.

Concurrency = min(KV pool tokens / mean live sequence length, the saturation concurrency). The
saturation concurrency comes from the trace itself: each request's concurrency is the mean
number of requests of its engine in flight during its life; requests are grouped by that number
rounded to a power of two (a sweep's usual levels; finer groups hold a handful of requests from
the ramp-up and tail of a batch and are mostly noise), a group's throughput is k x its mean tokens
per second per request, and the saturation concurrency is the smallest k beyond which no group
gains more than 5% throughput.
"""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import mean
from typing import Any

from rltool.profile.events import spans
from rltool.profile.models import Model

GAIN = 0.05  # more concurrency must buy more than this much throughput


def _mean_overlap(req: dict[str, Any], peers: list[dict[str, Any]]) -> float:
    start, end = req["ts"], req["ts"] + req["dur"]
    if end <= start:
        return 1.0
    covered = sum(max(0.0, min(end, p["ts"] + p["dur"]) - max(start, p["ts"])) for p in peers)
    return covered / (end - start)  # includes the request itself


def throughput_by_concurrency(events: list[dict[str, Any]]) -> dict[int, float]:
    """{k: tokens/s of one engine with k requests in flight}, averaged over engines."""
    by_engine: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in spans(events, cat="request"):
        by_engine[str(e.get("args", {}).get("engine"))].append(e)
    rates: dict[int, list[float]] = defaultdict(list)
    for reqs in by_engine.values():
        for r in reqs:
            tokens = r.get("args", {}).get("completion_tokens", 0)
            if r["dur"] > 0 and tokens:
                k = 2 ** max(0, round(math.log2(max(_mean_overlap(r, reqs), 1.0))))
                rates[k].append(tokens / (r["dur"] * 1e-6))
    return {k: k * mean(v) for k, v in sorted(rates.items())}


def saturation_concurrency(curve: dict[int, float]) -> int | None:
    if not curve:
        return None
    return min(k for k, v in curve.items()
               if all(w <= (1 + GAIN) * v for j, w in curve.items() if j > k))


def recommend(events: list[dict[str, Any]], *, kv_pool_tokens: int) -> dict[str, Any]:
    reqs = spans(events, cat="request")
    args = [r.get("args", {}) for r in reqs]
    lengths = [a.get("prompt_tokens", 0) + a.get("completion_tokens", 0) for a in args]
    prompts = sorted(a.get("prompt_tokens", 0) for a in args)
    mean_len = mean(lengths) if lengths else 0.0
    curve = throughput_by_concurrency(events)
    saturation = saturation_concurrency(curve)
    by_memory = int(kv_pool_tokens // mean_len) if mean_len else 0
    concurrency = min(c for c in (by_memory, saturation) if c) if (by_memory or saturation) else 1
    p90 = prompts[min(len(prompts) - 1, int(0.9 * len(prompts)))] if prompts else 0
    chunk = 2 ** math.ceil(math.log2(max(p90, 64)))
    cached = sum(a.get("cached_tokens", 0) for a in args)
    return Model("recommendations", {
        "requests": len(reqs), "mean_sequence_tokens": mean_len, "kv_pool_tokens": kv_pool_tokens,
        "p90_prompt_tokens": p90, "prefix_hit_rate": cached / max(sum(prompts), 1),
        "throughput_by_concurrency": {str(k): v for k, v in curve.items()}}, [
        {"setting": "concurrency per engine", "value": concurrency,
         "because": f"min(KV pool {kv_pool_tokens} tokens / mean sequence {mean_len:.0f} = "
                    f"{by_memory}, throughput saturates at {saturation} in flight)"},
        {"setting": "chunked prefill size", "value": chunk,
         "because": f"p90 prompt length {p90} tokens, rounded up to a power of two: 90% of "
                    "prompts prefill in one chunk"}],
        ["the saturation point is measured only over the concurrencies the profiled run "
         "reached; profile a run with more requests in flight to see beyond it"])
