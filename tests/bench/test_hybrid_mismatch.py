"""`python -m benchmarks.hybrid_mismatch --device cpu --quick` (tiny-4l hybrid, a few short
prompts): the four engine configs (recurrent state fp32/bf16 x KV bf16/FP8) and the fp32-trainer
floor, each engine's sampled-token logprobs against the trainer's recompute, every sample scored
on all its tokens; and the refusals (a model without linear-attention layers, bad sizes, an
unknown preset), each one line, exit 2, nothing written."""

from __future__ import annotations

import json
from functools import partial

from tests.helpers.benchmarks import record_of, run_benchmark

bench = partial(run_benchmark, "hybrid_mismatch")


def test_quick_run_four_configs_and_floor(tmp_path):
    proc = bench("--device", "cpu", "--quick", "--out-dir", str(tmp_path))
    printed = record_of(proc)
    [written] = tmp_path.glob("hybrid_mismatch-*-cpu*.json")
    assert json.loads(written.read_text()) == printed
    assert (printed["prompts"], printed["samples"], printed["new_tokens"]) == (4, 2, 8)
    rows = printed["rows"]
    assert [(r["model"], r["ssm"], r["kv"], r["trainer"]) for r in rows] == [
        ("tiny-4l", "fp32", "bf16", "bf16"), ("tiny-4l", "bf16", "bf16", "bf16"),
        ("tiny-4l", "fp32", "fp8_e4m3", "bf16"), ("tiny-4l", "bf16", "fp8_e4m3", "bf16"),
        ("tiny-4l", "fp32", "bf16", "fp32")]
    for r in rows:
        assert r["tokens"] == 4 * 2 * 8 and 0.0 <= r["same_tokens"] <= 1.0
        assert 0.0 < r["abs_diff"] <= r["max_abs_diff"] and r["kl_k3"] >= 0.0
        assert r["abs_diff_vs_default"] == r["abs_diff"] / rows[0]["abs_diff"]
    assert rows[0]["same_tokens"] == 1.0
    # each engine flag changes what the engine computes: its logprobs differ from the default's
    default = rows[0]["mean_rollout_logprob"]
    assert all(r["mean_rollout_logprob"] != default for r in rows[1:4])
    assert rows[4]["mean_rollout_logprob"] == default  # the floor scores the default's samples
    assert "|dlogp| mean" in proc.stdout


def test_refusals_write_nothing(tmp_path, tiny_model_dir, capsys):
    from benchmarks import hybrid_mismatch

    for args, message in (
            (["--model", str(tiny_model_dir)], "is not a hybrid (its config.json names no"),
            (["--quick", "--prompts", "0"], "must be >= 1"),
            (["--preset", "huge"], "unknown --preset 'huge'")):
        assert hybrid_mismatch.main(["--device", "cpu", *args, "--out-dir",
                                     str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()
