"""Router policy without servers: least-outstanding balancing, per-engine concurrency bound,
consistent hashing of session keys, and re-dispatch away from a dead engine."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rltool.errors import EngineError
from rltool.rollout.router import Router
from tests.helpers.rollout_fakes import FakeEngine


def payload(i: int, n: int = 4) -> dict:
    return {"input_ids": [1, 5, i % 30 + 3], "rid": uuid.uuid4().hex,
            "sampling_params": {"max_new_tokens": n}, "return_logprob": True}


def test_least_outstanding_prefers_idle_engine_and_bounds_concurrency():
    slow, fast = FakeEngine("http://slow", delay_s=0.02), FakeEngine("http://fast", delay_s=0.001)
    for e in (slow, fast):
        e.eos_prob = 0.0

    async def main():
        router = Router({"http://slow": slow, "http://fast": fast}, concurrency=3)
        await asyncio.gather(*(router.generate(payload(i, n=6)) for i in range(40)))
        return router

    router = asyncio.run(main())
    assert slow.max_in_flight <= 3 and fast.max_in_flight <= 3
    # The fast engine frees its slots sooner, so least-outstanding sends it more work.
    assert len(fast.requests) > len(slow.requests) > 0
    assert len(fast.requests) + len(slow.requests) == 40
    assert router.stats()["redispatched"] == 0


def test_consistent_hashing_is_sticky_and_moves_only_dead_engines_keys():
    engines = {f"http://e{i}": FakeEngine(f"http://e{i}") for i in range(3)}
    keys = [f"session-{i}" for i in range(60)]

    async def place(router):
        out = {}
        for k in keys:
            _, url = await router.generate(payload(1, n=1), routing_key=k)
            out[k] = url
        return out

    async def main():
        router = Router(engines, concurrency=4)
        first = await place(router)
        again = await place(router)
        engines["http://e1"].dead = True
        after = await place(router)
        return first, again, after

    first, again, after = asyncio.run(main())
    assert first == again
    assert len(set(first.values())) == 3  # 60 keys spread over all three engines
    for k in keys:
        if first[k] != "http://e1":
            assert after[k] == first[k], "a key on a live engine moved"
        else:
            assert after[k] != "http://e1"


def test_engine_dying_mid_request_is_redispatched():
    a, b = FakeEngine("http://a", delay_s=0.01), FakeEngine("http://b", delay_s=0.01)
    a.eos_prob = b.eos_prob = 0.0

    async def main():
        router = Router({"http://a": a, "http://b": b}, concurrency=8)
        tasks = [asyncio.create_task(router.generate(payload(i, n=10))) for i in range(8)]
        await asyncio.sleep(0.03)
        a.dead = True
        results = await asyncio.gather(*tasks)
        return router, results

    router, results = asyncio.run(main())
    assert all(url == "http://b" for _, url in results)
    assert all(len(r["output_ids"]) == 10 for r, _ in results)
    stats = router.stats()
    assert stats["engines"]["http://a"]["alive"] is False
    assert stats["redispatched"] >= 1


def test_all_engines_dead_raises_engine_error():
    a = FakeEngine("http://a")
    a.dead = True

    async def main():
        router = Router({"http://a": a}, concurrency=1)
        await router.generate(payload(0))

    with pytest.raises(EngineError, match="no live engine"):
        asyncio.run(main())


def test_request_error_on_healthy_engine_is_not_redispatched():
    class Rejecting(FakeEngine):
        async def generate(self, payload, *, routing_key=None):
            self.requests.append(payload)
            raise EngineError("400 prompt too long")

    a, b = Rejecting("http://a"), Rejecting("http://b")

    async def main():
        router = Router({"http://a": a, "http://b": b}, concurrency=1)
        await router.generate(payload(0))

    with pytest.raises(EngineError, match="too long"):
        asyncio.run(main())
    assert len(a.requests) + len(b.requests) == 1


def test_cancelled_waiters_leak_no_slot_and_backlog_drains():
    a = FakeEngine("http://a", delay_s=0.005)
    a.eos_prob = 0.0

    async def main():
        router = Router({"http://a": a}, concurrency=2)
        tasks = [asyncio.create_task(router.generate(payload(i, n=3), routing_key=(
            f"k{i}" if i % 2 else None))) for i in range(40)]
        await asyncio.sleep(0.02)
        for t in tasks[10:30]:  # cancel queued (and maybe running) requests
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return router, results

    router, results = asyncio.run(main())
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(done) >= 20
    assert router.engines[0].active == 0 and not router.engines[0].waiting and not router._waiting
    assert a.max_in_flight <= 2
