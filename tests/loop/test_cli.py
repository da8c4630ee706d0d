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
