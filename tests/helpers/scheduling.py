"""Running requests through a started PagedScheduler from synchronous tests."""

from __future__ import annotations

import threading

from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams


def generate(sched, prompts, tag, *, new=6):
    """Submit one greedy request per prompt (rids tag0, tag1, ...; `new` tokens each, logprobs
    returned) and wait up to 60 s for all of them to finish; the requests."""
    done, finished = threading.Event(), []

    def on_finish(req):
        finished.append(req)
        if len(finished) == len(prompts):
            done.set()

    reqs = [Request(rid=f"{tag}{i}", prompt_ids=list(p), return_logprob=True, on_finish=on_finish,
                    params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    sched.submit(reqs)
    assert done.wait(60)
    return reqs


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
