"""The paged scheduler's prefix cache on CPU: a GRPO group shares its prompt's pages, greedy
outputs are the same with and without the cache, a weight update or /flush_cache empties it, and
KV computed under old weights is never reused."""

from __future__ import annotations

import pytest
import torch

from rltool.engine.paged import KVPool, PageTable
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.routes.openai_shapes import usage
from tests.helpers.scheduling import generate

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 11 tokens: two full pages of 4
NEW = 6
WHOLE = list(range(5, 17))  # 12 tokens: three full pages of 4
# The same prompt three times, a prefix of it ending inside its third page, one leaving it there.
PARTIAL_PROMPTS = [WHOLE] * 3 + [WHOLE[:10], WHOLE[:10] + [40, 41]]


def engine(model_dir, *, prefix_cache=True, device="cpu"):
    runner = PagedRunner(model_dir, device=device, dtype="fp32", max_running=8, page_size=4,
                         max_total_tokens=4096, prefix_cache=prefix_cache)
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=64, chunked_prefill_size=16)
    sched.start()
    return runner, sched


def cached_and_plain(model_dir, prompts, *, device="cpu"):
    """The prompts through an engine with the prefix cache and one without (stopped after);
    greedy outputs and logprobs agree. Returns both engines and the cached engine's requests."""
    runner, sched = engine(model_dir, device=device)
    plain_runner, plain = engine(model_dir, prefix_cache=False, device=device)
    try:
        cached = generate(sched, prompts, "c")
        ref = generate(plain, prompts, "p")
    finally:
        sched.stop()
        plain.stop()
    assert [r.cached_tokens for r in ref] == [0] * len(prompts)
    for a, b in zip(cached, ref):
        assert a.output_ids == b.output_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    return runner, sched, plain_runner, plain, cached


def test_group_shares_prompt_pages_and_matches_no_cache(tiny_model_dir):
    prompts = [PROMPT] * 4 + [PROMPT[:8] + [30, 31]]
    runner, sched, plain_runner, plain, cached = cached_and_plain(tiny_model_dir, prompts)
    assert [r.cached_tokens for r in cached] == [0, 8, 8, 8, 8]
    table = runner.table
    assert table.cache.num_pages == 2 and not table.entries  # the shared prefix, nothing locked
    assert table.free_pages == table.allocator.num_pages - 1  # every page free or evictable
    assert plain_runner.table.cache is None
    outs = [{"meta_info": {"prompt_tokens": len(r.prompt_ids), "completion_tokens": NEW,
                           "cached_tokens": r.cached_tokens}} for r in cached[:4]]
    assert usage(outs, 4)["prompt_tokens_details"] == {"cached_tokens": 24}


def test_groups_of_prompts_behind_a_shared_first_page_prefill_in_three_steps(tiny_model_dir):
    """Two GRPO groups on a cold cache, their prompts alike in the first page (a chat template)
    and ending inside a page: the first sample writes the shared page while the rest wait; then
    its group's other samples (their partial last page is theirs alone) and the other group's
    first sample go together, and the other group's samples follow. Outputs equal those without
    the cache."""
    prompts = [[5, 6, 7, 8, 20 + g, 21, 22, 23, 30 + g, 31] for g in range(2) for _ in range(4)]
    _, sched, _, _, cached = cached_and_plain(tiny_model_dir, prompts)
    assert [r.cached_tokens for r in cached] == [0, 8, 8, 8, 4, 8, 8, 8]
    assert sched.num_prefill_forwards == 3
    assert sched.num_prefill_tokens == 10 + 3 * 2 + 6 + 3 * 2


def test_weight_update_and_flush_empty_the_cache(tiny_model_dir, tiny_model_factory):
    new_dir = tiny_model_factory("qwen2", seed=1)
    runner, sched = engine(tiny_model_dir)
    _, fresh = engine(new_dir)
    try:
        generate(sched, [PROMPT], "a")
        assert generate(sched, [PROMPT], "b")[0].cached_tokens == 8
        sched.update_weights(lambda: runner.load_weights(new_dir), abort_all=False).result(30)
        assert runner.table.cache.num_pages == 0
        after = generate(sched, [PROMPT], "c")[0]
        want = generate(fresh, [PROMPT], "f")[0]
        assert after.cached_tokens == 0  # KV of the old weights is never reused
        assert after.output_ids == want.output_ids
        assert after.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)
        again = generate(sched, [PROMPT], "d")[0]  # cached under the new weights
        assert again.cached_tokens == 8
        assert again.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)
        sched.call(sched.flush_cache).result(10)
        assert runner.table.cache.num_pages == 0
        assert generate(sched, [PROMPT], "e")[0].cached_tokens == 0
    finally:
        sched.stop()
        fresh.stop()
    assert runner.table.free_pages == runner.table.allocator.num_pages - 1


def test_eviction_makes_room_for_new_prompts(tiny_model_dir):
    """A pool the cache fills must still serve new prompts: unreferenced leaves are evicted."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=2, page_size=4,
                         max_total_tokens=40)
    sched = PagedScheduler(runner, max_running=2, max_prefill_tokens=64, chunked_prefill_size=16)
    sched.start()
    try:
        for i in range(6):  # 6 distinct prompts x 2 cached pages each > 9 usable pages
            req = generate(sched, [[20 + i] + PROMPT[1:]], f"x{i}")[0]
            assert req.finish_reason["type"] == "length"
    finally:
        sched.stop()
    assert runner.table.cache.num_pages <= runner.table.allocator.num_pages - 1
    assert runner.table.free_pages == runner.table.allocator.num_pages - 1


def test_reuse_covers_every_cached_token_but_the_last(tiny_model_dir):
    """A prompt that ends or leaves the tree inside a cached page gets that page's first tokens
    by copy-on-write: the same prompt again computes its last token only, a prefix of a cached
    prompt and a prompt that diverges inside a page compute from where they leave it. Outputs
    and logprobs equal those of an engine without the cache; every page comes back."""
    prompts = PARTIAL_PROMPTS
    runner, sched, _, plain, cached = cached_and_plain(tiny_model_dir, prompts)
    assert [r.cached_tokens for r in cached] == [0, 11, 11, 9, 10]
    assert sched.num_prefill_tokens == 12 + 1 + 1 + 1 + 2
    assert plain.num_prefill_tokens == sum(len(p) for p in prompts)
    assert sched.num_prefill_forwards == 2  # the group's other samples in one step, together
    table = runner.table
    assert table.cache.num_pages == 4 and not table.entries  # 3 pages + the diverging third one
    assert table.free_pages == table.allocator.num_pages - 1  # copies freed with their requests


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_copy_on_write_copies_kv_and_needs_a_free_page(kv_cache_dtype):
    """The copied tokens carry their KV (and, in an FP8 pool, their scales)."""
    table = PageTable(num_pages=6, page_size=4, max_requests=4, max_pages_per_request=4,
                      device="cpu", prefix_cache=True)
    pool = KVPool(num_layers=2, num_pages=6, page_size=4, num_kv_heads=1, head_dim=2,
                  dtype=torch.float32, device="cpu", kv_cache_dtype=kv_cache_dtype)
    for t in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if t is not None:
            t.copy_(torch.randn(t.shape).to(t.dtype))
    tokens = list(range(12))
    table.add("a")
    table.extend("a", 12)
    table.cache_prefix("a", tokens)
    source = table.entries["a"].pages[2]
    table.remove("a")
    assert table.cache.num_pages == 3 and table.allocator.available == 2
    assert table.reuse_prefix("b", tokens, max_tokens=11, pool=pool) == 11
    own = table.entries["b"].pages[2]
    assert own != source and table.entries["b"].pages[:2] == [1, 2]
    for kv in (pool.k, pool.v, pool.k_scale, pool.v_scale):
        if kv is not None:
            assert torch.equal(kv[:, own * 4:own * 4 + 3].float(),
                               kv[:, source * 4:source * 4 + 3].float())
    # One page free, kept for a running request: no copy.
    assert table.reuse_prefix("c", tokens, max_tokens=11, pool=pool, spare=1) == 8
    table.remove("c")
    table.add("x")
    table.extend("x", 4)  # the last free page; the source page is the only unlocked one
    assert table.reuse_prefix("c", tokens, max_tokens=11, pool=pool) == 8  # no room for a copy
    assert table.cache.num_pages == 3
    table.flush_prefix_cache()  # the shared pages in use are freed with their requests
    assert table.cache.num_pages == 0 and table.allocator.available == 1
    table.clear()
    assert table.free_pages == table.allocator.num_pages - 1
