"""The host KV tier on a CUDA GPU: pages written back to pinned host memory on the copy stream and
reloaded come back bit-exact (a request served from them gives the tokens and logprobs of one
served from device pages), the copy and prefill times are measured with CUDA events, and a
weight update leaves no hit in either tier.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from tests.helpers.scheduling import generate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PS = 4
PROMPT = list(range(5, 17)) + [17]  # three full pages and one token


def tiered_engine(model_dir):
    runner = PagedRunner(model_dir, device="cuda", dtype="fp32", max_running=2, page_size=PS,
                         max_total_tokens=40, cuda_graph_max_bs=2, hicache=True,
                         hicache_ratio=4.0)
    sched = PagedScheduler(runner, max_running=2, max_prefill_tokens=64, chunked_prefill_size=16)
    sched.start()
    return runner, sched


def evict(sched, tag):
    """Distinct prompts enough to push every cached page of the 10-page pool to the host."""
    for i in range(5):
        generate(sched, [[40 + i] + PROMPT[1:12]], f"{tag}{i}")


def test_pinned_round_trip_is_bit_exact_and_timed_with_events(tiny_model_dir,
                                                              tiny_model_factory):
    runner, sched = tiered_engine(tiny_model_dir)
    try:
        assert runner.table.host._host[0].is_pinned()
        generate(sched, [PROMPT], "a")
        device_hit = generate(sched, [PROMPT], "b")[0]
        assert device_hit.cached_tokens == 12
        evict(sched, "e")
        before = runner.cache_stats()
        from_host = generate(sched, [PROMPT], "h")[0]
        torch.cuda.synchronize()
        stats = runner.cache_stats()
        assert from_host.cached_tokens == 12
        assert stats["host_hit_tokens"] - before["host_hit_tokens"] == 12
        assert from_host.output_ids == device_hit.output_ids
        assert from_host.output_logprobs == device_hit.output_logprobs
        assert stats["io_to_host_s"] > 0 and stats["io_to_device_s"] > 0
        assert stats["prefill_s"] > 0 and stats["prefill_forwards"] >= 8
        assert stats["requests"] == 8 and stats["ttft_p50_s"] <= stats["ttft_p99_s"]
        new_dir = tiny_model_factory("qwen2", seed=1)
        sched.update_weights(lambda: runner.load_weights(new_dir), abort_all=False).result(30)
        after = generate(sched, [PROMPT], "c")[0]
        assert after.cached_tokens == 0
        end = runner.cache_stats()
        assert end["host_hit_tokens"] == stats["host_hit_tokens"]
        assert end["device_hit_tokens"] == stats["device_hit_tokens"]
    finally:
        sched.stop()
