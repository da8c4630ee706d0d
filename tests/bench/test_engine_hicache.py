"""benchmarks/engine_hicache.py end to end on the CPU: `--device cpu --quick` through `python -m`,
as CI runs it. Checks the record's shape and arithmetic (hits per tier, the plan check's numbers,
no hit after a weight update), not speed; and that the full workload is refused on the CPU."""

from __future__ import annotations

import json
import os
from functools import partial

import pytest

from benchmarks.engine_hicache import FULL, QUICK, conversation_prompts
from tests.helpers.benchmarks import record_of, run_benchmark

bench = partial(run_benchmark, "engine_hicache", timeout_s=300)


def test_quick_cpu_run_compares_the_tier_with_the_baseline(tmp_path):
    proc = bench("--device", "cpu", "--quick", "--out", str(tmp_path))
    printed = record_of(proc)
    [written] = tmp_path.iterdir()
    assert written.name.startswith("engine_hicache-") and written.name.endswith("-cpu"
                                                                                f"{os.cpu_count()}.json")
    assert json.loads(written.read_text()) == printed
    assert printed["quick"] is True and printed["pinned_h2d_bytes_per_s"] is None
    base, tier = printed["rows"]
    requests = QUICK.conversations * QUICK.turns
    assert (base["arm"], tier["arm"]) == ("baseline", "tiered")
    assert base["requests"] == tier["requests"] == requests
    # Every turn after the first finds its history on the host (the pool holds 768 tokens of
    # 6 x 512), and the baseline prefills it again.
    assert tier["host_hit_tokens"] > 0 and tier["bytes_to_host"] > 0
    assert tier["bytes_to_device"] > 0 and tier["reload_bytes_per_s"] > 0
    assert base["host_hit_tokens"] == base["bytes_to_host"] == 0
    assert tier["prefill_tokens"] < base["prefill_tokens"]
    assert tier["cached_tokens"] == tier["host_hit_tokens"] + tier["device_hit_tokens"]
    assert printed["median_ttft_ratio"] == pytest.approx(tier["median_ttft_s"]
                                                         / base["median_ttft_s"])
    assert printed["after_update"] == {"requests": 4, "cached_tokens": 0, "host_hit_tokens": 0,
                                       "device_hit_tokens": 0}
    check = printed["plan_check"]
    assert check["model"] == "hicache" and check["context"]["requests"] == requests
    h = next(q["value"] for q in check["inputs"] if q["name"] == "hit_rate")
    assert h == pytest.approx(tier["host_hit_tokens"] / (requests * check["inputs"][1]["value"]))
    assert check["measured"]["value"] == pytest.approx(base["ttft_mean_s"] - tier["ttft_mean_s"])
    assert "plan check: predicted saving" in proc.stderr


def test_the_workload_shares_each_conversations_history():
    prompts = conversation_prompts(QUICK, vocab=1000, seed=2)
    assert len(prompts) == QUICK.conversations and {len(c) for c in prompts} == {QUICK.turns}
    for turns in prompts:
        for t in range(1, QUICK.turns):
            step = QUICK.user_tokens + QUICK.reply_tokens
            assert turns[t][:len(turns[t - 1])] == turns[t - 1]
            assert len(turns[t]) == len(turns[t - 1]) + step
    assert len(prompts[0][-1]) == QUICK.history_tokens
    assert FULL.conversations * FULL.history_tokens > 7 * FULL.pool_tokens


def test_cpu_without_quick_is_refused():
    proc = bench("--device", "cpu")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "add --quick" in proc.stderr
