"""Running requests through a started PagedScheduler from synchronous tests."""

from __future__ import annotations

import threading

from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams


def generate(sched, prompts, tag, *, new=6, loras=None, wait=60):
    """Submit one greedy request per prompt (rids tag0, tag1, ...; `new` tokens each, logprobs
    returned; under adapter `loras[i]` where given, None being the policy's) and wait up to `wait`
    seconds for all of them to finish; the requests."""
    done, finished = threading.Event(), []

    def on_finish(req):
        finished.append(req)
        if len(finished) == len(prompts):
            done.set()

    loras = [None] * len(prompts) if loras is None else loras
    reqs = [Request(rid=f"{tag}{i}", prompt_ids=list(p), lora=lora, return_logprob=True,
                    on_finish=on_finish,
                    params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
            for i, (p, lora) in enumerate(zip(prompts, loras))]
    sched.submit(reqs)
    assert done.wait(wait)
    return reqs


def generate_once(runner, prompts, loras, *, new, max_prefill_tokens, **options):
    """`generate` (rids r0, r1, ..., up to 120 s) through a PagedScheduler over `runner`
    (max_running 8, `max_prefill_tokens`, `options`) started for these requests alone and
    stopped after them; the requests."""
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=max_prefill_tokens,
                           **options)
    sched.start()
    try:
        return generate(sched, prompts, "r", new=new, loras=loras, wait=120)
    finally:
        sched.stop()


def run_in_two_waves(sched, reqs, done, *, first=3):
    """Start `sched`, submit reqs[:first] and then the rest (the later ones join a running
    batch), wait up to 120 s for `done` to be set, and stop it."""
    sched.start()
    try:
        sched.submit(reqs[:first])
        sched.submit(reqs[first:])
        assert done.wait(120)
    finally:
        sched.stop()
