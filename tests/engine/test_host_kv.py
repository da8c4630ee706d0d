"""The prefix cache's host tier (--enable-hierarchical-cache) on CPU: evicted pages move to host
memory and come back bit-exact, a weight update empties both tiers, abort and retraction leak no
page of either pool, and the tier is off unless asked for."""

from __future__ import annotations

import threading

import pytest
import torch
from click.testing import CliRunner

from rltool.cli import main
from rltool.engine.config import ServeConfig
from rltool.engine.host_kv import HostKV, host_pool_pages
from rltool.engine.paged import KVPool, PageTable
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams
from rltool.errors import BadInputError
from tests.helpers.scheduling import generate

pytestmark = pytest.mark.timeout(120)

PS = 4
PROMPT = list(range(5, 17))  # three full pages
NEW = 6


def check_accounting(table: PageTable) -> None:
    """Every device page is free, held by one cache node or owned by one request; every host
    page is free or held by one host node."""
    cache = table.cache
    nodes = cache._nodes()
    device = [n.page for n in nodes if n.page >= 0]
    host = [n.host for n in nodes if n.host >= 0]
    assert all(n.page < 0 or n.host < 0 for n in nodes)  # one tier at a time
    owned = [p for e in table.entries.values() for i, p in enumerate(e.pages)
             if i >= len(e.shared) or e.shared[i].page != p]
    held = device + owned + list(table.allocator._free)
    assert sorted(held) == list(range(1, table.allocator.num_pages))
    assert len(device) == cache.num_pages
    assert sorted(host + cache._host_free) == list(range(cache.host_pages))


def host_table(kv_cache_dtype="auto", *, num_pages=6, host_pages=8):
    table = PageTable(num_pages=num_pages, page_size=PS, max_requests=4, max_pages_per_request=8,
                      device="cpu", prefix_cache=True, host_pages=host_pages)
    pool = KVPool(num_layers=2, num_pages=num_pages, page_size=PS, num_kv_heads=2, head_dim=3,
                  dtype=torch.float32, device="cpu", kv_cache_dtype=kv_cache_dtype)
    for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if t is not None:
            t.copy_(torch.randn(t.shape).to(t.dtype))
    table.host = HostKV(pool, num_pages=host_pages, page_size=PS, stats=table.stats)
    return table, pool


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_evicted_pages_round_trip_through_the_host_tier_bit_exact(kv_cache_dtype):
    table, pool = host_table(kv_cache_dtype)
    table.add("a")
    table.extend("a", 12)
    table.cache_prefix("a", PROMPT)
    pages = list(table.entries["a"].pages)
    before = [[x.clone() for x in table.host.device_page(p)] for p in pages]
    table.remove("a")
    table.add("x")
    table.extend("x", 20)  # 5 pages: 2 free + the 3 cached ones, demoted to the host
    assert table.cache.num_pages == 0 and table.cache.host_used == 3
    for node in table.cache._nodes():
        i = PROMPT.index(node.key[0]) // PS
        assert all(torch.equal(h, b) for h, b in zip(table.host.page(node.host), before[i]))
    check_accounting(table)
    for t in (pool.k, pool.v):  # x overwrites the freed device pages
        t.zero_()
    table.remove("x")
    assert table.reuse_prefix("b", PROMPT, max_tokens=12, pool=pool) == 12
    assert table.stats.host_hit_tokens == 12 and table.stats.device_hit_tokens == 0
    for page, want in zip(table.entries["b"].pages, before):
        assert all(torch.equal(d, w) for d, w in zip(table.host.device_page(page), want))
    per_page = table.host.bytes_per_page
    assert table.stats.bytes_to_host == table.stats.bytes_to_device == 3 * per_page
    assert table.cache.host_used == 0 and table.cache.num_pages == 3
    check_accounting(table)
    table.remove("b")
    assert table.free_pages == table.allocator.num_pages - 1


def test_reload_in_any_page_order_lands_each_page_where_asked():
    """Copies are made in host-page order (runs of consecutive host pages); each pair must
    still land in its own device page, whatever order the caller lists them in."""
    table, pool = host_table(num_pages=6, host_pages=8)
    host = table.host
    pairs = [(5, 1), (3, 2), (4, 3), (6, 4)]  # host pages 3..6: one run once sorted
    host.to_host([(d, h) for h, d in pairs])
    want = {d: [x.clone() for x in host.device_page(d)] for _, d in pairs}
    for t in (pool.k, pool.v):
        t.zero_()
    moved = [(h, 5 - d) for h, d in pairs]  # each host page back into another device page
    host.to_device(moved)
    for (h, d_new), (_, d_old) in zip(moved, pairs):
        assert all(torch.equal(a, b) for a, b in zip(host.device_page(d_new), want[d_old]))
    assert table.stats.io_to_host_s > 0 and table.stats.io_to_device_s > 0


def test_full_host_pool_drops_its_least_recently_used_pages():
    table, pool = host_table(num_pages=6, host_pages=2)
    for i, rid in enumerate("ab"):
        tokens = [100 * (i + 1) + j for j in range(8)]
        table.add(rid)
        table.extend(rid, 8)
        table.cache_prefix(rid, tokens)
        table.remove(rid)
    table.add("x")
    table.extend("x", 20)  # 5 pages: a's two go to the host, then b's two replace them
    assert table.cache.host_used == 2 and table.cache.num_pages == 0
    assert table.reuse_prefix("a", [100 + j for j in range(8)], max_tokens=8, pool=pool) == 0
    check_accounting(table)
    table.remove("x")
    assert table.reuse_prefix("b", [200 + j for j in range(8)], max_tokens=8, pool=pool) == 8
    check_accounting(table)


def test_remove_and_clear_mid_reload_leak_no_page():
    """A request that took reloaded pages and is aborted (remove) or retracted (clear) leaves
    them cached on the device; a flush then frees both tiers."""
    table, pool = host_table()
    table.add("a")
    table.extend("a", 12)
    table.cache_prefix("a", PROMPT)
    table.remove("a")
    table.add("x")
    table.extend("x", 20)
    table.remove("x")
    # Two pages shared, the third reloaded for the copy of its first three tokens.
    assert table.reuse_prefix("b", PROMPT, max_tokens=11, pool=pool) == 11
    assert table.stats.host_hit_tokens == 11 and table.cache.num_pages == 3
    b = table.entries["b"]
    assert len(b.shared) == 2 and b.pages[2] not in [n.page for n in table.cache._nodes()]
    table.add("c")
    table.extend("c", 4)
    check_accounting(table)
    table.remove("b")  # abort
    check_accounting(table)
    table.reuse_prefix("d", PROMPT, max_tokens=12, pool=pool)
    table.clear()  # retract every request
    check_accounting(table)
    assert not table.entries and table.free_pages == table.allocator.num_pages - 1
    table.flush_prefix_cache()
    assert table.cache.num_pages == 0 and table.cache.host_used == 0
    assert table.allocator.available == table.allocator.num_pages - 1


def test_a_reload_that_writes_back_counts_the_write_back_once(monkeypatch):
    """book_s: a reload whose page allocation demotes other cached pages to make room adds the
    reload's own bookkeeping; the write-back's time is counted by the write-back alone. A fake
    clock that only a demotion advances (10 s each) makes the sums exact."""
    import time

    table, pool = host_table(num_pages=6, host_pages=8)
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    demote = table.cache.demote

    def slow_demote(n):
        now[0] += 10.0
        return demote(n)

    monkeypatch.setattr(table.cache, "demote", slow_demote)
    table.add("a")
    table.extend("a", 12)
    table.cache_prefix("a", PROMPT)
    table.remove("a")
    table.add("x")
    table.extend("x", 20)  # PROMPT's 3 pages demoted to the host
    table.remove("x")
    other = [100 + j for j in range(16)]
    table.add("c")
    table.extend("c", 16)
    table.cache_prefix("c", other)  # 4 device pages cached, 1 free
    table.remove("c")
    assert table.stats.book_s == 10.0
    assert table.reuse_prefix("b", PROMPT, max_tokens=12, pool=pool) == 12
    assert table.cache.host_used == 2  # the reload's 3 pages took 1 free and 2 of c's
    assert table.stats.book_s == 20.0
    check_accounting(table)


def engine(model_dir, *, hicache=True, prefix_cache=True, max_total_tokens=40):
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=2, page_size=PS,
                         max_total_tokens=max_total_tokens, prefix_cache=prefix_cache,
                         hicache=hicache, hicache_ratio=4.0)
    sched = PagedScheduler(runner, max_running=2, max_prefill_tokens=64, chunked_prefill_size=16)
    sched.start()
    return runner, sched


def evict(sched, tag):
    """Distinct prompts enough to push every cached page of the 9-page pool out."""
    for i in range(5):
        generate(sched, [[40 + i] + PROMPT[1:]], f"{tag}{i}")


def test_request_served_from_host_pages_matches_a_fresh_prefill(tiny_model_dir):
    """Three full pages and one token: the whole cached prefix comes from the host tier."""
    prompt = PROMPT + [17]
    runner, sched = engine(tiny_model_dir)
    plain_runner, plain = engine(tiny_model_dir, hicache=False, prefix_cache=False)
    try:
        first = generate(sched, [prompt], "a")[0]
        device_hit = generate(sched, [prompt], "b")[0]
        assert device_hit.cached_tokens == 12
        evict(sched, "e")
        assert sched.call(lambda: runner.table.cache.match(prompt)).result(10) == []
        assert sched.call(lambda: runner.cached_prefix_length(prompt)).result(10) == 12
        host_hits = runner.cache_stats()["host_hit_tokens"]
        from_host = generate(sched, [prompt], "h")[0]
        want = generate(plain, [prompt], "p")[0]
    finally:
        sched.stop()
        plain.stop()
    stats = runner.cache_stats()
    assert from_host.cached_tokens == 12 and stats["host_hit_tokens"] - host_hits == 12
    assert stats["bytes_to_host"] > 0 and stats["bytes_to_device"] > 0 and stats["io_s"] > 0
    # The same KV as the device hit's, bit for bit, and the fresh prefill's tokens.
    assert from_host.output_ids == device_hit.output_ids == want.output_ids == first.output_ids
    assert from_host.output_logprobs == device_hit.output_logprobs
    assert from_host.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)
    check_accounting(runner.table)
    assert runner.table.free_pages == runner.table.allocator.num_pages - 1


def test_stats_count_requests_prefill_and_reloads(tiny_model_dir):
    """The `hicache` counters of a run: one finished request each, their prompt tokens, the
    tokens actually prefilled (prompts less what either tier served), a reload per request that
    got host pages, and the time to first token's percentiles over them."""
    runner, sched = engine(tiny_model_dir)
    try:
        reqs = generate(sched, [PROMPT], "a")
        for i in range(5):
            reqs += generate(sched, [[40 + i] + PROMPT[1:]], f"e{i}")
        reqs += generate(sched, [PROMPT + [17]], "h")
    finally:
        sched.stop()
    s = runner.cache_stats()
    assert reqs[-1].cached_tokens == 12 and s["host_hit_tokens"] >= 12 and s["reloads"] >= 1
    assert s["requests"] == len(reqs)
    assert s["prompt_tokens"] == sum(len(r.prompt_ids) for r in reqs)
    assert s["prefill_tokens"] == sum(len(r.prompt_ids) - r.cached_tokens for r in reqs)
    assert s["prefill_s"] > 0 and s["prefill_s_per_token"] == s["prefill_s"] / s["prefill_tokens"]
    sizes = [len(r.prompt_ids) - r.cached_tokens for r in reqs]  # one at a time, chunks of 16
    assert s["prefill_forwards"] == sum(-(-n // 16) for n in sizes)
    chunks = [min(16, n - i) for n in sizes for i in range(0, n, 16)]
    assert s["prefill_tokens_sq"] == sum(c * c for c in chunks)
    assert 0 < s["prefill_token_s"] <= max(chunks) * s["prefill_s"]
    ttfts = sorted(r.t_first_token - r.t_arrival for r in reqs)
    assert s["ttft_p50_s"] == ttfts[len(ttfts) // 2 - 1 + len(ttfts) % 2]
    assert s["ttft_p99_s"] == ttfts[-1]
    assert s["ttft_mean_s"] == pytest.approx(sum(ttfts) / len(ttfts))
    assert s["io_s"] == s["io_to_host_s"] + s["io_to_device_s"] and s["book_s"] > 0


def test_weight_update_and_release_empty_both_tiers(tiny_model_dir, tiny_model_factory):
    new_dir = tiny_model_factory("qwen2", seed=1)
    runner, sched = engine(tiny_model_dir)
    try:
        generate(sched, [PROMPT], "a")
        evict(sched, "e")
        assert runner.table.cache.host_used > 0
        sched.update_weights(lambda: runner.load_weights(new_dir), abort_all=False).result(30)
        assert runner.table.cache.host_used == 0 and runner.table.cache.num_pages == 0
        before = runner.cache_stats()
        after = generate(sched, [PROMPT], "c")[0]
        assert after.cached_tokens == 0  # no hit in either tier on KV of the old weights
        stats = runner.cache_stats()
        assert stats["host_hit_tokens"] == before["host_hit_tokens"]
        assert stats["device_hit_tokens"] == before["device_hit_tokens"]
        evict(sched, "f")
        assert runner.table.cache.host_used > 0
        sched.call(sched.retract_for_release).result(10)
        sched.call(runner.release).result(10)
        assert runner.cache_stats()["host_pages_used"] == 0
        sched.call(runner.resume).result(30)
        assert generate(sched, [PROMPT], "r")[0].cached_tokens == 0
    finally:
        sched.stop()


def test_retraction_and_abort_under_a_full_pool_leak_no_page(tiny_model_dir):
    """Two long requests in a 10-page pool retract each other while host pages are in play; an
    abort lands mid-generation. Every device and host page is accounted for afterwards."""
    runner, sched = engine(tiny_model_dir)
    try:
        generate(sched, [PROMPT], "a")
        evict(sched, "e")
        reqs = generate(sched, [PROMPT + [1, 2], PROMPT + [3]], "r", new=14)
        assert all(r.finish_reason["type"] == "length" for r in reqs)
        assert sched.num_retractions > 0
        assert runner.cache_stats()["host_hit_tokens"] > 0
        done = threading.Event()
        req = Request(rid="z", prompt_ids=PROMPT, on_finish=lambda r: done.set(),
                      params=SamplingParams(max_new_tokens=36 - len(PROMPT), temperature=0.0,
                                            ignore_eos=True))  # the whole pool: more is refused
        sched.submit([req])
        for _ in range(2000):  # abort once it is decoding, its pages in use
            if req.output_ids:
                break
            threading.Event().wait(0.005)
        assert req.output_ids
        sched.abort(rid="z")
        assert done.wait(30)
    finally:
        sched.stop()
    check_accounting(runner.table)
    assert not runner.table.entries
    assert runner.table.free_pages == runner.table.allocator.num_pages - 1


def test_host_tier_is_off_by_default_and_bad_sizes_are_refused(tiny_model_dir, monkeypatch):
    cfg = ServeConfig(model=tiny_model_dir, device="cpu")
    assert not cfg.enable_hierarchical_cache
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=2, page_size=PS,
                         max_total_tokens=40)
    assert runner.table.host is None and runner.table.cache.host_pages == 0
    monkeypatch.setattr("rltool.engine.server.serve", lambda cfg: pytest.fail("served"))
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_model_dir), "--device", "cpu",
                                       "--enable-hierarchical-cache", "--disable-radix-cache"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "drop --disable-radix-cache" in lines[0]
    with pytest.raises(BadInputError, match="--hicache-ratio or --hicache-size"):
        host_pool_pages(device_pages=4, bytes_per_page=1000, ratio=0.1, size_gb=0)
    assert host_pool_pages(device_pages=4, bytes_per_page=1000, ratio=2, size_gb=0) == 8
    assert host_pool_pages(device_pages=4, bytes_per_page=1000, ratio=2, size_gb=1e-5) == 10
    with pytest.raises(BadInputError, match="lower --hicache-ratio or --hicache-size"):
        host_pool_pages(device_pages=4, bytes_per_page=1000, ratio=2, size_gb=0,
                        available_bytes=7999)
    with pytest.raises(BadInputError, match="GB available"):
        PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=2, page_size=PS,
                    max_total_tokens=40, hicache=True, hicache_size_gb=1e9)
