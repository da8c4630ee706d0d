"""benchmarks/engine_http.py end to end: `--quick` on the CPU (tiny model, both arms, every
workload) as the coordinator runs it, through `python -m`. Checks the record, not speed: every
workload ran in both arms, every call came back with all its tokens, the engine's own counters
saw the work, and the HTTP arm's numbers are the server's (its CPU time, its counters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = {"uniform-8", "uniform-32", "mixed-32", "grpo-8", "stream-8"}


@pytest.mark.slow
def test_quick_run_measures_both_arms_on_every_workload(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.engine_http", "--quick",
                           "--min-seconds", "0.5", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    [written] = tmp_path.iterdir()
    assert written.name.startswith("engine_http-quick-") and written.name.endswith(".json")
    assert json.loads(written.read_text()) == printed
    assert printed["benchmark"] == "engine_http" and printed["settings"]["quick"]
    assert printed["settings"]["http_client"] in ("aiohttp", "httpx")

    rows = {(r["workload"], r["arm"]): r for r in printed["results"]}
    assert set(rows) == {(w, arm) for w in WORKLOADS for arm in ("in_process", "http")}
    by_name = {w["name"]: w for w in printed["workloads"]}
    for (name, arm), r in rows.items():
        w = by_name[name]
        assert r["calls"] == r["rounds"] * w["per_round"] and r["rounds"] >= 1
        assert r["sequences"] == r["calls"] * w["n"]
        assert r["seconds"] >= 0.5  # rounds repeat until --min-seconds
        assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
        assert r["output_tokens"] >= r["sequences"]
        if w["output_median"] == w["output_cap"]:  # fixed outputs: every token came back
            assert r["output_tokens"] == r["sequences"] * w["output_cap"]
        # The engine counted the work; in process its last step may land after the answer.
        assert abs(r["engine_output_tokens"] - r["output_tokens"]) <= 2 * w["in_flight"] * w["n"]
        assert r["prefill_forwards"] >= 1 and r["decode_forwards"] >= 1
        assert 0 < r["mean_decode_batch"] <= w["in_flight"] * w["n"]
        has_ttft = w["stream"] or arm == "in_process"
        assert (r["ttft_p50_ms"] is not None) == has_ttft, (name, arm)
        if has_ttft:
            assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert (r["server_cpu_s"] is not None) == (arm == "http")
        if arm == "http":  # the server did the work, in its own process
            assert r["server_cpu_s"] > 0
    assert set(printed["http_over_in_process"]) == WORKLOADS
    assert all(x > 0 for x in printed["http_over_in_process"].values())
    assert "hf_generate" not in printed  # GPU only
