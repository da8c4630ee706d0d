"""`rltool rollout` and failed reward calls: failed samples up to --max-failed-rewards-frac,
exit 3 with nothing written beyond it; a reward that needs labels is checked before sampling."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rltool.cli import main
from rltool.data.shards import open_shard
from rltool.data.tasks import make_rows
from rltool.rollout.rewards import RewardResult

HERE = "tests.rollout.test_rollout_reward_failures"


def reward_fails_on_first_prompt(prompt, response, label, metadata):
    """Raises for the samples of one prompt of four (a quarter of the calls)."""
    if metadata.get("fail"):
        raise RuntimeError("reward crashed")
    return RewardResult(reward=1.0)


@pytest.fixture
def prompts(tmp_path):
    rows = make_rows("reverse", num=4, seed=1)
    rows[0]["metadata"] = {"fail": True}
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rollout(engine, prompts, out, *extra):
    args = ["rollout", "--quiet", "--engines", engine.url, "--prompts", str(prompts), "--out",
            str(out), "--reward", f"{HERE}:reward_fails_on_first_prompt",
            "--n-samples-per-prompt", "2", "--rollout-batch-size", "4", "--max-response-len", "4",
            "--metrics", str(out.parent / "rollout.jsonl"), *extra]
    return CliRunner().invoke(main, args)


def test_too_many_failed_rewards_exit_3_and_write_nothing(builtin_engine, prompts, tmp_path):
    """Bug: a reward function that raised only marked its samples failed with reward 0.0 and the
    call exited 0, so a broken reward function silently produced a shard of zeros. Beyond
    --max-failed-rewards-frac (default 0.05) of the calls the stage now exits 3, writing
    nothing (no shard, no metrics line)."""
    out = tmp_path / "rollouts" / "step-000000"
    for extra in ([], ["--max-failed-rewards-frac", "0.2"]):
        result = rollout(builtin_engine, prompts, out, *extra)
        assert result.exit_code == 3, result.output
        assert "2 of 8 reward calls failed" in result.output
        assert "first: reward_error: " in result.output and "reward crashed" in result.output
        assert not out.exists() and not (out.parent / "rollout.jsonl").exists()


def test_failed_rewards_within_the_limit_are_written_as_failed(builtin_engine, prompts, tmp_path):
    """At exactly the limit the shard is written, the failed samples in it with status failed,
    reward 0.0 and the reason; the metrics count the calls."""
    out = tmp_path / "rollouts" / "step-000000"
    result = rollout(builtin_engine, prompts, out, "--max-failed-rewards-frac", "0.25")
    assert result.exit_code == 0, result.output
    rows = open_shard(out).rows()
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(rows) == 8 and len(failed) == 2
    assert all(r["reward"] == 0.0 and r["finish_reason"].startswith("reward_error") and
               r["prompt_id"] == "reverse-1-0" for r in failed)
    line = json.loads((out.parent / "rollout.jsonl").read_text())
    assert line["rollout/reward_calls"] == 8 and line["rollout/failed_rewards"] == 2
    assert line["rollout/failed_ratio"] == 0.25


def test_reward_that_needs_labels_is_refused_before_sampling(tmp_path, tiny_model_dir):
    """A label-based reward on a prompt without a label is bad input found before any request
    (exit 2, nothing written), not a run of failed reward calls."""
    rows = make_rows("reverse", num=3, seed=1)
    rows[1]["label"] = None
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "rollout", "--quiet", "--engines", "http://127.0.0.1:9", "--tokenizer", str(tiny_model_dir),
        "--prompts", str(prompts), "--out", str(out), "--reward", "reverse",
        "--rollout-batch-size", "2", "--max-response-len", "4"])
    assert result.exit_code == 2, result.output
    assert "needs a label" in result.output and "'reverse-1-1' (row 1)" in result.output
    assert not out.exists()


def test_every_sample_refused_by_the_engine_exits_3_and_writes_nothing(builtin_engine, prompts,
                                                                       tmp_path):
    """A --max-response-len past the model's context: the engine refuses every request, and the
    stage exits 3 naming the first refusal instead of writing a shard of failed samples."""
    out = tmp_path / "rollouts" / "step-000000"
    result = rollout(builtin_engine, prompts, out, "--max-response-len", "100000")
    assert result.exit_code == 3, result.output
    assert "all 8 samples failed at the engine at step 0" in result.output
    assert "context length" in result.output
    assert not out.exists() and not (out.parent / "rollout.jsonl").exists()
