"""benchmarks/engine_hybrid_prefix.py end to end on the CPU: `--device cpu --quick` through
`python -m`, as CI runs it. Checks the record's shape and arithmetic (the cache arm's prefill
tokens: each prompt once plus one token per later sample, its 96-token prompts ending on a page
end; the other arm's: every sample's prompt), not speed; and that the full workload is refused on
the CPU."""

from __future__ import annotations

import json
from functools import partial

from benchmarks.engine_hybrid_prefix import QUICK
from tests.helpers.benchmarks import record_of, run_benchmark

bench = partial(run_benchmark, "engine_hybrid_prefix", timeout_s=300)


def test_quick_cpu_run_counts_the_prefill_of_both_arms(tmp_path):
    printed = record_of(bench("--device", "cpu", "--quick", "--out", str(tmp_path)))
    [written] = tmp_path.iterdir()
    assert written.name.startswith("engine_hybrid_prefix-")
    assert json.loads(written.read_text()) == printed
    prompts, samples, length = QUICK["prompts"], QUICK["samples"], QUICK["prompt_len"]
    unique = prompts * length
    cache, fresh = printed["result"]["prefix_cache"], printed["result"]["no_prefix_cache"]
    assert length % 16 == 0  # the engine's default page: snapshots one token before the end
    assert cache["prefill_tokens"] == unique + prompts * (samples - 1)
    assert cache["cached_tokens"] == prompts * (samples - 1) * (length - 1)
    assert fresh["prefill_tokens"] == unique * samples and fresh["cached_tokens"] == 0
    assert printed["meets_target"] is True
    assert printed["prefill_ratio"] == cache["prefill_tokens"] / unique


def test_the_full_workload_is_refused_on_the_cpu():
    proc = bench("--device", "cpu")
    assert proc.returncode == 2 and "add --quick" in proc.stderr
