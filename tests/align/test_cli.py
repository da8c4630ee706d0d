"""`rltool align-gate` through click's CliRunner: exit codes 0 / 1 / 2 and the output."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from rltool.cli import main
from tests.helpers.weights import copy_weights


def invoke(*args):
    return CliRunner().invoke(main, ["align-gate", *map(str, args)], catch_exceptions=False)


def test_aligned_run_passes_exactly(aligned_shard, tiny_model_dir, tmp_path):
    report = tmp_path / "gate.json"
    r = invoke("--rollouts", aligned_shard, "--weights", tiny_model_dir, "--deterministic",
               "--tol", "0", "--json", "--report", report)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["passed"] and out["train_rollout_logprob_abs_diff"] == 0.0
    assert out["max_abs_diff"] == 0.0 and out["num_samples"] == 8
    assert json.loads(report.read_text())["train_rollout_logprob_abs_diff"] == 0.0
    assert (tmp_path / "gate.config.toml").is_file()


def test_perturbed_weights_exit_1_and_layerwise_names_layer(aligned_shard, perturbed_weights,
                                                            align_engine):
    r = invoke("--rollouts", aligned_shard, "--weights", perturbed_weights, "--deterministic",
               "--layerwise", "--engine", align_engine.url)
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.stdout and "worst samples:" in r.stdout
    assert "first layer above tol: layers.1" in r.stdout


def test_config_file_and_flags(aligned_shard, tiny_model_dir, tmp_path):
    cfg = tmp_path / "gate.toml"
    cfg.write_text(f'[align]\nrollouts = ["{aligned_shard}"]\nweights = "{tiny_model_dir}"\n'
                   "deterministic = true\ntol = 0.0\n")
    r = invoke("--config", cfg, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["config"]["tol"] == 0.0


def test_bad_inputs_exit_2(aligned_shard, tiny_model_dir, tmp_path):
    r = invoke("--rollouts", tmp_path / "nope", "--weights", tiny_model_dir)
    assert r.exit_code == 2 and "no such shard directory" in r.output
    r = invoke("--rollouts", aligned_shard, "--weights", tmp_path / "nope")
    assert r.exit_code == 2 and "--weights" in r.output
    broken = tmp_path / "broken"
    shutil.copytree(aligned_shard, broken)
    next(broken.glob("part-*.parquet")).write_bytes(b"garbage")
    r = invoke("--rollouts", broken, "--weights", tiny_model_dir)
    assert r.exit_code == 2, r.output
    other_tok = copy_weights(tiny_model_dir, tmp_path / "tok")
    (other_tok / "chat_template.jinja").write_text("{{ messages }}")
    r = invoke("--rollouts", aligned_shard, "--weights", other_tok)
    assert r.exit_code == 2 and "tokenizer" in r.output.lower()
    v2 = copy_weights(tiny_model_dir, tmp_path / "weight_v000002", version=2)
    r = invoke("--rollouts", aligned_shard, "--weights", v2)
    assert r.exit_code == 2 and "--allow-version-mismatch" in r.output
    r = invoke("--rollouts", aligned_shard, "--weights", tiny_model_dir, "--layerwise")
    assert r.exit_code == 2 and "--engine" in r.output
    r = invoke("--weights", tiny_model_dir)
    assert r.exit_code == 2 and "--rollouts" in r.output


def test_version_mismatch_allowed(aligned_shard, tiny_model_dir, tmp_path):
    v2 = copy_weights(tiny_model_dir, tmp_path / "weight_v000002", version=2)
    r = invoke("--rollouts", aligned_shard, "--weights", v2, "--allow-version-mismatch",
               "--deterministic", "--tol", "0", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["weights_version"] == 2 and out["shard_versions"] == [0]


def test_engine_without_debug_endpoints_exit_2(aligned_shard, tiny_model_dir, builtin_engine):
    """Debug endpoints are off by default: the shared engine answers 404, the gate says how."""
    r = invoke("--rollouts", aligned_shard, "--weights", tiny_model_dir, "--layerwise",
               "--engine", builtin_engine.url)
    assert r.exit_code == 2 and "--enable-debug-endpoints" in r.output


def test_help_has_example():
    r = invoke("--help")
    assert r.exit_code == 0 and "Example:" in r.output and "--layerwise" in r.output
