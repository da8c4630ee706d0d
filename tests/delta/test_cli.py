"""`rltool delta diff|apply|verify|pull` through click's CliRunner: exit codes and output."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rltool.cli import main
from tests.helpers.checkpoints import load_all, make_weights, perturb, same_bits, write_checkpoint


@pytest.fixture
def pair(tmp_path):
    w0 = make_weights("bf16", seed=0)
    w1 = perturb(w0, lr=1e-3, seed=1)
    return (write_checkpoint(tmp_path / "weight_v000003", w0),
            write_checkpoint(tmp_path / "new", w1, version=4), w1)


def run(*args):
    return CliRunner().invoke(main, ["delta", *map(str, args)])


@pytest.mark.parametrize("fmt", ["rltool", "slime"])
def test_diff_apply_verify(tmp_path, pair, fmt):
    base, new, w1 = pair
    r = run("diff", "--base", base, "--new", new, "--out", tmp_path / "d", "--format", fmt,
            "--workers", 2, "--json")
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)
    assert stats["version"] == 4 and stats["base_version"] == 3 and stats["format"] == fmt
    r = run("verify", tmp_path / "d", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"]
    r = run("verify", tmp_path / "d", "--base", base, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["checked_checksums"]
    r = run("apply", "--base", base, "--delta", tmp_path / "d", "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert "version 4" in r.stderr
    assert same_bits(load_all(tmp_path / "o"), w1)
    r = run("verify", tmp_path / "o")
    assert r.exit_code == 0 and "(full): ok" in r.stderr


def test_verify_detects_corruption(tmp_path, pair):
    base, new, _ = pair
    assert run("diff", "--base", base, "--new", new, "--out", tmp_path / "d").exit_code == 0
    blob = tmp_path / "d/model-00001-of-00001.safetensors"
    data = bytearray(blob.read_bytes())
    data[-2] ^= 0x55
    blob.write_bytes(bytes(data))
    r = run("verify", tmp_path / "d", "--base", base, "--json")
    assert r.exit_code == 1 and not json.loads(r.stdout)["ok"]
    assert json.loads(r.stdout)["problems"]
    r = run("apply", "--base", base, "--delta", tmp_path / "d", "--out", tmp_path / "o")
    assert r.exit_code == 2 and r.stderr.startswith("Error: ")
    assert not (tmp_path / "o").exists()


def test_bad_input_exit_2(tmp_path, pair):
    base, new, _ = pair
    r = run("verify", tmp_path / "nope")
    assert r.exit_code == 2
    plain = write_checkpoint(tmp_path / "plain", make_weights("bf16", seed=0))
    r = run("diff", "--base", plain, "--new", tmp_path / "plain", "--out", tmp_path / "d")
    assert r.exit_code == 2 and "--base-version" in r.stderr
    r = run("diff", "--base", base, "--new", new, "--out", tmp_path / "d", "--encoding",
            "overwrite")
    assert r.exit_code == 2 and "--format slime" in r.stderr
    assert not (tmp_path / "d").exists()


def test_diff_config_file_and_pull(tmp_path, pair):
    base, new, w1 = pair
    cfg = tmp_path / "delta.toml"
    cfg.write_text(f'[delta]\nbase = "{base}"\nnew = "{new}"\nformat = "slime"\n'
                   'encoding = "overwrite"\n')
    source = tmp_path / "weights"
    r = run("diff", "--config", cfg, "--out", source / "weight_v000004", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["encoding"] == "overwrite"
    (source / "weight_v000003").symlink_to(base, target_is_directory=True)
    r = run("pull", "--local", tmp_path / "local", "--source", source, "--version", 4, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["deltas_applied"] == [4]
    assert same_bits(load_all(tmp_path / "local"), w1)
    r = run("pull", "--local", tmp_path / "local", "--source", source, "--version", 4)
    assert r.exit_code == 0 and "already there" in r.stderr
    r = run("pull", "--local", tmp_path / "local", "--source", source, "--version", 9)
    assert r.exit_code == 2 and "missing link" in r.stderr
