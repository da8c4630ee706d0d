"""The paged scheduler on CPU: continuous batching over the page table (chunked and packed
prefill, joins and leaves, retraction when the pool runs out) must give every greedy request
the tokens and logprobs that transformers gives it alone, and return every page it took."""

from __future__ import annotations

import threading

import pytest
import torch

from rltool.engine.paged import OutOfPagesError, PageAllocator, PageTable
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.scheduling import run_in_two_waves

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20],
           [3, 3, 3, 4], [21, 22, 23, 24, 25, 26, 27]]
NEW = 9


def test_allocator_and_table_bookkeeping():
    alloc = PageAllocator(5)
    assert alloc.alloc(2) == [1, 2] and alloc.available == 2
    with pytest.raises(OutOfPagesError):
        alloc.alloc(3)
    alloc.free([1, 2])
    assert alloc.available == 4
    table = PageTable(num_pages=6, page_size=4, max_requests=2, max_pages_per_request=3,
                      device="cpu")
    table.add("a")
    table.extend("a", 5)  # two pages
    table.add("b")
    table.extend("b", 1)
    assert table.entries["a"].pages == [1, 2] and table.entries["b"].pages == [3]
    assert table.slots("a", 3, 6) == [7, 8, 9] and table.extra_pages("a", 9) == 1
    table.flush()
    row = table.entries["a"].row
    assert table.req_to_page[row, :2].tolist() == [1, 2]
    table.remove("a")
    assert table.free_pages == 4 and "a" not in table.entries
    table.clear()
    assert table.free_pages == 5


@pytest.mark.parametrize("max_total_tokens", [4096, 48])
def test_greedy_requests_match_transformers_alone(tiny_model_dir, max_total_tokens):
    """48 pool tokens cannot hold all five requests: decode retracts and recomputes later ones."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=max_total_tokens)
    sched = PagedScheduler(runner, max_running=4, max_prefill_tokens=12, chunked_prefill_size=8)
    done = threading.Event()
    finished = []

    def on_finish(req):
        finished.append(req)
        if len(finished) == len(PROMPTS):
            done.set()

    reqs = [Request(rid=f"r{i}", prompt_ids=p, return_logprob=True, on_finish=on_finish,
                    params=SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    run_in_two_waves(sched, reqs, done)
    for req, prompt in zip(reqs, PROMPTS):
        want, lps = hf_greedy(tiny_model_dir, prompt, NEW)
        assert req.output_ids == want, req.rid
        assert req.output_logprobs == pytest.approx(lps, abs=1e-5)
    assert runner.table.free_pages == runner.table.allocator.num_pages - 1
    assert not runner.table.entries
    assert sched.max_decode_batch > 1
    if max_total_tokens == 48:
        assert sched.num_retractions > 0


def test_batched_sampling_matches_the_reference_sampler():
    """Same noise source, same draw: tokens and logprobs equal the reference sampler's, and the
    top-k / token-id logprobs are read off the same distribution."""
    from rltool.engine.batch_sampling import sample_batch
    from tests.helpers.sampling import sample

    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_p=0.9, top_k=5),
              SamplingParams(temperature=1.3, min_p=0.1),
              SamplingParams(temperature=1.0, logit_bias={"7": 5.0})]
    suppressed = [[], [], [3], [], []]
    ref_tokens, ref_lp = sample(logits, params, generators=[None] * 5, suppressed=suppressed,
                                shared_generator=torch.Generator().manual_seed(5))
    got = sample_batch(logits, params, generators=[None] * 5, suppressed=suppressed,
                       top_n=[3, 0, 0, 1, 0], token_ids=[None, [1, 2], None, None, None],
                       shared_generator=torch.Generator().manual_seed(5))
    assert got.tokens == ref_tokens.tolist()
    assert got.logprobs == [float(ref_lp[i, t]) for i, t in enumerate(got.tokens)]
    values, idx = ref_lp[0].topk(3)
    assert got.top[0] == list(zip(values.tolist(), idx.tolist())) and got.top[1] is None
    assert got.ids_logprobs[1] == [(float(ref_lp[1, 1]), 1), (float(ref_lp[1, 2]), 2)]


def test_stop_ids_wait_for_min_new_tokens_and_spans_follow_the_version(tiny_model_dir):
    """The per-token stop check (a rule computed at admission): a stop id is masked while fewer
    than min_new_tokens are out and ends the request once it may; the length limit ends the
    others; a weight version change mid-request opens a new span."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256)
    sched = PagedScheduler(runner, max_running=4)
    prompt = PROMPTS[0]
    free, _ = hf_greedy(tiny_model_dir, prompt, 8)
    stop = free[1]  # the greedy run emits it at step 1; min_new_tokens 4 must hold it back
    finished = threading.Semaphore(0)
    stopped = Request(rid="stop", prompt_ids=prompt, on_finish=lambda r: finished.release(),
                      params=SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True,
                                            min_new_tokens=4, stop_token_ids=[stop]))
    capped = Request(rid="cap", prompt_ids=PROMPTS[1], on_finish=lambda r: finished.release(),
                     params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    sched.start()
    try:
        sched.submit([stopped, capped])
        assert finished.acquire(timeout=60) and finished.acquire(timeout=60)
    finally:
        sched.stop()
    assert stop not in stopped.output_ids[:4] and len(stopped.output_ids) >= 5
    if stopped.finish_reason["type"] == "stop":
        assert stopped.output_ids[-1] == stop and stop not in stopped.output_ids[4:-1]
        assert stopped.finish_reason == {"type": "stop", "matched": stop}
    else:
        assert len(stopped.output_ids) == 40 and stop not in stopped.output_ids[4:]
    assert capped.finish_reason == {"type": "length", "length": 6}
    assert capped.weight_spans() == [{"version": "default", "start": 0, "end": 6}]
    req = Request(rid="v", prompt_ids=[1], params=SamplingParams())
    for token, version in [(5, "1"), (6, "1"), (7, "2"), (8, "2"), (9, "2")]:
        req.record_token(token, -0.5, version=version)
    assert req.weight_spans() == [{"version": "1", "start": 0, "end": 2},
                                  {"version": "2", "start": 2, "end": 5}]


def test_each_decode_step_is_a_trace_span(tiny_model_dir, tmp_path):
    """`decode.step` spans (what benchmarks read): one per decode step, with the batch it ran
    and the forwards it took; two requests prefilled together decode together to the end."""
    import json

    from rltool import trace

    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256)
    sched = PagedScheduler(runner, max_running=4)
    finished = threading.Semaphore(0)
    reqs = [Request(rid=f"t{i}", prompt_ids=p, on_finish=lambda r: finished.release(),
                    params=SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS[:2])]
    writer = trace.configure(tmp_path, role="engine-test")
    try:
        sched.start()
        sched.submit(reqs)
        assert finished.acquire(timeout=60) and finished.acquire(timeout=60)
    finally:
        sched.stop()
        trace.configure(None, role="engine-test")
    events = [json.loads(line) for line in writer.path.read_text().splitlines()]
    steps = [e for e in events if e["name"] == "decode.step"]
    assert all(e["cat"] == "engine" and e["ph"] == "X" for e in steps)
    # the first token of each comes from the prefill, the other NEW - 1 from decode steps
    assert [e["args"] for e in steps] == [{"batch": 2, "steps": 1}] * (NEW - 1)
    assert sched.num_decode_forwards == NEW - 1


@pytest.mark.parametrize("layout", ["one process", "two processes"])
def test_operations_queued_when_the_scheduler_stops_fail_with_503(layout):
    """An operation still queued when the scheduler stops, or asked for after, fails with the
    engine shutting down (a route answers 503) in either layout's operations; it used to wait
    forever, its route never answering."""
    import asyncio
    from types import SimpleNamespace

    from rltool.engine.ops import EngineOps
    from rltool.engine.scheduler_process import Outbox, StepOrderedOps
    from rltool.errors import EngineError

    class Channel:
        def send(self, msg):
            pass

    runner = SimpleNamespace(device=torch.device("cpu"), triton_kernels=False,
                             invariant_kernels=False, released=False, weight_version="v0")
    sched = PagedScheduler(runner, overlap=False)
    kw = {"runner": runner, "scheduler": sched, "max_running": 4, "allowed_sync_hosts": []}
    if layout == "one process":
        ops = EngineOps(**kw)
    else:
        ops = StepOrderedOps(outbox=Outbox(Channel(), runner), **kw)
        sched.on_iteration = ops.outbox.flush
    sched.start()
    busy, release = threading.Event(), threading.Event()
    sched.call(lambda: (busy.set(), release.wait(10.0)))
    assert busy.wait(10.0)  # the scheduler thread runs an operation: the next ones queue

    async def stop_with_queued_operations() -> None:
        flush = asyncio.ensure_future(ops.flush_if_idle())
        update = asyncio.ensure_future(ops.update_weights_from_disk(
            model_path="unused", abort_all=True, weight_version=None))
        for _ in range(5):  # both reach the scheduler's queue
            await asyncio.sleep(0)
        assert not flush.done() and not update.done()
        sched.request_stop()
        release.set()
        with pytest.raises(EngineError, match="the engine is shutting down"):
            await asyncio.wait_for(flush, 10.0)
        status, body = await asyncio.wait_for(update, 10.0)
        assert (status, body["success"], body["message"]) == (
            503, False, "the engine is shutting down")
        with pytest.raises(EngineError, match="the engine is shutting down"):
            await ops.pause(mode="abort")

    try:
        asyncio.run(stop_with_queued_operations())
    finally:
        release.set()
        sched.stop()
