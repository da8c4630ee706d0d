"""`rltool rollout --opd-teacher`: teacher engines score the sampled tokens (engine-mode
on-policy distillation); routes, mixes, and the refusals (another tokenizer, a route that names
no teacher) before anything is written."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rltool.cli import main
from rltool.data.shards import open_shard
from rltool.data.tasks import make_rows, write_prompts
from rltool.rundir import read_metrics
from rltool.train.stage import recompute_logprobs
from tests.helpers.weights import other_tokenizer_copy


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    rows = make_rows("reverse", num=4, seed=0)
    for k, r in enumerate(rows):
        r["metadata"] = {"task": "a" if k % 2 else "b"}
    return write_prompts(rows, tmp_path_factory.mktemp("opd") / "prompts.jsonl")


def _rollout(engine_url: str, prompts, out, *extra: str):
    return CliRunner().invoke(main, [
        "rollout", "--engines", engine_url, "--prompts", str(prompts), "--reward", "reverse",
        "--n-samples-per-prompt", "2", "--rollout-batch-size", "4", "--max-response-len", "6",
        "--temperature", "0.9", "--seed", "3", "--out", str(out), "-q", *extra])


def _rows(out):
    return [r for b in open_shard(out).iter_batches() for r in b.to_pylist()]


def test_teacher_logprobs_are_the_teachers_and_mixes_combine(builtin_engine, tiny_model_dir,
                                                            prompts, tmp_path):
    url = builtin_engine.url
    out = tmp_path / "rollouts" / "step-000000"
    result = _rollout(url, prompts, out, "--opd-teacher", url)
    assert result.exit_code == 0, result.output
    rows = _rows(out)
    # The teacher serves the student's weights: its logprobs are the trainer's recompute.
    expected = recompute_logprobs(tiny_model_dir, [out], max_tokens_per_microbatch=4096,
                                  deterministic=True)
    for row, lp in zip(rows, expected):
        assert len(row["teacher_logprobs"]) == len(row["response_token_ids"])
        assert row["teacher_logprobs"] == pytest.approx(lp, abs=1e-5)
    line = read_metrics(tmp_path / "rollouts" / "rollout.jsonl")[-1]
    assert abs(line["opd/reverse_kl"]) < 1e-3 and "opd/reverse_kl/teacher" in line

    routed = tmp_path / "routed" / "step-000000"
    result = _rollout(url, prompts, routed, "--opd-teacher", f"a={url}@1,b={url}@3",
                      "--opd-teacher-route", "task")
    assert result.exit_code == 0, result.output
    line = read_metrics(tmp_path / "routed" / "rollout.jsonl")[-1]
    assert {"opd/reverse_kl/a", "opd/reverse_kl/b", "opd/reverse_kl"} <= set(line)
    routed_rows = _rows(routed)
    for row, lp in zip(routed_rows, expected):  # same seed: the same samples
        assert row["teacher_logprobs"] == pytest.approx(lp, abs=1e-5)
    for name in ("a", "b"):
        mine = [r for r in routed_rows if json.loads(r["metadata"])["task"] == name]
        total = sum((x - y) * m for r in mine for x, y, m in
                    zip(r["rollout_logprobs"], r["teacher_logprobs"], r["loss_mask"]))
        count = sum(m for r in mine for m in r["loss_mask"])
        assert mine and line[f"opd/reverse_kl/{name}"] == pytest.approx(total / count, abs=1e-6)


def test_refusals_write_nothing(builtin_engine, tiny_model_dir, prompts, tmp_path):
    url = builtin_engine.url
    out = tmp_path / "r" / "step-000000"
    result = _rollout(url, prompts, out, "--opd-teacher", f"a={url}", "--opd-teacher-route",
                      "task")
    assert result.exit_code == 2
    assert "metadata task='b' names no teacher" in result.output
    assert not out.exists()


def test_a_teacher_engine_with_another_tokenizer_is_refused(builtin_engine, tiny_model_dir,
                                                           prompts, tmp_path):
    """The student's tokenizer (--tokenizer) differs from the one the teacher engine reports."""
    other = other_tokenizer_copy(tiny_model_dir, tmp_path / "other-tok")
    out = tmp_path / "r" / "step-000000"
    result = _rollout(builtin_engine.url, prompts, out, "--opd-teacher", builtin_engine.url,
                      "--tokenizer", str(other))
    assert result.exit_code == 2
    assert "its tokenizer" in result.output and "differs from the student's" in result.output
    assert not out.exists()
