"""`rltool plan --check-engine`: the hybrid-cache model against a live CPU engine serving the tiny
qwen3_5 hybrid with --max-total-tokens 2048, --max-running-requests 16 and
--mamba-full-memory-ratio 0.5 (a budget whose split leaves fewer slots than requests: the state
pool, not the request cap, sets K), behind an API key."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rltool.cli import main
from tests.helpers.hybrid import make_hybrid

pytestmark = pytest.mark.timeout(300)
KEY = "plan-check-key"
TOKENS, RUNNING, RATIO = 2048, 16, 0.5


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rltool.rollout.launch import start_engine

    root = tmp_path_factory.mktemp("plan-hybrid")
    model = make_hybrid(root / "m", task=None)
    proc = start_engine(["--engine", "builtin", "--model", str(model), "--device", "cpu",
                         "--disable-radix-cache", "--num-threads", "1", "--api-key", KEY,
                         "--max-total-tokens", str(TOKENS), "--max-running-requests",
                         str(RUNNING), "--mamba-full-memory-ratio", str(RATIO)],
                        log_path=root / "engine.log", ready_timeout_s=120.0)
    yield model, proc
    proc.stop()


def reference(config: dict) -> dict[str, float]:
    """c_A, c_R, the budget and its split written out from config.json (fp32 everywhere)."""
    attention = config["layer_types"].count("full_attention")
    linear = config["layer_types"].count("linear_attention")
    c_a = 2 * attention * config["num_key_value_heads"] * config["head_dim"] * 4
    conv = (2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
            + config["linear_num_value_heads"] * config["linear_value_head_dim"])
    c_r = linear * (config["linear_num_value_heads"] * config["linear_key_head_dim"]
                    * config["linear_value_head_dim"] * 4
                    + (config["linear_conv_kernel_dim"] - 1) * conv * 4)
    budget = TOKENS * c_a + RUNNING * c_r
    return {"c_A": c_a, "c_R": c_r, "N": min(TOKENS, budget / (1 + RATIO) // c_a),
            "K": min(RUNNING, RATIO * budget / (1 + RATIO) // c_r)}


def test_the_plan_predicts_what_the_engine_allocated(engine):
    model, proc = engine
    result = CliRunner().invoke(main, ["plan", "--check-engine", proc.url, "--api-key", KEY,
                                       "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["passed"] and out["ratio_r"] == RATIO
    rows = {r["prediction"].split(" ")[0]: r for r in out["checks"]}
    assert set(rows) == {"c_A", "c_R", "K", "N", "B_cache"}
    want = reference(json.loads((model / "config.json").read_text()))
    assert 1 < want["K"] < RUNNING  # the split, not the request cap, sets K
    for name in ("c_A", "c_R", "K", "N"):
        assert rows[name]["predicted"] == want[name], name
        assert abs(rows[name]["relative_error"]) <= 0.02, rows[name]
    assert rows["K"]["measured"] == want["K"] and rows["c_R"]["measured"] == want["c_R"]
    assert TOKENS * 0.98 <= rows["N"]["measured"] <= TOKENS  # whole pages, less the scratch one
    table = CliRunner().invoke(main, ["plan", "--check-engine", proc.url, "--api-key", KEY])
    assert table.exit_code == 0 and "K (state slots)" in table.output


def test_a_wrong_model_fails_the_check_and_a_missing_key_is_refused(engine, tmp_path):
    model, proc = engine
    config = json.loads((model / "config.json").read_text())
    config["linear_value_head_dim"] *= 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["plan", "--check-engine", proc.url, "--api-key", KEY,
                                       "--model", str(tmp_path), "--json"])
    assert result.exit_code == 1, result.output
    out = json.loads(result.output)
    failed = {r["prediction"].split(" ")[0] for r in out["checks"] if not r["within_tolerance"]}
    assert not out["passed"] and "c_R" in failed and "c_A" not in failed
    result = CliRunner().invoke(main, ["plan", "--check-engine", proc.url], env={
        "RLTOOL_API_KEY": ""})
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "--api-key" in result.output
