"""The collection core without servers: groups, statuses, rewards off the event loop, reward
timeouts, DAPO dynamic filtering with over-sampling counts, and partial-rollout carry-over."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from rltool.rollout.collect import Collector
from rltool.rollout.generate import Sample, generate_single_turn, parse_engine_output
from rltool.rollout.rewards import RewardResult
from rltool.rollout.router import Router
from tests.helpers.rollout_fakes import FakeEngine, FakeTokenizer

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_response_len": 8, "seed": 3,
            "n_samples_per_prompt": 4}


def groups_source(num: int, n: int, *, start: int = 0):
    for g in range(start, start + num):
        yield [Sample(uid=f"g{g}-{i}", prompt_id=f"p{g}", group_id=g, sample_index=i,
                      prompt=f"prompt {g}", prompt_token_ids=[1, 3, g % 20 + 5], label=str(g))
               for i in range(n)]


def collect(engines, source, *, reward_fn, generate_fn=generate_single_turn, reward_timeout_s=5.0,
            reward_workers=2, **kwargs):
    async def main():
        router = Router({e.url: e for e in engines}, concurrency=4)
        collector = Collector(router=router, tokenizer=FakeTokenizer(), generate_fn=generate_fn,
                              sampling=SAMPLING, reward_fn=reward_fn,
                              reward_timeout_s=reward_timeout_s, reward_workers=reward_workers)
        return await collector.run(source, **kwargs)

    return asyncio.run(main())


# A reward that never answers is held on an event until its collection has returned; this only
# bounds a hang. REWARD_TIMEOUT_S is the collector's timeout in the timeout tests: what a prompt
# reward call (microseconds of work) must stay within, generous for a loaded machine.
HANG_BOUND_S = 60.0
REWARD_TIMEOUT_S = 2.0


def length_reward(prompt, response, label, metadata):
    return RewardResult(reward=float(len(response)), components={"len": float(len(response))})


def test_groups_statuses_and_per_token_fields():
    engine = FakeEngine("http://a")
    result = collect([engine], groups_source(3, 4), reward_fn=length_reward, target_groups=3)
    assert [g[0].group_id for g in result.kept] == [0, 1, 2]
    for group in result.kept:
        assert [s.sample_index for s in group] == [0, 1, 2, 3]
        for s in group:
            n = len(s.response_token_ids)
            assert s.status in ("completed", "truncated")
            assert (s.status == "truncated") == (n == SAMPLING["max_response_len"]
                                                 and s.response_token_ids[-1] != 2)
            assert len(s.rollout_logprobs) == len(s.loss_mask) == len(s.weight_versions) == n
            assert s.loss_mask == [1] * n and s.weight_versions == [0] * n
            assert s.reward == float(len(s.response)) and s.rewards == {"len": s.reward}
    assert result.output_tokens == sum(len(s.response_token_ids) for g in result.kept for s in g)


def test_rewards_run_in_worker_threads_and_timeouts_fail_clearly():
    """Reward calls run in the collector's worker threads, concurrently (a slow reward does not
    serialise the others), and a call that does not return fails its sample with a
    reward_timeout while the other samples keep their reward. Checked without timing anything:
    every call of the first collection waits at a barrier that opens only once all four calls
    are in flight at once (serialised calls break it: reward_error, and the test fails); in the
    second, label "1"'s calls block until the collection has returned, so they can only end by
    the reward timeout."""
    threads = set()
    barrier = threading.Barrier(4, timeout=HANG_BOUND_S)

    def meeting_reward(prompt, response, label, metadata):
        threads.add(threading.current_thread().name)
        barrier.wait()  # all 4 samples' calls in flight together, or BrokenBarrierError
        return RewardResult(reward=1.0)

    result = collect([FakeEngine("http://a")], groups_source(2, 2), reward_fn=meeting_reward,
                     reward_timeout_s=HANG_BOUND_S, reward_workers=4, target_groups=2)
    assert threads and all(name.startswith("rltool-reward") for name in threads)
    assert [(s.status != "failed", s.reward) for g in result.kept for s in g] == [(True, 1.0)] * 4
    assert result.counts["failed_rewards"] == 0

    release = threading.Event()

    def stuck_reward(prompt, response, label, metadata):
        if label == "1":
            release.wait(HANG_BOUND_S)  # set only once the collection returned
        return RewardResult(reward=1.0)

    try:
        result = collect([FakeEngine("http://a")], groups_source(2, 2), reward_fn=stuck_reward,
                         reward_timeout_s=REWARD_TIMEOUT_S, reward_workers=4, target_groups=2)
        assert not release.is_set()
    finally:
        release.set()
    by_group = {g[0].group_id: g for g in result.kept}
    assert all(s.status != "failed" and s.reward == 1.0 for s in by_group[0])
    for s in by_group[1]:
        assert s.status == "failed" and s.reward == 0.0
        assert s.finish_reason.startswith("reward_timeout")


def test_inline_rewards_run_on_the_event_loop_and_their_errors_still_fail_the_sample():
    threads = set()

    class CheapReward:
        inline = True

        def __call__(self, prompt, response, label, metadata):
            threads.add(threading.current_thread().name)
            if label == "1":
                raise ValueError("bad label")
            return RewardResult(reward=2.0)

    result = collect([FakeEngine("http://a")], groups_source(2, 2), reward_fn=CheapReward(),
                     target_groups=2)
    assert threads == {threading.main_thread().name}
    by_group = {g[0].group_id: g for g in result.kept}
    assert all(s.reward == 2.0 for s in by_group[0])
    assert all(s.status == "failed" and s.finish_reason.startswith("reward_error: ValueError")
               for s in by_group[1])
    assert (result.counts["reward_calls"], result.counts["failed_rewards"]) == (4, 2)


def test_generate_fn_exception_marks_sample_failed_not_lost():
    async def broken(sample, ctx):
        if sample.sample_index == 1:
            raise RuntimeError("tool crashed")
        return await generate_single_turn(sample, ctx)

    result = collect([FakeEngine("http://a")], groups_source(2, 3), reward_fn=length_reward,
                     generate_fn=broken, target_groups=2)
    rows = [s for g in result.kept for s in g]
    assert len(rows) == 6
    failed = [s for s in rows if s.status == "failed"]
    assert [s.sample_index for s in failed] == [1, 1]
    assert all("RuntimeError: tool crashed" in s.finish_reason for s in failed)


def test_dynamic_filter_drops_equal_groups_and_over_samples():
    def reward(prompt, response, label, metadata):
        # Odd groups: every sample gets 1.0 (no signal); even groups: rewards differ.
        if int(label) % 2:
            return RewardResult(reward=1.0)
        return RewardResult(reward=float(len(response) % 3))

    engine = FakeEngine("http://a")
    engine.eos_prob = 0.3
    result = collect([engine], groups_source(40, 4), reward_fn=reward, target_groups=4,
                     dynamic_filter=True)
    assert len(result.kept) == 4
    for g in result.kept:
        assert len({s.reward for s in g}) > 1
    c = result.counts
    assert c["dropped_equal_reward"] >= 3  # odd groups among the started ones were dropped
    assert c["fresh_groups"] == (len(result.kept) + c["dropped_equal_reward"]
                                 + c["over_sampled_groups"] + c["aborted_extra_groups"])
    assert c["fresh_groups"] < 40


def test_filter_budget_exhausted_returns_fewer_groups():
    result = collect([FakeEngine("http://a")], groups_source(6, 2),
                     reward_fn=lambda *a: RewardResult(reward=0.0), target_groups=4,
                     dynamic_filter=True)
    assert result.kept == [] and result.counts["dropped_equal_reward"] == 6


def distinct_rewards():
    """A reward that never repeats a value: no group is ever all-equal (a hash of the random
    response could collide, drop a group the held ones would then wait for, and hang)."""
    counter = itertools.count()

    def reward(prompt, response, label, metadata):
        return RewardResult(reward=float(next(counter)))

    return reward


class HoldingEngine(FakeEngine):
    """Groups 0 and 1 generate at once; the requests of later groups generate HELD_TOKENS tokens
    and then hold until they are aborted (or cancelled by the client): extra groups are
    mid-generation when the batch fills, by construction rather than by staggered sleeps."""

    HELD_TOKENS = 3

    def __init__(self, url: str):
        super().__init__(url)
        self.eos_prob = 0.0
        self.holding = 0  # requests holding now
        self._aborts: asyncio.Event | None = None

    async def _one(self, payload: dict, routing_key: str | None) -> dict:
        group = payload["input_ids"][2] - 5  # groups_source's prompts: [1, 3, g % 20 + 5]
        if group < 2:
            return await super()._one(payload, routing_key)
        self.requests.append(payload)
        self._aborts = self._aborts or asyncio.Event()
        ids = [10 + group + i for i in range(self.HELD_TOKENS)]
        self.holding += 1
        try:
            while payload.get("rid") not in self.aborted:
                await self._aborts.wait()
        finally:
            self.holding -= 1
        meta = {"id": payload.get("rid"), "weight_version": self.version,
                "finish_reason": {"type": "abort", "message": "aborted", "status_code": None,
                                  "err_type": None},
                "prompt_tokens": len(payload["input_ids"]), "completion_tokens": len(ids),
                "output_token_logprobs": [[-0.5, t, None] for t in ids]}
        return {"text": "".join(chr(97 + t % 26) for t in ids), "output_ids": ids,
                "meta_info": meta}

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        await super().abort_request(rid=rid, abort_all=abort_all)
        if self._aborts is not None:
            self._aborts.set()


def test_over_sampled_groups_are_aborted_and_carried_with_their_tokens():
    engine = HoldingEngine("http://a")
    sampling_len = SAMPLING["max_response_len"]

    varying = distinct_rewards()

    result = collect([engine], groups_source(6, 2), reward_fn=varying, target_groups=2,
                     dynamic_filter=True, over_sample_factor=3.0, partial=True)
    assert [g[0].group_id for g in result.kept] == [0, 1] and engine.holding == 0
    # every in-flight extra group is carried over, not lost, with the tokens it had
    assert sorted(g[0].group_id for g in result.carry) == [2, 3, 4, 5]
    aborted = [s for g in result.carry for s in g]
    assert all(s.status == "aborted" for s in aborted) and len(engine.aborted) == len(aborted)
    for s in aborted:
        assert len(s.response_token_ids) == HoldingEngine.HELD_TOKENS < sampling_len
        assert len(s.rollout_logprobs) == len(s.response_token_ids)
    assert result.counts["carried_out_groups"] == len(result.carry)

    # A later call resumes the aborted samples from their tokens.
    before = {s.uid: list(s.response_token_ids) for s in aborted}
    engine2 = FakeEngine("http://b", version="1")
    engine2.eos_prob = 0.0
    scored: list[str] = []

    def on_the_whole_text(prompt, response, label, metadata):
        scored.append(response)
        return varying(prompt, response, label, metadata)

    again = collect([engine2], iter(()), reward_fn=on_the_whole_text,
                    target_groups=len(result.carry), carried=result.carry)
    resumed = {s.uid: s for g in again.kept for s in g}
    # a continuation draws with its own seed, not the first request's again
    first_seeds = {r["sampling_params"]["sampling_seed"] for r in engine.requests}
    assert not first_seeds & {r["sampling_params"]["sampling_seed"] for r in engine2.requests}
    for uid, prefix in before.items():
        s = resumed[uid]
        # its text, and the text its reward saw, are those of every token, not of the prefix
        assert s.response == FakeTokenizer().decode(s.response_token_ids) and s.response in scored
        assert s.response_token_ids[:len(prefix)] == prefix
        assert s.status == "truncated" and len(s.response_token_ids) == sampling_len
        assert s.weight_versions[:len(prefix)] == [0] * len(prefix)
        assert s.weight_versions[len(prefix):] == [1] * (sampling_len - len(prefix))
    assert again.counts["carried_in_groups"] == len(result.carry)


def test_version_spans_become_per_token_versions():
    response = {"output_ids": [5, 6, 7, 8], "meta_info": {
        "finish_reason": {"type": "length", "length": 4}, "weight_version": "4",
        "weight_versions": [{"version": "3", "start": 0, "end": 2},
                            {"version": "4", "start": 2, "end": 4}],
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None],
                                  [-0.4, 8, None]]}}
    ids, logprobs, versions, finish = parse_engine_output(response)
    assert ids == [5, 6, 7, 8] and versions == [3, 3, 4, 4] and finish == "length"
    assert logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    response["meta_info"].pop("weight_versions")
    response["meta_info"]["weight_version"] = "default"
    assert parse_engine_output(response)[2] == [0, 0, 0, 0]


def test_without_partial_extra_groups_are_cancelled_not_aborted_on_the_engine():
    engine = HoldingEngine("http://a")

    varying = distinct_rewards()

    result = collect([engine], groups_source(6, 2), reward_fn=varying, target_groups=2,
                     dynamic_filter=True, over_sample_factor=3.0)
    assert [g[0].group_id for g in result.kept] == [0, 1] and result.carry == []
    assert engine.holding == 0  # the held requests were cancelled, none left behind
    assert not engine.aborted  # no /abort_request: the extras were dropped client-side
    c = result.counts
    assert c["aborted_extra_groups"] >= 1
    assert c["fresh_groups"] == 2 + c["aborted_extra_groups"] + c["over_sampled_groups"]


def test_raising_reward_marks_failed_and_is_counted():
    """Bug (reward rule): reward failures were marked on the samples but not counted, so the
    stage could not tell a broken reward function from bad answers. The collector now counts
    every reward call and every failed one (raised or timed out) and keeps the first reason.
    Label "2"'s calls never answer (held until the collection returned): they time out."""
    release = threading.Event()

    def flaky(prompt, response, label, metadata):
        if label == "1":
            raise RuntimeError("reward crashed")
        if label == "2":
            release.wait(HANG_BOUND_S)
        return RewardResult(reward=1.0)

    try:
        result = collect([FakeEngine("http://a")], groups_source(3, 2), reward_fn=flaky,
                         reward_timeout_s=REWARD_TIMEOUT_S, reward_workers=6, target_groups=3)
    finally:
        release.set()
    by_group = {g[0].group_id: g for g in result.kept}
    assert all(s.status != "failed" and s.reward == 1.0 for s in by_group[0])
    assert all(s.status == "failed" and s.reward == 0.0 for s in by_group[1] + by_group[2])
    assert all(s.finish_reason == "reward_error: RuntimeError: reward crashed"
               for s in by_group[1])
    assert all(s.finish_reason.startswith("reward_timeout") for s in by_group[2])
    assert result.counts["reward_calls"] == 6 and result.counts["failed_rewards"] == 4
    assert result.first_reward_failure.startswith(("reward_error", "reward_timeout"))


def test_remote_reward_failures_follow_the_same_rule():
    """A remote reward model that answers an error or does not answer within the timeout marks
    the sample failed (reward 0.0) and is counted, exactly like a raising function. The server
    holds label "2"'s answers until the collection returned: they can only time out."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rltool.rollout.rewards import resolve_reward

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            label = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["label"]
            if label == "2":
                release.wait(HANG_BOUND_S)
            status, body = (500, b'{"error": "down"}') if label == "1" else (200, b'{"reward": 1}')
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on the slow answer

        def log_message(self, *args):
            pass

    release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        reward_fn = resolve_reward(f"http://127.0.0.1:{server.server_address[1]}/",
                                   timeout_s=REWARD_TIMEOUT_S)
        result = collect([FakeEngine("http://a")], groups_source(3, 2), reward_fn=reward_fn,
                         reward_timeout_s=REWARD_TIMEOUT_S, reward_workers=6, target_groups=3)
        reward_fn.close()
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    by_group = {g[0].group_id: g for g in result.kept}
    assert all(s.status != "failed" and s.reward == 1.0 for s in by_group[0])
    assert all(s.status == "failed" and s.reward == 0.0 for s in by_group[1] + by_group[2])
    assert all("HTTP 500" in s.finish_reason for s in by_group[1])
    assert all(s.finish_reason.startswith(("reward_timeout", "reward_error: EngineTimeoutError"))
               for s in by_group[2])
    assert result.counts["reward_calls"] == 6 and result.counts["failed_rewards"] == 4


def test_groups_started_together_go_to_the_engine_as_one_batch():
    """`run_groups` (the async rollout stream's wave of admitted groups): the groups in one
    batched /generate, each group back whole, in order and numbered; a member already finished
    is kept as it is and not sent."""
    engine = FakeEngine("http://a")
    groups = list(groups_source(4, 3))
    done = groups[3][0]
    done.status, done.finish_reason = "completed", "stop"

    async def main():
        router = Router({engine.url: engine}, concurrency=4)
        collector = Collector(router=router, tokenizer=FakeTokenizer(),
                              generate_fn=generate_single_turn, sampling=SAMPLING,
                              reward_fn=length_reward, reward_timeout_s=5.0, reward_workers=1)
        async with collector.streaming():
            return await collector.run_groups(groups)

    out = asyncio.run(main())
    assert engine.bodies == [11]  # 3 fresh groups and the 2 unfinished members of the 4th
    assert [[s.uid for s in g] for g in out] == [[f"g{k}-{i}" for i in range(3)] for k in range(4)]
    assert all([s.sample_index for s in g] == [0, 1, 2] for g in out)
    assert all(s.status in ("completed", "truncated") for g in out for s in g)
    assert out[3][0] is done and done.response_token_ids == []


def test_a_step_starts_no_fresh_copy_of_a_carried_group():
    """Step 0 over-sampled positions 2-3 (step 1's range) and carried position 2: step 1 starts
    every other position of its budget fresh, never a second group 2."""
    from rltool.rollout.stage import fresh_positions

    carried = [list(next(groups_source(1, 2, start=2)))]
    assert fresh_positions(step=1, batch=2, budget=8, carried=carried) == [3, 4, 5, 6, 7, 8, 9]
    assert fresh_positions(step=1, batch=2, budget=2, carried=[]) == [2, 3]


def test_a_carried_sample_whose_reward_was_cut_off_is_scored(monkeypatch):
    """--partial: the batch fills while extra groups are still in a slow reward call, and the
    abort grace runs out: their tasks are cancelled, but a sample that had finished generating
    is scored before it is carried (a carried finished sample keeps its reward)."""
    from rltool.rollout import collect as collect_module

    monkeypatch.setattr(collect_module, "ABORT_GRACE_S", 0.2)
    fast = distinct_rewards()  # groups 0 and 1 are never all-equal: they fill the batch
    first_calls: set[str] = set()
    never = threading.Event()

    def reward(prompt, response, label, metadata):
        group = int(prompt.split()[1])
        if group < 2:
            return fast(prompt, response, label, metadata)
        if (prompt, response) not in first_calls:  # the first call outlasts the grace
            first_calls.add((prompt, response))
            never.wait(5.0)
        return RewardResult(reward=float(len(response)) + 0.001 * group)

    engine = FakeEngine("http://a")
    engine.eos_prob = 0.3
    result = collect([engine], groups_source(4, 2), reward_fn=reward, target_groups=2,
                     dynamic_filter=True, over_sample_factor=2.0, partial=True,
                     reward_workers=8, reward_timeout_s=30)
    never.set()
    assert [g[0].group_id for g in result.kept] == [0, 1]
    carried = [s for g in result.carry for s in g]
    assert sorted({s.group_id for s in carried}) == [2, 3]
    assert all(s.status in ("completed", "truncated") for s in carried)
    for s in carried:
        assert s.reward == float(len(s.response)) + 0.001 * s.group_id
    assert result.counts["reward_calls"] == 4 * 2  # a cut-off call is not counted
