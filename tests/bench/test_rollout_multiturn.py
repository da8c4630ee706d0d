"""`python -m benchmarks.rollout_multiturn --device cpu --quick`: the smoke path of the multi-turn
throughput benchmark writes a record with both variants' times, equal model token counts (the
multi-turn one with its masked observation tokens), the ratio and the env step overheads."""

from __future__ import annotations

import json

import pytest

from benchmarks import rollout_multiturn


@pytest.mark.timeout(300)
def test_quick_record_has_both_variants_and_the_overheads(tmp_path, capsys):
    out = tmp_path / "record.json"
    rollout_multiturn.main(["--device", "cpu", "--quick", "--out", str(out)])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    record = json.loads(out.read_text())
    assert printed["multi_over_single"] == record["multi_over_single"]
    assert record["benchmark"] == "rollout_multiturn" and record["device"] == "cpu"
    _, prompts, samples, turns, tokens, rounds = rollout_multiturn.WORKLOADS["quick"]
    rows = prompts * samples
    single, multi = record["tokens"]["single-turn"], record["tokens"]["multi-turn"]
    # ignore_eos: both produce exactly their budget of model tokens
    assert single["model_tokens"] == multi["model_tokens"] == rows * turns * tokens
    assert single["env_tokens"] == 0 and single["env_steps"] == 0
    assert multi["env_steps"] == rows * turns and multi["env_tokens"] > 0
    assert all(len(record["times_s"][k]) == rounds for k in ("single-turn", "multi-turn"))
    for k in ("single-turn", "multi-turn"):
        assert record["model_tok_s"][k] == pytest.approx(
            record["tokens"][k]["model_tokens"] / record["median_s"][k])
    assert record["multi_over_single"] == pytest.approx(
        record["model_tok_s"]["multi-turn"] / record["model_tok_s"]["single-turn"])
    overhead = record["env_step_overhead_s"]
    assert overhead["per_step"] == pytest.approx(
        (record["median_s"]["multi-turn"] - record["median_s"]["single-turn"]) / (rows * turns))
    assert overhead["per_episode"] == pytest.approx(overhead["per_step"] * turns)
    assert overhead["host_per_step"] > 0
