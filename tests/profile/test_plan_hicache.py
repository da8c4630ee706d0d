"""`rltool plan --check-engine URL --baseline-engine URL`: the HiCache model against two live CPU
engines (the `small` preset, a 768-token device pool, behind an API key), one with the host KV
tier and one without, after benchmarks/engine_hicache.py's quick multi-turn workload, whose
histories (6 conversations of up to 512 tokens) overflow the device pool."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from benchmarks.engine_hicache import QUICK, conversation_prompts, engine_args, run_workload
from rltool.cli import main

pytestmark = pytest.mark.timeout(300)
KEY = "plan-hicache-key"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from rltool.data.models import init_model
    from rltool.engine.model_spec import read_spec
    from rltool.rollout.client import EngineClient
    from rltool.rollout.launch import start_engine

    root = tmp_path_factory.mktemp("plan-hicache")
    model = init_model(root / "m", preset=QUICK.preset)
    procs = {}
    try:
        for role in ("baseline", "tiered"):
            procs[role] = start_engine(
                engine_args(model, QUICK, device="cpu", tiered=role == "tiered")
                + ["--api-key", KEY], log_path=root / f"{role}.log", ready_timeout_s=120.0)

        async def drive():
            clients = {r: EngineClient(p.url, api_key=KEY, max_retries=0)
                       for r, p in procs.items()}
            try:
                prompts = conversation_prompts(QUICK, vocab=read_spec(model).vocab_size, seed=2)
                await run_workload(clients, prompts, new_tokens=QUICK.new_tokens)
                return {r: await c.get_server_info() for r, c in clients.items()}
            finally:
                for c in clients.values():
                    await c.aclose()

        infos = asyncio.run(drive())
        yield model, {r: p.url for r, p in procs.items()}, infos
    finally:
        for p in procs.values():
            p.stop()


def check(urls, *extra):
    return CliRunner().invoke(main, ["plan", "--check-engine", urls["tiered"],
                                     "--baseline-engine", urls["baseline"], "--api-key", KEY,
                                     *extra])


def test_the_check_reports_the_model_from_the_engines_counters(engines):
    model, urls, infos = engines
    result = check(urls, "--json")
    out = json.loads(result.stdout)
    t, b = infos["tiered"]["hicache"], infos["baseline"]["hicache"]
    assert t["bytes_to_host"] > 0 and t["host_hit_tokens"] > 0  # the pool overflowed
    assert b["host_pages"] == 0 and b["host_hit_tokens"] == 0
    # The workload's requests and the /health_generate self-check each engine runs at start.
    assert t["requests"] == b["requests"] == QUICK.conversations * QUICK.turns + 1
    inputs = {q["name"]: q["value"] for q in out["inputs"]}
    assert inputs["hit_rate"] == t["host_hit_tokens"] / t["prompt_tokens"]
    tokens = t["prompt_tokens"] / t["requests"]
    assert inputs["prompt_tokens"] == tokens
    # The marginal cost of a prefilled token: a least-squares slope over both engines' forwards.
    n, x, y, xx, xy = (t[k] + b[k] for k in ("prefill_forwards", "prefill_tokens", "prefill_s",
                                             "prefill_tokens_sq", "prefill_token_s"))
    slope = (n * xy - x * y) / (n * xx - x * x)
    assert inputs["t_prefill_s"] == pytest.approx(tokens * slope, rel=1e-9)
    assert inputs["B_io_GBps"] == pytest.approx(t["bytes_to_device"] / t["io_to_device_s"] / 1e9)
    assert inputs["t_book_s"] == pytest.approx(t["book_s"] / t["requests"])
    config = json.loads((model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    c_a = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # fp32
    h = inputs["hit_rate"]
    want = (h * inputs["t_prefill_s"] - h * tokens * c_a / (inputs["B_io_GBps"] * 1e9)
            - inputs["t_book_s"])
    assert out["predicted"]["value"] == pytest.approx(want, rel=1e-9)
    assert out["measured"]["value"] == pytest.approx(b["ttft_mean_s"] - t["ttft_mean_s"])
    assert out["tolerance"] == 0.2
    assert out["passed"] == (abs(out["relative_error"]) <= 0.2)
    assert result.exit_code == (0 if out["passed"] else 1), result.output
    table = check(urls)
    assert table.exit_code == result.exit_code
    assert "B_io_GBps" in table.stdout and "dt_s measured" in table.stdout
    assert table.stderr.count("\n") == 1 and "hicache: predicted dt_s " in table.stderr


def test_a_wrong_bandwidth_fails_the_check_in_one_line(engines):
    _, urls, _ = engines
    result = check(urls, "--b-io-gbps", "1e-6")  # 1 kB/s: reloading would take minutes
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("Error: hicache: predicted dt_s -")
    assert "past the tolerance" in result.stderr
    wide = check(urls, "--b-io-gbps", "1e-6", "--tolerance", "1e12", "--json")
    assert wide.exit_code == 0, wide.output
    inputs = {q["name"]: q for q in json.loads(wide.stdout)["inputs"]}
    assert inputs["B_io_GBps"] == {"name": "B_io_GBps", "value": 1e-6, "source": "flag"}


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8"], "takes no input 'gpus'"),
    (["--tolerance", "-1"], "--tolerance -1"),
])
def test_bad_inputs_are_refused_in_one_line(engines, args, message):
    _, urls, _ = engines
    result = check(urls, *args)
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and message in result.output


def test_roles_are_checked(engines):
    _, urls, _ = engines
    swapped = check({"tiered": urls["baseline"], "baseline": urls["tiered"]})
    assert swapped.exit_code == 2 and "--enable-hierarchical-cache" in swapped.output
    alone = CliRunner().invoke(main, ["plan", "--baseline-engine", urls["baseline"]])
    assert alone.exit_code == 2 and "needs --check-engine" in alone.output
