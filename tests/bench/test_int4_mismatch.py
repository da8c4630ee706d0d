"""`python -m benchmarks.int4_mismatch` on the CPU (tiny model, a few warm-start steps, a few
short prompts): the four rows and the QAT reductions. INT4 rollout must show a larger mismatch
than bf16 rollout against a bf16 trainer, and the trainer's --int4-qat forward must bring it back
down (it computes with the very weights the engine dequantizes)."""

from __future__ import annotations

import json
from functools import partial

from rltool.data.models import PRESETS
from tests.helpers.benchmarks import record_of, run_benchmark

bench = partial(run_benchmark, "int4_mismatch")


def test_tiny_run_four_rows_and_qat_reduction(tmp_path):
    proc = bench("--preset", "tiny", "--sft-steps", "3", "--prompts", "4", "--samples", "2",
                 "--new-tokens", "8", "--out-dir", str(tmp_path))
    printed = record_of(proc)
    [written] = tmp_path.glob("int4_mismatch-*-cpu*.json")
    assert json.loads(written.read_text()) == printed
    assert (printed["sft_steps"], printed["prompts"], printed["samples"],
            printed["new_tokens"]) == (3, 4, 2, 8)
    assert set(printed["sft_final_loss"]) == {"sft", "sft-qat"}
    rows = printed["rows"]
    assert [(r["policy"], r["engine"], r["trainer"]) for r in rows] == [
        ("sft", "bf16", "bf16"), ("sft", "int4", "bf16"), ("sft", "int4", "bf16+qat"),
        ("sft-qat", "int4", "bf16+qat")]
    for r in rows:
        assert 0 < r["tokens"] <= 4 * 2 * 8
        assert 0.0 < r["abs_diff"] <= r["max_abs_diff"] and r["kl_k3"] >= 0.0
    floor, no_qat, qat, qat_trained = (r["abs_diff"] for r in rows)
    assert no_qat > 2 * floor
    assert rows[2]["qat_reduction"] == no_qat / qat > 2.0
    assert rows[3]["qat_reduction"] == no_qat / qat_trained
    assert rows[0]["qat_reduction"] is None and rows[1]["qat_reduction"] is None


def test_bad_input_is_refused_in_one_line():
    runs = [bench("--preset", "nope"), bench("--sft-steps", "0"), bench("--lr", "0")]
    assert [r.returncode for r in runs] == [2, 2, 2]
    assert [r.stderr.strip().splitlines()[-1] for r in runs] == [
        "Error: unknown --preset 'nope'; choose one of " + ", ".join(PRESETS),
        "Error: --sft-steps must be >= 1, got 0",
        "Error: --lr must be > 0, got 0.0"]
