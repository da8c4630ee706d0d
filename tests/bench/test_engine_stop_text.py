"""benchmarks/engine_stop_text.py end to end on the CPU through `python -m`, as CI runs it:
both checks stop at the last token with the same decision; the whole-text check decodes
n(n+1)/2 tokens and the incremental one at most three per token (the seam's and the new one,
twice). Counts, not speed. A length that cannot hold the stop string is refused."""

from __future__ import annotations

from functools import partial

from tests.helpers.benchmarks import record_of, run_benchmark

bench = partial(run_benchmark, "engine_stop_text", timeout_s=300)


def test_both_checks_decide_alike_and_the_incremental_one_decodes_new_tokens_only():
    n = 300
    record = record_of(bench("--tokens", str(n)))
    assert record["tokens"] == n and record["same_decision"] is True
    whole, incremental = record["results"]
    assert whole["case"] == "whole text" and whole["decoded_tokens"] == n * (n + 1) // 2
    assert incremental["case"] == "incremental" and incremental["decoded_tokens"] <= 3 * n


def test_an_output_too_short_for_the_stop_string_is_refused():
    proc = bench("--tokens", "3")
    assert proc.returncode == 2 and "--tokens must be >= 18" in proc.stderr
