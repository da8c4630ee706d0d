"""One bad request ends alone: sampling parameters that would fail a scheduler step are refused
before they are queued, a request whose first token fails still finishes (and frees its id), a
client that goes away aborts exactly its own requests, and a stop_regex that backtracks without
bound ends its own request within its time budget."""

from __future__ import annotations

import threading

import pydantic
import pytest

from rltool.engine import stop_rule
from rltool.engine.config import ServeConfig
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams
from rltool.engine.stop_rule import StopRule
from tests.helpers.engines import serve_app
from tests.helpers.scheduling import submit_and_wait


@pytest.mark.parametrize("bad", [
    {"logit_bias": {"abc": 1.0}}, {"logit_bias": {"-1": 1.0}}, {"logit_bias": {"5": float("inf")}},
    {"logit_bias": {"5": float("nan")}}, {"stop_regex": ["("]}, {"top_k": 10**30},
    {"stop_token_ids": [2**40]}, {"min_new_tokens": 10**30}, {"temperature": float("inf")}])
def test_parameters_a_step_cannot_use_are_refused(bad):
    with pytest.raises(pydantic.ValidationError):
        SamplingParams(max_new_tokens=4, **bad)


def test_a_bad_parameter_is_a_400_and_the_engine_goes_on(tiny_model_dir):
    with serve_app(ServeConfig(model=tiny_model_dir, device="cpu")) as (client, _):
        r = client.post("/generate", json={"input_ids": [1, 2, 3], "rid": "bad",
                                           "sampling_params": {"max_new_tokens": 4,
                                                               "logit_bias": {"abc": 1}}})
        assert r.status_code == 400 and "logit_bias key 'abc'" in r.text
        ok = client.post("/generate", json={"input_ids": [1, 2, 3], "rid": "bad",
                                            "sampling_params": {"max_new_tokens": 4}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4


def _scheduler(model_dir) -> PagedScheduler:
    return PagedScheduler(PagedRunner(model_dir, device="cpu", dtype="fp32"), max_running=4,
                          max_prefill_tokens=64)


def _request(rid: str, new: int) -> Request:
    return Request(rid=rid, prompt_ids=[1, 2, 3, 4],
                   params=SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))


def test_a_request_whose_first_token_fails_finishes_and_frees_its_id(tiny_model_dir,
                                                                     monkeypatch):
    sched = _scheduler(tiny_model_dir)
    sample = sched.batch._sample_and_accept
    calls = []

    def fails_once(reqs, logits):
        calls.append(len(reqs))
        if len(calls) == 1:
            raise RuntimeError("sampler failed")
        return sample(reqs, logits)

    monkeypatch.setattr(sched.batch, "_sample_and_accept", fails_once)
    sched.start()
    try:
        first = _request("r", 3)
        submit_and_wait(sched, [first], wait=30)
        assert first.finish_reason["status_code"] == 500
        assert "sampler failed" in first.finish_reason["message"]
        assert sched.queue.in_flight() == [] and sched.runner.table.entries == {}
        again = _request("r", 3)  # the same id is free again
        submit_and_wait(sched, [again], wait=30)
        assert again.finish_reason["type"] == "length" and len(again.output_ids) == 3
    finally:
        sched.stop()


def test_a_client_abort_ends_only_its_own_request(tiny_model_dir):
    sched = _scheduler(tiny_model_dir)
    longer, mine = _request("job12", 40), _request("job1", 40)
    started = threading.Event()
    mine.on_token = lambda req: started.set()
    sched.start()
    try:
        submit_and_wait(sched, [longer, mine],
                        while_running=lambda: (started.wait(30),
                                               sched.call(lambda: sched.abort_requests(["job1"]))
                                               .result(30)), wait=60)
    finally:
        sched.stop()
    assert mine.finish_reason["type"] == "abort"
    assert longer.finish_reason["type"] == "length" and len(longer.output_ids) == 40


def test_a_runaway_stop_regex_ends_its_own_request_within_its_budget(monkeypatch):
    monkeypatch.setattr(stop_rule, "PATTERN_BUDGET_S", 0.05)
    rule = StopRule.for_request(SamplingParams(max_new_tokens=100, stop_regex=["(a|aa)+$"]),
                                prompt_len=3, eos_token_ids=[0], context_length=1000)
    assert rule.reason(1, 5, lambda: ("aaab", 0)) is None  # a quick search: no match
    reason, cut = rule.reason(2, 5, lambda: ("a" * 40 + "b", 0))
    assert cut is None and reason["status_code"] == 400
    assert "stop_regex '(a|aa)+$' took more than 0.05 s" in reason["message"]
    assert rule.patterns.left_s == 0.0  # spent: the next search refuses at once
    assert rule.reason(3, 5, lambda: ("b", 0))[0]["status_code"] == 400


def test_unkeyed_health_probes_share_one_request(tiny_model_dir):
    """/health_generate needs no key: while the engine is paused, 16 concurrent callers hold one
    queued request between them, and all get their answer once it resumes."""
    from concurrent.futures import ThreadPoolExecutor

    with serve_app(ServeConfig(model=tiny_model_dir, device="cpu")) as (client, _):
        assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        with ThreadPoolExecutor(16) as pool:
            probes = [pool.submit(client.get, "/health_generate") for _ in range(16)]
            waiting = 0
            for _ in range(200):
                waiting = client.get("/get_server_info").json()["internal_states"][0]["num_waiting_reqs"]
                if waiting:
                    break
                threading.Event().wait(0.01)
            assert waiting == 1
            threading.Event().wait(0.2)  # later callers join the same probe
            assert client.get("/get_server_info").json()["internal_states"][0]["num_waiting_reqs"] == 1
            assert client.post("/continue_generation", json={}).status_code == 200
            assert [p.result(30).status_code for p in probes] == [200] * 16
