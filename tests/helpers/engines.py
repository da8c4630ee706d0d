"""Calling a live engine from synchronous tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rltool.rollout.client import EngineClient


def engine_call(url: str, method: str, *args, **kwargs):
    """Run one EngineClient coroutine method against `url` (a fresh client per call)."""

    async def go():
        async with EngineClient(url, timeout_s=60.0, max_retries=0) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(go())


def filled_page_table(rows: int, length: int, *, num_pages: int, page_size: int, device: str):
    """A PageTable of `rows` requests r0, r1, ... of `length` tokens each, flushed to `device`
    (for calling decode attention directly)."""
    from rltool.engine.paged import PageTable

    table = PageTable(num_pages=num_pages, page_size=page_size, max_requests=rows,
                      max_pages_per_request=-(-length // page_size), device=device)
    for i in range(rows):
        table.add(f"r{i}")
        table.extend(f"r{i}", length)
    table.flush()
    return table


@contextmanager
def serve_app(cfg) -> Iterator:
    """The engine `rltool serve` builds from `cfg`, its scheduler started, behind the app in a
    TestClient; yields (client, runner) and stops the scheduler after."""
    from fastapi.testclient import TestClient

    from rltool.engine.app import EngineState, build_app
    from rltool.engine.server import build_engine

    runner, sched = build_engine(cfg)
    sched.start()
    try:
        app = build_app(EngineState(cfg=cfg, runner=runner, scheduler=sched,
                                    started=time.monotonic()))
        with TestClient(app) as client:
            yield client, runner
    finally:
        sched.stop()


def generate_deterministic(model_dir, prompts: list[list[int]], *, device: str, dtype: str,
                           max_new_tokens: int, max_total_tokens: int, max_prefill_tokens: int,
                           chunked_prefill_size: int, timeout_s: float = 600):
    """The paged engine in deterministic mode (16 slots, pages of 4, CUDA graphs up to batch 16)
    with `prompts` submitted together, each sampled by its own seeded generator (7 for the first,
    100 + i for the others). Returns ((the first prompt's tokens, their logprobs), runner,
    scheduler)."""
    from rltool.engine.paged_runner import PagedRunner
    from rltool.engine.paged_scheduler import PagedScheduler
    from rltool.engine.request import Request
    from rltool.engine.sampling import SamplingParams, make_generator
    from tests.helpers.scheduling import run_all

    runner = PagedRunner(model_dir, device=device, dtype=dtype, max_running=16, page_size=4,
                         max_total_tokens=max_total_tokens, cuda_graph_max_bs=16,
                         deterministic=True)
    sched = PagedScheduler(runner, max_running=16, max_prefill_tokens=max_prefill_tokens,
                           chunked_prefill_size=chunked_prefill_size, deterministic=True)
    reqs = [Request(rid=f"r{i}", prompt_ids=p, return_logprob=True,
                    generator=make_generator(7 if i == 0 else 100 + i),
                    params=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                                          ignore_eos=True))
            for i, p in enumerate(prompts)]
    run_all(sched, reqs, wait=timeout_s)
    return (reqs[0].output_ids, reqs[0].output_logprobs), runner, sched
