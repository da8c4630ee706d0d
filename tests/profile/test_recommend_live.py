"""The concurrency recommendation on the builtin CPU engine: traced requests at 4 concurrencies
give a profile; the concurrency it recommends is the sweep's best or, measured again back to back
with that one, reaches within 10% of its throughput."""

from __future__ import annotations

import asyncio
import time

from rltool import trace
from rltool.profile.events import read_events
from rltool.profile.recommend import recommend
from rltool.rollout.client import EngineClient

SWEEP = (2, 4, 8, 16)
REQUESTS = 32
NEW_TOKENS = 24


def run_at(url: str, concurrency: int) -> float:
    """Completion tokens per second with `concurrency` requests in flight."""
    async def main() -> float:
        client = EngineClient(url, timeout_s=120.0)
        queue = list(range(REQUESTS))
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            while queue:
                i = queue.pop()
                out = await client.generate({"input_ids": [5 + i % 7, 6, 7, 8, 9, 10],
                                             "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                                 "temperature": 1.0,
                                                                 "ignore_eos": True}})
                tokens += out["meta_info"]["completion_tokens"]

        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        finally:
            await client.aclose()
        return tokens / (time.perf_counter() - t0)

    return asyncio.run(main())


def test_recommended_concurrency_is_within_10_percent_of_the_sweeps_best(builtin_engine,
                                                                         tmp_path):
    run_at(builtin_engine.url, 2)  # warm up
    trace.configure(tmp_path, role="sweep")
    try:
        sweep = {c: run_at(builtin_engine.url, c) for c in SWEEP}
    finally:
        trace.configure(None, role="sweep")
    result = recommend(read_events(tmp_path), kv_pool_tokens=100_000)
    recommended = result["rows"][0]["value"]
    assert set(result["inputs"]["throughput_by_concurrency"]) >= {"2", "16"}
    best = max(sweep, key=sweep.__getitem__)
    if recommended != best:
        # The load of a shared CPU drifts between the sweep and a later measurement: measure
        # the two concurrencies again, back to back, and compare those.
        mine, theirs = run_at(builtin_engine.url, recommended), run_at(builtin_engine.url, best)
        assert mine >= 0.9 * theirs, (recommended, mine, best, theirs, sweep, result)
