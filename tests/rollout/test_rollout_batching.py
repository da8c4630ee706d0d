"""Batched /generate bodies without servers: how groups are packed into requests, how many
requests an engine receives for G groups x n samples, that a seeded batch gives the samples
separate requests give, and the error paths (a refused body, a short answer, a malformed item,
a dead engine, aborted groups resumed)."""

from __future__ import annotations

import asyncio

import pytest

from rltool.errors import EngineError
from rltool.rollout.batching import pack
from rltool.rollout.collect import Collector
from rltool.rollout.generate import derive_seed, generate_single_turn, to_row
from rltool.rollout.rewards import RewardResult
from rltool.rollout.router import Router
from tests.helpers.rollout_fakes import FakeEngine, FakeTokenizer
from tests.rollout.test_rollout_collect import HoldingEngine, distinct_rewards, groups_source

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_response_len": 6, "seed": 11,
            "n_samples_per_prompt": 4}


def length_reward(prompt, response, label, metadata):
    return RewardResult(reward=float(len(response)))


async def per_sample(sample, ctx):
    """The default function behind another name: the collector sends it one request per sample."""
    return await generate_single_turn(sample, ctx)


class SeededEngine(FakeEngine):
    """Output drawn from the prompt and the request's sampling_seed only (not its rid), as a
    seeded engine's: the same sample whether it came alone or inside a batch."""

    async def _one(self, payload: dict, routing_key: str | None) -> dict:
        seeded = {**payload, "rid": payload["sampling_params"]["sampling_seed"]}
        return await super()._one(seeded, routing_key)


def collect(engines, source, *, generate_fn=generate_single_turn, via_gateway=False,
            samples_per_request=64, reward_fn=length_reward, **kwargs):
    async def main():
        router = Router({e.url: e for e in engines}, concurrency=4, via_gateway=via_gateway)
        collector = Collector(router=router, tokenizer=FakeTokenizer(), generate_fn=generate_fn,
                              sampling=SAMPLING, reward_fn=reward_fn, reward_timeout_s=5.0,
                              reward_workers=1, samples_per_request=samples_per_request)
        return await collector.run(source, **kwargs)

    return asyncio.run(main())


@pytest.mark.parametrize("sizes,limit,engines,expected", [
    ([4] * 10, 16, 1, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),
    ([4] * 10, 64, 2, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),  # an even share per engine
    ([1] * 5, 64, 1, [[0, 1, 2, 3, 4]]),
    ([3, 10, 3], 4, 1, [[0], [1], [2]]),  # a group larger than the limit goes alone, whole
    ([2, 2, 2], 1, 1, [[0], [1], [2]]),  # limit 1: one body per group
    ([], 64, 1, []),
])
def test_pack_keeps_groups_whole_within_the_limit_and_the_engine_share(sizes, limit, engines,
                                                                        expected):
    assert pack(sizes, limit=limit, engines=engines) == expected


@pytest.mark.parametrize("groups,n,limit,bodies", [
    (10, 4, 16, [16, 16, 8]),
    (10, 1, 64, [10]),  # groups of one share a body too
    (10, 4, 4, [4] * 10),  # --samples-per-request n: one body per group
])
def test_requests_per_rollout_drop_as_designed(groups, n, limit, bodies):
    engine = FakeEngine("http://a")
    result = collect([engine], groups_source(groups, n), target_groups=groups,
                     samples_per_request=limit)
    assert engine.bodies == bodies
    assert len(engine.requests) == groups * n  # every sample generated once
    assert [g[0].group_id for g in result.kept] == list(range(groups))
    assert all([s.sample_index for s in g] == list(range(n)) for g in result.kept)


def test_two_engines_get_one_body_each():
    a, b = FakeEngine("http://a"), FakeEngine("http://b")
    result = collect([a, b], groups_source(8, 4), target_groups=8)
    assert a.bodies == [16] and b.bodies == [16]
    urls = {s.engine_urls[0] for g in result.kept for s in g}
    assert urls == {"http://a", "http://b"}


def test_per_sample_requests_where_bodies_cannot_be_batched():
    """A custom generate function and a gateway (smg takes one sampling_params object per body)
    send one request per sample; the dynamic filter one body per group."""
    engine = FakeEngine("http://a")
    collect([engine], groups_source(3, 4), target_groups=3, generate_fn=per_sample)
    assert engine.bodies == [1] * 12
    gateway = FakeEngine("http://gw")
    collect([gateway], groups_source(3, 4), target_groups=3, via_gateway=True)
    assert gateway.bodies == [1] * 12
    filtered = FakeEngine("http://f")
    collect([filtered], groups_source(3, 4), target_groups=3, dynamic_filter=True)
    assert filtered.bodies == [4] * 3


def test_seeded_batch_gives_the_samples_of_separate_requests():
    batched, alone = SeededEngine("http://a"), SeededEngine("http://a")
    one = collect([batched], groups_source(6, 4), target_groups=6)
    other = collect([alone], groups_source(6, 4), target_groups=6, generate_fn=per_sample)
    assert batched.bodies == [24] and alone.bodies == [1] * 24
    rows = [to_row(s) for g in one.kept for s in g]
    assert rows == [to_row(s) for g in other.kept for s in g]
    assert len({tuple(r["response_token_ids"]) for r in rows}) > 1  # seeds differ per sample
    assert one.output_tokens == other.output_tokens


class ShortAnswer(FakeEngine):
    """Answers a batch with one output too few."""

    async def generate(self, payload: dict, *, routing_key: str | None = None):
        return (await super().generate(payload, routing_key=routing_key))[:-1]


class RefusingEngine(FakeEngine):
    async def generate(self, payload: dict, *, routing_key: str | None = None):
        self.bodies.append(len(payload["input_ids"]))
        raise EngineError("POST http://r/generate answered 400: bad sampling_params")

    async def health(self) -> bool:
        return True


class OneMalformed(FakeEngine):
    """The second output of every batch lacks its logprobs."""

    async def generate(self, payload: dict, *, routing_key: str | None = None):
        out = await super().generate(payload, routing_key=routing_key)
        out[1] = {**out[1], "meta_info": {k: v for k, v in out[1]["meta_info"].items()
                                          if k != "output_token_logprobs"}}
        out[1]["output_ids"] = out[1]["output_ids"] or [7]
        return out


def test_a_refused_or_short_batch_fails_its_samples_and_a_malformed_item_only_its_own():
    for engine, message in ((RefusingEngine("http://r"), "answered 400: bad sampling_params"),
                            (ShortAnswer("http://s"), "returned 7 outputs for a batch of 8")):
        result = collect([engine], groups_source(2, 4), target_groups=2)
        samples = [s for g in result.kept for s in g]
        assert len(engine.bodies) == 1 and len(samples) == 8
        assert all(s.status == "failed" and s.reward == 0.0 for s in samples)
        assert all(s.finish_reason.startswith("engine_error: ") and message in s.finish_reason
                   for s in samples)
    engine = OneMalformed("http://m")
    samples = [s for g in collect([engine], groups_source(2, 4), target_groups=2).kept for s in g]
    failed = [s.uid for s in samples if s.status == "failed"]
    assert failed == ["g0-1"] and "logprobs" in samples[1].finish_reason


class OneTooLong(FakeEngine):
    """Refuses with 400 every body that holds sample g1-2, as the engine refuses a body one of
    whose prompts does not fit its context."""

    bad_seed = derive_seed(SAMPLING["seed"], "g1-2", 0)

    async def generate(self, payload: dict, *, routing_key: str | None = None):
        params = payload["sampling_params"]
        seeds = [p["sampling_seed"] for p in (params if isinstance(params, list) else [params])]
        if self.bad_seed in seeds:
            self.bodies.append(len(seeds))
            raise EngineError("POST http://l/generate answered 400: the prompt is too long",
                              status_code=400)
        return await super().generate(payload, routing_key=routing_key)

    async def health(self) -> bool:
        return True


def test_a_body_refused_as_bad_input_fails_only_the_samples_at_fault():
    """A 400 for a body is sent again one sample per request: only the sample the engine
    refuses fails, as it would without batching."""
    engine = OneTooLong("http://l")
    samples = [s for g in collect([engine], groups_source(2, 4), target_groups=2).kept for s in g]
    assert [s.uid for s in samples if s.status == "failed"] == ["g1-2"]
    assert "too long" in samples[6].finish_reason
    assert all(s.status in ("completed", "truncated") and s.engine_urls == ["http://l"]
               for s in samples if s.uid != "g1-2")
    assert engine.bodies[0] == 8 and sorted(engine.bodies[1:]) == [1] * 8


def test_a_dead_engines_body_is_redispatched_whole():
    a, b = FakeEngine("http://a"), FakeEngine("http://b")
    a.dead = True
    result = collect([a, b], groups_source(4, 2), target_groups=4)
    samples = [s for g in result.kept for s in g]
    assert all(s.status in ("completed", "truncated") for s in samples)
    assert {s.engine_urls[0] for s in samples} == {"http://b"}
    assert sum(b.bodies) == 8


def test_aborted_groups_resume_in_one_body_from_their_tokens():
    engine = HoldingEngine("http://a")
    result = collect([engine], groups_source(6, 2), target_groups=2, dynamic_filter=True,
                     over_sample_factor=3.0, partial=True, reward_fn=distinct_rewards())
    assert engine.bodies == [2] * 6  # the filter's groups: one body each
    aborted = {s.uid: list(s.response_token_ids) for g in result.carry for s in g}
    assert len(aborted) == 8 and all(len(t) == HoldingEngine.HELD_TOKENS
                                     for t in aborted.values())
    again_engine = FakeEngine("http://b")
    again_engine.eos_prob = 0.0
    again = collect([again_engine], iter(()), target_groups=4, carried=result.carry)
    assert again_engine.bodies == [8]
    for g in again.kept:
        for s in g:
            assert s.response_token_ids[:HoldingEngine.HELD_TOKENS] == aborted[s.uid]
            assert len(s.response_token_ids) == SAMPLING["max_response_len"]
    sent = [r["sampling_params"]["max_new_tokens"] for r in again_engine.requests]
    assert sent == [SAMPLING["max_response_len"] - HoldingEngine.HELD_TOKENS] * 8
