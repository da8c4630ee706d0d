"""Stage config resolution: TOML table + explicit flags (flags win), strict keys, resolved TOML."""

from __future__ import annotations

import tomllib

import click
import pytest
from click.testing import CliRunner
from pydantic import Field, ValidationError

from rltool.commands.options import build_config, command_options, stage_options
from rltool.config import StageConfig, resolve, write_resolved
from rltool.errors import ConfigError


class RolloutLike(StageConfig):
    n_samples_per_prompt: int = Field(4, gt=0, description="Samples per prompt.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    reward: str = Field("exact", description="Reward spec.")


def _toml(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_flags_win_over_the_stage_table(tmp_path):
    f = _toml(tmp_path, "[rollout]\nn_samples_per_prompt = 8\ntemperature = 0.7\n"
                        "[train]\nlr = 1e-6\n")
    cfg = resolve(RolloutLike, config_file=f, section="rollout", flags={"temperature": 0.3})
    assert cfg == RolloutLike(n_samples_per_prompt=8, temperature=0.3, reward="exact")
    # a flag that was not given (None) does not mask the file
    cfg = resolve(RolloutLike, config_file=f, section="rollout", flags={"temperature": None})
    assert cfg.temperature == 0.7


def test_top_level_keys_when_the_file_has_no_stage_table(tmp_path):
    """Bug: a loop config without this stage's table used the whole file, so the other stages'
    tables ([train], ...) were reported as unknown keys."""
    f = _toml(tmp_path, "temperature = 0.5\n[train]\nlr = 1e-6\n[loop]\nsteps = 3\n")
    assert resolve(RolloutLike, config_file=f, section="rollout", flags={}).temperature == 0.5


def test_no_file_uses_defaults_and_flags():
    cfg = resolve(RolloutLike, config_file=None, section="rollout", flags={"reward": "math"})
    assert cfg == RolloutLike(reward="math")


def test_unknown_key_is_an_error_naming_the_key(tmp_path):
    f = _toml(tmp_path, "[rollout]\nn_sampels_per_prompt = 8\n")
    with pytest.raises(ConfigError, match=r"--n-sampels-per-prompt \(in \[rollout\]\): unknown key "
                                          r"'n_sampels_per_prompt'"):
        resolve(RolloutLike, config_file=f, section="rollout", flags={})


def test_invalid_values_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--n-samples-per-prompt: Input should be greater than 0"):
        resolve(RolloutLike, config_file=None, section=None, flags={"n_samples_per_prompt": 0})
    f = _toml(tmp_path, "[rollout]\ntemperature = 'hot'\n")
    with pytest.raises(ConfigError, match="--temperature"):
        resolve(RolloutLike, config_file=f, section="rollout", flags={})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(RolloutLike, config_file=tmp_path / "missing.toml", section="rollout", flags={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(RolloutLike, config_file=_toml(tmp_path, "[rollout\n"), section="rollout",
                flags={})


def test_models_are_strict_on_assignment():
    cfg = RolloutLike()
    with pytest.raises(ValidationError, match="temperature"):
        cfg.temperature = -1.0


def test_write_resolved_round_trips(tmp_path):
    cfg = RolloutLike(temperature=0.25)
    write_resolved(cfg, tmp_path / "out" / "rollout.toml")
    data = tomllib.loads((tmp_path / "out" / "rollout.toml").read_text())
    assert RolloutLike(**data) == cfg


def test_explicit_flags_through_click(tmp_path):
    """A default must not mask the file's value; only options the user typed win."""
    f = _toml(tmp_path, "[rollout]\ntemperature = 0.7\nn_samples_per_prompt = 2\n")
    seen = {}

    @click.command()
    @stage_options(RolloutLike, table="rollout")
    @command_options("config")
    def cmd(**_):
        seen["cfg"] = build_config(RolloutLike, table="rollout")

    result = CliRunner().invoke(cmd, ["--config", str(f), "--n-samples-per-prompt", "16"])
    assert result.exit_code == 0, result.output
    assert seen["cfg"] == RolloutLike(temperature=0.7, n_samples_per_prompt=16)
