"""rltool/profile/serving_check.py without engines: the interface with a model of its own (a
Checkable written here), the least-squares slope against a plain-loop fit, counters over a window,
and the HiCache check's refusals on /get_server_info answers built in the test."""

from __future__ import annotations

import pytest

from rltool.errors import BadInputError
from rltool.profile.serving_check import (HiCacheCheck, Quantity, counters_since,
                                          marginal_s_per_token, run_check)


class Throughput:
    """A toy serving model: tokens/s = batch / step seconds, from one engine's counters."""

    name = "throughput"
    roles = ("engine",)

    def measure(self, runs):
        c = runs["engine"]
        inputs = {"batch": Quantity("batch", c["batch"], "engine: batch"),
                  "step_s": Quantity("step_s", c["step_s"], "engine: step_s")}
        return inputs, Quantity("tokens_per_s", c["tokens_per_s"], "engine: tokens_per_s"), {}

    def predict(self, inputs):
        return Quantity("tokens_per_s", inputs["batch"] / inputs["step_s"], "batch / step_s")


def test_another_model_is_checked_through_the_same_interface():
    runs = {"engine": {"batch": 8, "step_s": 0.02, "tokens_per_s": 380.0}}
    check = run_check(Throughput(), runs, tolerance=0.1)
    assert check.predicted.value == 400.0
    assert check.relative_error == pytest.approx(20 / 380)
    assert check.passed and check.as_dict()["passed"]
    slow = run_check(Throughput(), runs, overrides={"step_s": 0.04}, tolerance=0.1)
    assert slow.predicted.value == 200.0 and not slow.passed
    assert slow.inputs[1] == Quantity("step_s", 0.04, "flag")
    with pytest.raises(BadInputError, match="takes no input 'gpus'; it takes batch, step_s"):
        run_check(Throughput(), runs, overrides={"gpus": 8}, tolerance=0.1)
    zero = run_check(Throughput(), {"engine": {**runs["engine"], "tokens_per_s": 0.0}},
                     tolerance=0.1)
    assert zero.relative_error == float("inf") and not zero.passed


def test_marginal_cost_is_the_least_squares_slope():
    forwards = [(416, 0.30), (48, 0.11), (64, 0.12), (512, 0.33), (17, 0.09)]
    n = len(forwards)
    mx = sum(x for x, _ in forwards) / n
    my = sum(y for _, y in forwards) / n
    want = (sum((x - mx) * (y - my) for x, y in forwards)
            / sum((x - mx) ** 2 for x, _ in forwards))
    halves = [forwards[:2], forwards[2:]]  # two engines' counters, pooled

    def sums(part):
        return {"prefill_forwards": len(part), "prefill_tokens": sum(x for x, _ in part),
                "prefill_s": sum(y for _, y in part),
                "prefill_tokens_sq": sum(x * x for x, _ in part),
                "prefill_token_s": sum(x * y for x, y in part)}

    assert marginal_s_per_token([sums(h) for h in halves]) == pytest.approx(want, rel=1e-12)
    assert marginal_s_per_token([sums([(64, 0.1), (64, 0.2)])]) is None  # one size: no slope


def _info(**stats):
    base = {"device_hit_tokens": 0, "host_hit_tokens": 0, "bytes_to_host": 0,
            "bytes_to_device": 0, "io_to_host_s": 0.0, "io_to_device_s": 0.0, "reloads": 0,
            "book_s": 0.0, "host_pages": 0, "host_pages_used": 0, "requests": 0,
            "prompt_tokens": 0, "ttft_s": 0.0, "prefill_forwards": 0, "prefill_tokens": 0,
            "prefill_s": 0.0, "prefill_tokens_sq": 0, "prefill_token_s": 0.0}
    return {"engine": "builtin", "hicache": base | stats}


def test_counters_since_take_the_difference_of_two_answers():
    before = _info(requests=2, ttft_s=1.0, prompt_tokens=10, prefill_tokens=10, prefill_s=1.0)
    after = _info(requests=6, ttft_s=1.8, prompt_tokens=50, prefill_tokens=30, prefill_s=2.0,
                  io_to_host_s=0.5, host_pages=8)
    window = counters_since(before, after)["hicache"]
    assert window["requests"] == 4 and window["ttft_mean_s"] == pytest.approx(0.2)
    assert window["prefill_s_per_token"] == pytest.approx(0.05)
    assert window["io_s"] == 0.5 and window["host_pages"] == 8
    assert window["ttft_p50_s"] is None


def test_hicache_check_refuses_runs_it_cannot_compare():
    check = HiCacheCheck(None, kv_bits=16)  # measure reads no model shape
    tiered = _info(host_pages=8, requests=4, prompt_tokens=100, io_to_device_s=0.1)
    baseline = _info(requests=4, prompt_tokens=100)
    with pytest.raises(BadInputError, match="baseline engine has a host KV tier"):
        check.measure({"tiered": tiered, "baseline": tiered})
    with pytest.raises(BadInputError, match="tiered engine has no host KV tier"):
        check.measure({"tiered": baseline, "baseline": baseline})
    with pytest.raises(BadInputError, match="different workloads"):
        check.measure({"tiered": tiered, "baseline": _info(requests=5, prompt_tokens=100)})
    with pytest.raises(BadInputError, match="reloaded nothing"):
        check.measure({"tiered": _info(host_pages=8, requests=4, prompt_tokens=100),
                       "baseline": baseline})
    with pytest.raises(BadInputError, match="no positive cost per token"):
        check.measure({"tiered": tiered, "baseline": baseline})
    with pytest.raises(BadInputError, match="does not report hicache counters"):
        check.measure({"tiered": {"engine": "sglang"}, "baseline": baseline})
