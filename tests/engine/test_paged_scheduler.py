"""The paged scheduler on CPU: continuous batching over the page table (chunked and packed
prefill, joins and leaves, retraction when the pool runs out) must give every greedy request
the tokens and logprobs that transformers gives it alone, and return every page it took."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from rltool.engine.paged import OutOfPagesError, PageAllocator, PageTable
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams

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


def hf_greedy(model_dir, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            out.append(tok)
            ids.append(tok)
    return out, lps


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
    sched.start()
    try:
        sched.submit(reqs[:3])
        sched.submit(reqs[3:])
        assert done.wait(120)
    finally:
        sched.stop()
    for req, prompt in zip(reqs, PROMPTS):
        want, lps = hf_greedy(tiny_model_dir, prompt, NEW)
        assert req.output_ids == want, req.rid
        assert req.output_logprobs == pytest.approx(lps, abs=1e-5)
    assert runner.table.free_pages == runner.table.allocator.num_pages - 1
    assert not runner.table.entries
    assert sched.max_decode_batch > 1
    if max_total_tokens == 48:
        assert sched.num_retractions > 0
