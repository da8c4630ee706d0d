"""`python -m benchmarks.fp8_mismatch` on the CPU (tiny model, a few short prompts): the four engine
configs and the fp32 floor, each engine's sampled-token logprobs against the trainer's
recompute. FP8 weights must show a larger mismatch than bf16 weights (the quantization error is
~5x the bf16 one on this model), and every sample must be scored on all its tokens."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from functools import partial

from rltool.data.models import PRESETS
from tests.helpers.benchmarks import record_of, run_benchmark

bench = partial(run_benchmark, "fp8_mismatch")


def test_tiny_model_four_configs_and_floor(tmp_path, tiny_model_dir):
    printed = record_of(bench("--device", "cpu", "--presets", "", "--model",
                              str(tiny_model_dir), "--prompts", "4", "--samples", "2",
                              "--prompt-len", "16", "--new-tokens", "8", "--out-dir",
                              str(tmp_path)))
    [written] = tmp_path.glob("fp8_mismatch-*-cpu*.json")
    assert json.loads(written.read_text()) == printed
    assert {(r["prompts"], r["samples"], r["prompt_len"], r["new_tokens"], r["prompt_file"])
            for r in printed["rows"]} == {(4, 2, 16, 8, None)}
    rows = printed["rows"]
    assert [(r["weights"], r["kv"], r["trainer"]) for r in rows] == [
        ("bf16", "bf16", "bf16"), ("fp8", "bf16", "bf16"), ("bf16", "fp8_e4m3", "bf16"),
        ("fp8", "fp8_e4m3", "bf16"), ("bf16", "bf16", "fp32")]
    for r in rows:
        assert r["tokens"] == 4 * 2 * 8
        assert 0.0 < r["abs_diff"] <= r["max_abs_diff"] and r["kl_k3"] >= 0.0
    by = {(r["weights"], r["kv"], r["trainer"]): r["abs_diff"] for r in rows}
    assert by[("fp8", "bf16", "bf16")] > 2 * by[("bf16", "bf16", "bf16")]
    assert by[("fp8", "fp8_e4m3", "bf16")] > 2 * by[("bf16", "bf16", "bf16")]


def test_prompt_file_prompts_end_at_eos(tmp_path, tiny_model_dir):
    from rltool.data.tasks import make_rows, write_prompts

    write_prompts(make_rows("reverse", num=3, seed=0, min_len=3, max_len=3),
                  tmp_path / "p.jsonl")
    # an earlier run of the day measured another model (kept) and this one (replaced)
    out = tmp_path / "results" / (f"fp8_mismatch-{datetime.now(timezone.utc):%Y-%m-%d}-"
                                  f"cpu{os.cpu_count()}.json")
    out.parent.mkdir()
    out.write_text(json.dumps({"rows": [{"model": "other"}, {"model": "reverse-tiny"}]}))
    record = record_of(bench("--device", "cpu", "--presets", "", "--model",
                             str(tiny_model_dir), "--model-name", "reverse-tiny",
                             "--prompt-file", str(tmp_path / "p.jsonl"), "--prompts", "2",
                             "--samples", "1", "--new-tokens", "4", "--out-dir",
                             str(out.parent)))
    assert json.loads(out.read_text()) == record and record["rows"][0] == {"model": "other"}
    assert len(record["rows"]) == 1 + 5
    for r in record["rows"][1:]:
        assert r["prompt_file"] == str(tmp_path / "p.jsonl") and 0 < r["tokens"] <= 2 * 4
        assert r["model"] == "reverse-tiny"


def test_bad_input_is_refused_in_one_line(tmp_path):
    runs = [bench("--presets", "nope", "--out-dir", str(tmp_path)),
            bench("--presets", "", "--model", str(tmp_path / "missing")),
            bench("--prompt-file", str(tmp_path / "none.jsonl"))]
    assert [r.returncode for r in runs] == [2, 2, 2]
    err = [r.stderr.strip().splitlines()[-1] for r in runs]
    assert err == ["Error: unknown --preset 'nope'; choose one of " + ", ".join(PRESETS),
                   f"Error: --model {tmp_path / 'missing'} has no config.json; pass a HF "
                   "checkpoint directory",
                   f"Error: --prompt-file {tmp_path / 'none.jsonl'} does not exist; pass a "
                   "prompt file (JSONL)"]
    assert list(tmp_path.iterdir()) == []
