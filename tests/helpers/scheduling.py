"""Running requests through a PagedScheduler from synchronous tests."""

from __future__ import annotations

import threading

from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams


def _all_finished(reqs) -> threading.Event:
    """An event set once every request of `reqs` has finished (it takes their on_finish)."""
    done, finished = threading.Event(), []

    def on_finish(req):
        finished.append(req)
        if len(finished) == len(reqs):
            done.set()

    for r in reqs:
        r.on_finish = on_finish
    return done


def greedy_requests(prompts, tag, *, new, loras=None) -> list[Request]:
    """One greedy request per prompt (rids tag0, tag1, ...; `new` tokens each, logprobs returned;
    under adapter `loras[i]` where given, None being the policy's)."""
    loras = [None] * len(prompts) if loras is None else loras
    return [Request(rid=f"{tag}{i}", prompt_ids=list(p), lora=lora, return_logprob=True,
                    params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
            for i, (p, lora) in enumerate(zip(prompts, loras))]


def generate(sched, prompts, tag, *, new=6):
    """Submit `greedy_requests` of `prompts` to the started `sched` and wait up to 60 s for all of
    them to finish; the requests."""
    reqs = greedy_requests(prompts, tag, new=new)
    done = _all_finished(reqs)
    sched.submit(reqs)
    assert done.wait(60)
    return reqs


def submit_and_wait(sched, reqs, *, while_running=None, wait=120) -> None:
    """Submit `reqs` to the started `sched`, call `while_running()` (when given) and wait up to
    `wait` seconds for all of them to finish (their on_finish is taken for that)."""
    done = _all_finished(reqs)
    sched.submit(reqs)
    if while_running is not None:
        while_running()
    assert done.wait(wait)


def run_all(sched, reqs, *, wait=120) -> None:
    """Start `sched`, submit `reqs` together, wait up to `wait` seconds for all of them to finish
    (their on_finish is taken for that) and stop it."""
    done = _all_finished(reqs)
    sched.start()
    try:
        sched.submit(reqs)
        assert done.wait(wait)
    finally:
        sched.stop()


def generate_once(runner, prompts, loras, *, new, max_prefill_tokens, **options):
    """`greedy_requests` of `prompts` under adapters `loras` (rids r0, r1, ...) run together
    (`run_all`) through a PagedScheduler over `runner` (max_running 8, `max_prefill_tokens`,
    `options`) made for them; the requests."""
    sched = PagedScheduler(runner, max_running=8, max_prefill_tokens=max_prefill_tokens,
                           **options)
    reqs = greedy_requests(prompts, "r", new=new, loras=loras)
    run_all(sched, reqs)
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
