"""`rltool loop` / `rltool report` bad input: exit 2, one line, nothing written."""

from __future__ import annotations

import tomli_w
from click.testing import CliRunner

from rltool.cli import main as cli
from tests.loop.test_config import tables


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


def test_loop_needs_a_config_or_resume(tmp_path):
    result = invoke("loop", "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and "needs --config" in result.output
    assert not (tmp_path / "run").exists()


def test_loop_bad_config_writes_nothing(tiny_model_dir, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(tables(tiny_model_dir, train__lr=-1.0)))
    result = invoke("loop", "--config", str(config), "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and "--lr (in [train])" in result.output
    assert not (tmp_path / "run").exists()
    config.write_text(tomli_w.dumps(tables(tiny_model_dir)))
    result = invoke("loop", "--config", str(config), "--run-dir", str(tmp_path / "run"),
                    "--set", "nope.x=1")
    assert result.exit_code == 2 and "unknown table" in result.output
    result = invoke("loop", "--config", str(config), "--run-dir", str(tmp_path / "run"),
                    "--placement", "moon")
    assert result.exit_code == 2
    assert not (tmp_path / "run").exists()


def test_loop_refuses_an_existing_run(tiny_model_dir, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(tables(tiny_model_dir)))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").write_text("{}")
    result = invoke("loop", "--config", str(config), "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and "--resume" in result.output
    result = invoke("loop", "--resume", str(tmp_path / "run"), "--config", str(config))
    assert result.exit_code == 2 and "drop --config" in result.output
    result = invoke("loop", "--resume", str(tmp_path / "empty"))
    assert result.exit_code == 2 and "no config.toml" in result.output


def test_report_needs_loop_metrics(tmp_path):
    result = invoke("report", str(tmp_path))
    assert result.exit_code == 2 and "no loop metrics" in result.output


def test_report_on_a_row_missing_a_field_is_one_line(tmp_path):
    """Bug: `rltool report` on a metrics file whose row lacked `policy_version` (or had text where
    a number belongs) died with a KeyError/ValueError traceback ("unexpected internal failure",
    exit 3). It now names the file, row and field in one line and exits 2, writing nothing."""
    import json

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    good = {"step": 0, "policy_version": 1, "time": 1.0, "rollout/raw_reward": 0.5}
    cases = [("loop", [good, {"step": 1, "time": 2.0}], "row 2 has no 'policy_version'"),
             ("loop", [{**good, "step": "0"}], "row 1 has a non-integer 'step'"),
             ("train", [{"policy_version": 1, "train/ppo_kl": 0.1}], "row 1 has no 'step'"),
             ("train", [{**good, "rollout_step": "x"}], "non-integer 'rollout_step'")]
    for stage, rows, message in cases:
        (metrics / "loop.jsonl").write_text(json.dumps(good) + "\n")
        (metrics / "train.jsonl").unlink(missing_ok=True)
        (metrics / f"{stage}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        result = invoke("report", str(tmp_path))
        assert result.exit_code == 2, (stage, result.output)
        assert message in result.output and f"{stage}.jsonl" in result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
        assert not (tmp_path / "report").exists()
    # text in a metric value is not plotted, not a crash
    (metrics / "loop.jsonl").write_text(json.dumps({**good, "perf/loop/train_time": "n/a"}) + "\n")
    (metrics / "train.jsonl").write_text(json.dumps({**good, "train/ppo_kl": "n/a"}) + "\n"
                                         + json.dumps({**good, "policy_version": 2,
                                                       "train/ppo_kl": 0.5}) + "\n")
    result = invoke("report", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output


def test_loop_bad_prompts_write_nothing(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "reverse 12", "answer": "21"}\n')
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(tables(tiny_model_dir, rollout__prompts=str(bad))))
    result = invoke("loop", "--config", str(config), "--run-dir", str(tmp_path / "run"))
    assert result.exit_code == 2 and "--prompts" in result.output, result.output
    assert not (tmp_path / "run").exists()
    # --resume --set: the overrides are checked before they are saved to config.toml
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "reverse 12", "label": "21"}\n')
    (tmp_path / "run").mkdir()
    saved = tomli_w.dumps(tables(tiny_model_dir, rollout__prompts=str(good)))
    (tmp_path / "run" / "config.toml").write_text(saved)
    result = invoke("loop", "--resume", str(tmp_path / "run"), "--set",
                    f"rollout.prompts={bad}")
    assert result.exit_code == 2 and "--prompts" in result.output, result.output
    assert (tmp_path / "run" / "config.toml").read_text() == saved
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.toml"]
