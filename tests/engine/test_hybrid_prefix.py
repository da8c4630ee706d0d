"""The prefix cache of a hybrid linear-attention model (rltool.engine.hybrid_prefix): prompts that
reuse a recurrent-state snapshot give the tokens and logprobs of a fresh prefill (a runner
without the cache, the same seeds); a GRPO group computes its prompt about once; a second turn
reuses the first turn's snapshot; snapshots leave with their nodes (KV eviction), give their
slots to requests under slot pressure (used ones first), and are dropped by a weight update and
a flush; no slot is lost to retraction or abort. CPU, fp32, the tiny qwen3_5 (3 GDN layers, 1 attention layer)."""

from __future__ import annotations

import threading

import pytest

from rltool.engine.hybrid_prefix import HybridPageTable, snapshot_point
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.radix_cache import RadixCache
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams, make_generator
from rltool.errors import BadInputError, EngineError
from tests.helpers.hybrid import make_hybrid
from tests.helpers.scheduling import submit_and_wait

PS = 4  # page size


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_hybrid(tmp_path_factory.mktemp("hybrid_prefix") / "m", task=None)


def runner_of(model_dir, **kw):
    args = dict(device="cpu", dtype="fp32", max_running=8, page_size=PS, max_total_tokens=1024,
                prefix_cache=True)
    return PagedRunner(model_dir, **(args | kw))


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i * i + 3 * i) % 53 + 2 for i in range(n)]  # vocab: 60


def sampled(rid: str, prompt: list[int], *, seed: int, n: int = 6) -> Request:
    return Request(rid=rid, prompt_ids=list(prompt), return_logprob=True,
                   generator=make_generator(seed),
                   params=SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True))


def serve(runner: PagedRunner, waves: list[list[Request]], **kw) -> PagedScheduler:
    """Run each wave of requests to the end, one wave after the other."""
    sched = PagedScheduler(runner, max_running=runner.kv.max_running, **kw)
    sched.start()
    try:
        for wave in waves:
            submit_and_wait(sched, wave)
    finally:
        sched.stop()
    return sched


def accounted(runner: PagedRunner) -> int:
    """Slots free + held by requests + snapshots of nodes + snapshots waiting for their page,
    which must be all of them."""
    states, table = runner.states, runner.table
    return (states.available + len(states.held) + len(table.cache.snapshots)
            + len(table.pending))


def assert_idle(runner: PagedRunner) -> None:
    states = runner.states
    assert not states.held and not runner.table.pending
    assert accounted(runner) == states.num_slots
    assert len(runner.table.cache.snapshots) == states.num_snapshots


def test_snapshot_points():
    assert [snapshot_point(n, 4) for n in (0, 1, 3, 4, 5, 8, 11, 12)] == [0, 0, 0, 3, 4, 7, 8, 11]


@pytest.mark.parametrize("length", [11, 12, 23])
def test_reuse_gives_the_tokens_and_logprobs_of_a_fresh_prefill(hybrid_dir, length):
    """A prompt ending inside a page (11: snapshot at the page end, 8) or on a page end (12: at
    11, inside the last page, whose head is copied); 23 under a 4-token prefill chunk that the
    snapshot point (20) splits again. The second wave's requests start from the snapshot and
    sample with the seeds of the reference run (no prefix cache)."""
    prompt = prompt_of(length, seed=length)
    chunk = {"chunked_prefill_size": 4, "max_prefill_tokens": 8} if length == 23 else {}
    waves = [[sampled("a", prompt, seed=1)], [sampled(f"b{i}", prompt, seed=10 + i)
                                              for i in range(3)]]
    runner = runner_of(hybrid_dir)
    serve(runner, waves, **chunk)
    ref_runner = runner_of(hybrid_dir, prefix_cache=False)
    refs = [[sampled(r.rid, prompt, seed=s)] for r, s in zip(waves[0] + waves[1], (1, 10, 11, 12))]
    serve(ref_runner, refs, **chunk)
    point = snapshot_point(length, PS)
    assert waves[0][0].cached_tokens == 0
    assert [r.cached_tokens for r in waves[1]] == [point] * 3
    for req, (ref,) in zip(waves[0] + waves[1], refs):
        assert req.output_ids == ref.output_ids, req.rid
        assert req.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-5), req.rid
    assert_idle(runner)
    assert runner.states.num_snapshots == 1


def test_a_grpo_group_computes_its_prompt_about_once(hybrid_dir):
    """Two groups of 8 samples submitted at once: 128 tokens (a snapshot one token before the
    end) and 130 (at the end of the last full page, 128): the other samples compute 1 and 2
    prompt tokens each, within 1.15x of the unique prompt tokens; every slot comes back."""
    prompts = [prompt_of(128, seed=1), prompt_of(130, seed=2)]
    group = [sampled(f"g{p}-{i}", prompt, seed=100 * p + i, n=4)
             for p, prompt in enumerate(prompts) for i in range(8)]
    runner = runner_of(hybrid_dir, max_running=16, max_total_tokens=2048)
    sched = serve(runner, [group], max_prefill_tokens=1024)
    unique = sum(len(p) for p in prompts)
    assert sched.num_prefill_tokens == unique + 7 * 1 + 7 * 2
    assert sched.num_prefill_tokens <= 1.15 * unique
    assert sorted(r.cached_tokens for r in group) == [0, 0] + [127] * 7 + [128] * 7
    assert runner.tier_stats.device_hit_tokens == 7 * 127 + 7 * 128
    assert_idle(runner)


def test_unused_snapshots_outlast_used_ones_when_slots_run_out(hybrid_dir):
    """4 groups of 4 samples on 16 slots: the first samples and their snapshots take 8, so the
    last siblings to start find no free slot. They take the slots of snapshots their own group's
    samples already started from, never one a group still waits for (the last group's, the least
    recently used)."""
    prompts = [prompt_of(13, seed=20 + p) for p in range(4)]
    groups = [sampled(f"u{p}-{i}", prompt, seed=i, n=3) for p, prompt in enumerate(prompts)
              for i in range(4)]
    runner = runner_of(hybrid_dir, max_running=16)
    sched = serve(runner, [groups])
    assert sorted(r.cached_tokens for r in groups) == [0] * 4 + [12] * 12
    assert sched.num_prefill_tokens == 4 * 13 + 12 * 1
    assert_idle(runner)


def test_a_second_turn_reuses_the_first_turns_snapshot(hybrid_dir):
    """Turn 2's prompt is turn 1's prompt, its response and a new message: it starts from the
    snapshot turn 1 took (19 of its 20 tokens) and samples what a fresh prefill does."""
    first = prompt_of(20, seed=5)
    turn1 = sampled("t1", first, seed=3)
    runner = runner_of(hybrid_dir)
    sched = PagedScheduler(runner, max_running=8)
    sched.start()
    try:
        submit_and_wait(sched, [turn1])
        second = first + turn1.output_ids + [9, 8, 7, 6, 5]
        turn2 = sampled("t2", second, seed=4)
        submit_and_wait(sched, [turn2])
    finally:
        sched.stop()
    assert turn2.cached_tokens == snapshot_point(20, PS) == 19
    ref = sampled("r2", second, seed=4)
    serve(runner_of(hybrid_dir, prefix_cache=False), [[ref]])
    assert turn2.output_ids == ref.output_ids
    assert turn2.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-5)
    assert_idle(runner)


def test_a_reuse_refused_a_row_keeps_no_page(hybrid_dir, monkeypatch):
    """A reuse that copies the head of the snapshot's page (a 12-token prompt: snapshot at 11)
    whose request gets no page-table row leaves the free pages as they were (the copy's page was
    taken before the row and lost)."""
    runner = runner_of(hybrid_dir)
    prompt = prompt_of(12, seed=12)
    serve(runner, [[sampled("a", prompt, seed=1)]])
    table = runner.table
    free = table.allocator.available

    def no_row(rid: str) -> None:
        raise EngineError("no free page-table row; more requests than --max-running-requests")

    monkeypatch.setattr(table, "add", no_row)
    with pytest.raises(EngineError, match="no free page-table row"):
        table.reuse_prefix("b", prompt, max_tokens=11, pool=runner.pool)
    assert table.allocator.available == free
    runner.remove("b")  # as the scheduler does with a request whose step failed
    monkeypatch.undo()
    assert table.reuse_prefix("b", prompt, max_tokens=11, pool=runner.pool) == 11
    assert table.allocator.available == free - 1  # its copy of the last page's head
    runner.remove("b")
    assert table.allocator.available == free
    assert_idle(runner)


def test_a_node_keeps_its_first_snapshot(hybrid_dir):
    """A request that computes a cached prompt's first 8 tokens again (the runner driven by
    hand, every slot taken) takes no second snapshot for the node that holds one: the other
    prompt's snapshot, the least recently used, is not given up for it."""
    runner = runner_of(hybrid_dir, max_running=3)
    other, prompt = prompt_of(11, seed=6), prompt_of(11, seed=4)
    serve(runner, [[sampled("b", other, seed=1)], [sampled("a", prompt, seed=1)]])
    cache = runner.table.cache
    mine, theirs = cache.match(prompt)[1], cache.match(other)[1]
    assert runner.states.num_snapshots == 2 and mine.state >= 0 and theirs.state >= 0
    assert runner.claim_state("x") and runner.states.available == 0
    runner.prefill([("x", prompt[:8], 0)], want=[False])
    runner.cache_prefix("x", prompt[:8])
    runner.table.snapshot("x")
    assert theirs.state >= 0 and mine.state >= 0 and runner.states.num_snapshots == 2
    runner.remove("x")
    assert_idle(runner)


def test_snapshots_leave_with_their_nodes_and_yield_slots_to_requests(hybrid_dir):
    """A 64-token KV pool: each new prompt evicts older cached pages, whose snapshots go back to
    the pool; with 2 slots, a request that finds none free takes a snapshot's."""
    runner = runner_of(hybrid_dir, max_running=2, max_total_tokens=64)
    waves = [[sampled(f"p{i}", prompt_of(21, seed=i), seed=i, n=3)] for i in range(4)]
    sched = PagedScheduler(runner, max_running=2)
    sched.start()
    seen = []
    try:
        for wave in waves:
            submit_and_wait(sched, wave)
            seen.append(sched.call(lambda: (runner.states.num_snapshots,
                                            accounted(runner))).result(30))
        # two at once: both slots go to requests, the snapshots give theirs up
        pair = [sampled(f"q{i}", prompt_of(13, seed=50 + i), seed=i, n=3) for i in range(2)]
        submit_and_wait(sched, pair)
    finally:
        sched.stop()
    assert all(total == 2 for _, total in seen)
    assert max(n for n, _ in seen) >= 1
    cache = runner.table.cache
    assert cache.num_pages * PS <= 64
    live = {id(n) for n in cache._nodes()}
    assert all(id(node) in live for node in cache.snapshots.values())
    assert_idle(runner)


def test_retraction_and_abort_free_every_slot(hybrid_dir):
    """A 40-token KV pool with 3 requests decoding retracts some (their pending snapshots and
    slots freed, recomputed from their cached prefix later); then an abort mid-decode."""
    runner = runner_of(hybrid_dir, max_running=3, max_total_tokens=40)
    prompt = prompt_of(12, seed=9)
    reqs = [sampled(f"r{i}", prompt, seed=i, n=8) for i in range(3)]
    sched = serve(runner, [reqs])
    assert sched.num_retractions > 0
    assert_idle(runner)
    ref_runner = runner_of(hybrid_dir, prefix_cache=False)
    refs = [[sampled(r.rid, prompt, seed=i, n=8)] for i, r in enumerate(reqs)]
    serve(ref_runner, refs)
    for req, (ref,) in zip(reqs, refs):
        assert req.output_ids == ref.output_ids
    runner = runner_of(hybrid_dir, max_running=3)
    sched = PagedScheduler(runner, max_running=3)
    sched.start()
    try:
        long = [sampled(f"l{i}", prompt, seed=i, n=300) for i in range(3)]

        def abort():
            while not all(r.output_ids for r in long):
                threading.Event().wait(0.01)
            sched.call(lambda: sched.abort(abort_all=True)).result(30)
        submit_and_wait(sched, long, while_running=abort)
        assert all(r.finish_reason["type"] == "abort" for r in long)
        sched.call(lambda: assert_idle(runner)).result(30)
    finally:
        sched.stop()


def test_a_weight_update_and_a_flush_drop_every_snapshot(hybrid_dir):
    runner = runner_of(hybrid_dir)
    prompt = prompt_of(14, seed=3)
    sched = PagedScheduler(runner, max_running=8)
    sched.start()
    try:
        first = [sampled("w0", prompt, seed=1)]
        submit_and_wait(sched, first)
        assert sched.call(lambda: runner.states.num_snapshots).result(30) == 1
        sched.update_weights(lambda: runner.load_weights(hybrid_dir), abort_all=False).result(60)
        assert sched.call(lambda: runner.states.num_snapshots).result(30) == 0
        again = [sampled("w1", prompt, seed=1)]
        submit_and_wait(sched, again)
        assert again[0].cached_tokens == 0 and again[0].output_ids == first[0].output_ids
        sched.call(sched.flush_cache).result(30)
        assert sched.call(lambda: runner.states.num_snapshots).result(30) == 0
        third = [sampled("w2", prompt, seed=1)]
        submit_and_wait(sched, third)
        assert third[0].cached_tokens == 0
    finally:
        sched.stop()
    assert_idle(runner)


def test_the_host_tier_is_refused_for_a_hybrid(hybrid_dir):
    with pytest.raises(BadInputError, match="drop --enable-hierarchical-cache"):
        runner_of(hybrid_dir, hicache=True)
    assert isinstance(runner_of(hybrid_dir).table, HybridPageTable)


def test_the_tree_gives_up_the_snapshots_of_nodes_that_leave():
    """Evicted and cleared nodes hand their slots back through drain_states; a node holds one
    snapshot; a used one is offered before an unused one, the least recently used first."""
    cache = RadixCache(page_size=2)
    path_a, _ = cache.insert([1, 2, 3, 4], [10, 11])
    path_b, _ = cache.insert([5, 6], [12])
    assert cache.attach_state(path_a[1], 7, 1) and not cache.attach_state(path_a[1], 8, 2)
    assert cache.attach_state(path_b[0], 9, 2)
    cache.match([1, 2, 3, 4])  # touches a's nodes: b's snapshot is the older
    assert cache.oldest_state() is path_b[0]
    path_a[1].state_used = True  # a request started from a's: it goes before unused ones
    assert cache.oldest_state() is path_a[1]
    path_a[1].state_used = False
    assert sorted(cache.evict(1)) == [12] and cache.drain_states() == [9]
    assert cache.drain_states() == []
    cache.clear()
    assert cache.drain_states() == [7] and cache.snapshots == {}


def test_the_http_engine_serves_a_hybrid_with_the_prefix_cache(hybrid_dir):
    """`rltool serve`'s config with its defaults (prefix cache on): the same prompt twice over
    /generate, the second reusing the first's snapshot (meta_info's cached_tokens) with the same
    greedy tokens; /flush_cache drops the snapshot."""
    from rltool.engine.config import ServeConfig
    from tests.helpers.engines import serve_app

    prompt = prompt_of(40, seed=8)
    cfg = ServeConfig(model=hybrid_dir, device="cpu", max_running_requests=4)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0,
                                                     "ignore_eos": True}}
    with serve_app(cfg) as (client, runner):
        first = client.post("/generate", json=body).json()
        second = client.post("/generate", json=body).json()
        assert first["meta_info"]["cached_tokens"] == 0
        point = snapshot_point(40, runner.page_size)
        assert point > 0 and second["meta_info"]["cached_tokens"] == point
        assert second["output_ids"] == first["output_ids"]
        assert client.post("/flush_cache").status_code == 200
        assert runner.states.num_snapshots == 0
    assert not runner.states.held
