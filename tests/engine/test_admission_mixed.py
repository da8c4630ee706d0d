"""Mixed chunked prefill on CPU in fp32 (--enable-mixed-chunk): requests arriving while others
decode are prefilled in the same forward as the running requests' decode rows, and every seeded
request gets the tokens it gets with separate prefill and decode forwards."""

from __future__ import annotations

import pytest
import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams, make_generator
from rltool.errors import BadInputError

WAVES = [[[5, 6, 7, 8, 9], [10, 11]], [list(range(3, 30)), [12, 13, 14]], [[9] * 7]]


def _run(model_dir, *, mixed: bool) -> tuple[list[Request], dict]:
    """Three waves of seeded requests, each submitted two steps after the last; a chunk size
    smaller than the long prompt spreads it over steps with decode rows beside it."""
    runner = PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=8, page_size=4,
                         max_total_tokens=2048)
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=16, chunked_prefill_size=8,
                           enable_mixed_chunk=mixed)
    reqs: list[Request] = []
    for w, prompts in enumerate(WAVES):
        wave = [Request(rid=f"w{w}r{i}", prompt_ids=p, return_logprob=True,
                        generator=make_generator(10 * w + i),
                        params=SamplingParams(max_new_tokens=8, temperature=0.9,
                                              ignore_eos=True))
                for i, p in enumerate(prompts)]
        reqs += wave
        sched.queue.submit(wave)
        sched.queue.wait_for_work(sched.batch.can_step)
        for _ in range(2):
            sched.batch.step()
    for _ in range(100):
        if all(r.finished for r in reqs):
            return reqs, sched.stats()
        sched.batch.step()
    raise AssertionError("requests did not finish in 100 steps")


def test_mixed_batches_give_the_tokens_of_separate_forwards(tiny_model_dir):
    separate, sep_stats = _run(tiny_model_dir, mixed=False)
    mixed, mix_stats = _run(tiny_model_dir, mixed=True)
    for a, b in zip(separate, mixed):
        assert a.output_ids == b.output_ids, a.rid
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs),
                              atol=1e-5, rtol=0)
    assert sep_stats["num_mixed_forwards"] == 0 and mix_stats["num_mixed_forwards"] > 0
    assert mix_stats["num_prefill_forwards"] < sep_stats["num_prefill_forwards"]
    for stats in (sep_stats, mix_stats):  # every token but each request's first is a decode row
        assert stats["num_decode_rows"] == stats["total_output_tokens"] - len(separate)
        assert stats["mean_decode_batch"] == stats["num_decode_rows"] / (
            stats["num_decode_forwards"] + stats["num_mixed_forwards"])


def test_mixed_chunk_is_refused_with_deterministic(tiny_model_dir):
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=2,
                         page_size=4, max_total_tokens=256, deterministic=True)
    with pytest.raises(BadInputError, match="--enable-mixed-chunk .* drop one of them"):
        PagedScheduler(runner, deterministic=True, enable_mixed_chunk=True)
