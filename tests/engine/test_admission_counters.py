"""The forward counters of /get_server_info on CPU: prefill and decode forwards, the decode rows
they ran and the mean decode batch, against counts worked out from the requests' lengths."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from rltool.engine import api
from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams

NEW_TOKENS = [3, 5, 8]


def test_server_info_counts_forwards_and_the_mean_decode_batch(tiny_model_dir):
    """Three greedy requests prefilled together: each samples its first token from the prefill,
    then needs one decode row per further token; the batch shrinks as the shorter ones end."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=512)
    sched = PagedScheduler(runner, max_running=4, max_prefill_tokens=64)
    reqs = [Request(rid=f"r{i}", prompt_ids=[5 + i, 6, 7, 8], params=SamplingParams(
                max_new_tokens=n, temperature=0.0, ignore_eos=True))
            for i, n in enumerate(NEW_TOKENS)]
    sched.queue.submit(reqs)
    sched.queue.wait_for_work(sched.batch.can_step)
    for _ in range(50):
        if all(r.finished for r in reqs):
            break
        sched.batch.step()
    assert [len(r.output_ids) for r in reqs] == NEW_TOKENS

    rows = sum(n - 1 for n in NEW_TOKENS)  # 2 + 4 + 7
    forwards = max(NEW_TOKENS) - 1  # the batch runs until the longest request ends
    app = build_app(EngineState(cfg=ServeConfig(model=tiny_model_dir, device="cpu"),
                                runner=runner, scheduler=sched, started=time.monotonic()))
    with TestClient(app) as client:
        state = client.get(api.SERVER_INFO).json()["internal_states"][0]
    assert state["num_prefill_forwards"] == 1
    assert state["num_prefill_tokens"] == 4 * len(reqs)
    assert state["num_decode_forwards"] == forwards
    assert state["num_decode_rows"] == rows
    assert state["mean_decode_batch"] == rows / forwards
    assert state["max_decode_batch_seen"] == len(reqs)
