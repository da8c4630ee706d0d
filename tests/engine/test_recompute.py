"""The engine's final logprob recompute: a failure fails the request, never silently falls back."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler


class RecomputeBroke(RuntimeError):
    pass


@pytest.fixture(scope="module")
def broken_recompute(tiny_model_dir):
    """A deterministic engine whose full-sequence logprob pass raises (sampling still works)."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32")

    def full_pass_logits(*_args, **_kwargs):
        raise RecomputeBroke("injected failure of the full pass")

    runner.full_pass_logits = full_pass_logits
    sched = PagedScheduler(runner, max_running=4, deterministic=True)
    sched.start()
    app = build_app(EngineState(cfg=ServeConfig(model=tiny_model_dir, deterministic=True),
                                runner=runner, scheduler=sched, started=time.monotonic()))
    with TestClient(app) as client:
        yield client
    sched.stop()


def generate(client: TestClient, **extra):
    return client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True}, **extra})


@pytest.mark.parametrize("extra", [{"return_logprob": True},
                                   {"return_logprob": True, "logprob_start_len": 0},
                                   {"return_logprob": True, "stream": True}])
def test_failed_recompute_fails_the_request(broken_recompute, extra):
    """Bug: when the deterministic recompute of logprobs raised, the engine logged it and
    answered 200 with the sampling-time logprobs, which are not the trainer-layout values the
    client asked for. The request now fails: HTTP 500 (an error event when streaming) naming the
    reason."""
    response = generate(broken_recompute, **extra)
    if extra.get("stream"):  # SSE: cumulative events, then an error event in place of the last
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500
        message = error["message"]
    else:
        assert response.status_code == 500, response.text
        message = response.json()["error"]["message"]
    assert "logprob recompute failed" in message and "RecomputeBroke" in message
    assert "injected failure" in message


def test_requests_that_need_no_recompute_still_succeed(broken_recompute):
    """The failure is confined to requests that asked for recomputed logprobs."""
    response = generate(broken_recompute)
    assert response.status_code == 200, response.text
    assert len(response.json()["output_ids"]) == 3
