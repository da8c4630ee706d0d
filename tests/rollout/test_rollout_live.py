"""`rltool rollout` against live builtin engines: shard correctness, routing stickiness, an engine
killed mid-run, dynamic filtering counts, partial rollout, multi-turn token continuity, bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from rltool.cli import main
from rltool.data.shards import open_shard
from rltool.data.tasks import make_rows, write_prompts
from rltool.data.tokenizer import tokenizer_hash
from rltool.rollout.calculator import multi_turn
from rltool.rollout.generate import STATUS_BY_FINISH, finish_label
from rltool.rollout.rewards import RewardResult
from rltool.rundir import read_metrics

HERE = "tests.rollout.test_rollout_live"
TOOL_TEXT = " = 7\n"


# ----- functions the tests pass as --reward / --generate-fn (module:function) -------------------

def coin_reward(prompt, response, label, metadata):
    """0 or 1 from a hash of the response: groups usually disagree, sometimes not."""
    return RewardResult(reward=float(zlib.crc32(response.encode()) % 2))


def odd_label_constant_reward(prompt, response, label, metadata):
    """Prompts whose label starts with an odd digit always get 1.0 (a zero-std group)."""
    if int(label[0]) % 2:
        return RewardResult(reward=1.0)
    return coin_reward(prompt, response, label, metadata)


def distinct_reward(prompt, response, label, metadata):
    """Different responses (almost surely) get different rewards: no group is filtered."""
    return RewardResult(reward=float(zlib.crc32(response.encode()) % 1000))


async def short_batch_generate(sample, ctx):
    """Groups 0 and 1 (the batch) answer in 2 tokens; the others must run their whole budget
    (ignore_eos), so they are surely mid-generation when the batch fills and get aborted. The
    short ones start only once the engine has produced a token, all of it for the long ones, so
    at least one aborted sample carries tokens however slowly the machine runs."""
    short = sample.group_id < 2
    if short:
        await asyncio.wait_for(_first_token(ctx.client.router.engines[0].client), 60)
    params = ctx.sampling_params(max_new_tokens=2 if short else ctx.sampling["max_response_len"],
                                 sample=sample, ignore_eos=not short)
    response = await ctx.client.generate({"input_ids": sample.tokens, "return_logprob": True,
                                          "sampling_params": params})
    finish = sample.append_engine_output(response)
    sample.status, sample.finish_reason = STATUS_BY_FINISH[finish], finish_label(finish, response)
    return sample


async def _first_token(engine_client):
    while not _output_tokens(await engine_client.get_server_info()):
        await asyncio.sleep(0.02)


def _output_tokens(info):
    return info["internal_states"][0]["total_output_tokens"]


class RecordingClient:
    def __init__(self, inner):
        self.inner, self.inputs, self.outputs = inner, [], []

    async def generate(self, payload, *, sticky=False):
        self.inputs.append(list(payload["input_ids"]))
        response = await self.inner.generate(payload, sticky=sticky)
        self.outputs.append(list(response["output_ids"]))
        return response


async def recorded_multi_turn(sample, ctx):
    """Three forced turns (3 tokens each) with a fixed observation after each; records what was
    sent, and what a text-re-templating implementation would have sent at turn 2."""
    recorder = RecordingClient(ctx.client)
    rctx = dataclasses.replace(ctx, client=recorder)
    out = await multi_turn(sample, rctx, tool=lambda text, finish: TOOL_TEXT, max_turns=3,
                           turn_max_new_tokens=3)
    tok = ctx.tokenizer
    # A template drift of the kind real chat templates have (Qwen3 rewrites earlier assistant
    # turns): this one trims their content, so the tool output's trailing newline would vanish.
    drifted = tok.chat_template.replace("message['content']", "(message['content'] | trim)")
    assert drifted != tok.chat_template
    so_far = tok.decode(recorder.outputs[0], skip_special_tokens=True)
    messages = sample.prompt_row.messages + [{"role": "assistant", "content": so_far + TOOL_TEXT}]
    retemplated = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                                     chat_template=drifted),
                             add_special_tokens=False)
    out.metadata.update(turn_inputs=recorder.inputs, turn_outputs=recorder.outputs,
                        retemplated=retemplated)
    return out


# ----- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "reverse.jsonl"
    write_prompts(make_rows("reverse", num=10, seed=1), path)
    return path


@pytest.fixture(scope="module")
def engine_b(tiny_model_dir, tmp_path_factory):
    """A second engine over the same weights that reports weight_version 5, so every token says
    which engine produced it."""
    from rltool.rollout.launch import start_engine

    log = tmp_path_factory.mktemp("engine-b") / "engine.log"
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir),
                         "--weight-version", "5"], log_path=log, ready_timeout_s=120.0)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def rollout(args):
    result = CliRunner().invoke(main, ["rollout", "--quiet", *map(str, args)])
    return result


def rows_by_group(shard_dir):
    groups = {}
    for row in open_shard(shard_dir).rows():
        groups.setdefault(row["group_id"], []).append(row)
    return groups


# ----- tests ---------------------------------------------------------------------------------

def test_rollout_writes_grouped_shard_with_engine_logprobs(builtin_engine, prompts, tiny_model_dir,
                                                           tok, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "rollouts" / "step-000001"
    args = ["--engines", builtin_engine.url, "--prompts", prompts, "--out", out, "--reward",
            "reverse", "--n-samples-per-prompt", 3, "--rollout-batch-size", 4,
            "--max-response-len", 12, "--step", 1, "--seed", 7, "--json"]
    result = rollout(args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["rows"] == 12 and summary["groups"] == 4

    shard = open_shard(out, expected_tokenizer_hash=tokenizer_hash(tiny_model_dir))
    assert shard.meta.step == 1 and shard.meta.producer == "rltool rollout"
    assert shard.meta.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                   "max_response_len": 12, "n_samples_per_prompt": 3, "seed": 7}
    assert shard.meta.extra["engine_precision"] == {builtin_engine.url: {"device": "cpu",
                                                                         "dtype": "fp32"}}
    file_rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    groups = rows_by_group(out)
    assert sorted(groups) == [4, 5, 6, 7]  # step 1 x batch 4 -> stream positions 4..7
    for gid, rows in groups.items():
        want = file_rows[gid]
        text = tok.apply_chat_template([{"role": "user", "content": want["prompt"]}],
                                       tokenize=False, add_generation_prompt=True)
        assert sorted(r["sample_index"] for r in rows) == [0, 1, 2]
        for r in rows:
            n = len(r["response_token_ids"])
            assert r["prompt_id"] == want["prompt_id"] and r["label"] == want["label"]
            assert r["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
            assert 1 <= n <= 12
            assert r["loss_mask"] == [1] * n and r["weight_versions"] == [0] * n
            assert len(r["rollout_logprobs"]) == n and all(lp <= 0 for lp in r["rollout_logprobs"])
            ended_on_eos = r["response_token_ids"][-1] == tok.eos_token_id
            assert r["status"] == ("completed" if ended_on_eos else "truncated")
            answer = r["response"].split("\n", 1)[0].strip()
            assert r["reward"] == (1.0 if answer == want["label"] else 0.0)

    # The rollout logprobs are the model's: recompute two samples in float64 with one forward.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64)
    for r in [groups[4][0], groups[7][2]]:
        ids = torch.tensor([r["prompt_token_ids"] + r["response_token_ids"]])
        logits = model(input_ids=ids).logits[0]
        start = len(r["prompt_token_ids"])
        for i, token in enumerate(r["response_token_ids"]):
            ref = torch.log_softmax(logits[start + i - 1], dim=-1)[token].item()
            assert abs(ref - r["rollout_logprobs"][i]) < 2e-3

    (line,) = read_metrics(out.parent / "rollout.jsonl")
    assert line["step"] == 1 and line["policy_version"] == 0
    assert line["rollout/num_samples"] == 12
    lengths = [len(r["response_token_ids"]) for rows in groups.values() for r in rows]
    assert line["rollout/response_len/mean"] == pytest.approx(sum(lengths) / 12)
    truncated = sum(r["status"] == "truncated" for rows in groups.values() for r in rows)
    assert line["rollout/truncated_ratio"] == pytest.approx(truncated / 12)
    for name in ("rollout/raw_reward", "perf/rollout_time", "perf/tokens_per_sec"):
        assert name in line
    assert (out / "rollout_config.toml").exists()

    again = rollout(args)
    assert again.exit_code == 2 and "already exists" in again.output


def test_prompt_positions_cycle_over_the_file(builtin_engine, prompts, tmp_path):
    out = tmp_path / "step-000003"
    config = tmp_path / "run.toml"
    config.write_text(f"""[train]\nlr = 1.0\n\n[rollout]\nengines = ["{builtin_engine.url}"]
prompts = "{prompts}"\nreward = "reverse"\nn_samples_per_prompt = 1\nrollout_batch_size = 3
max_response_len = 2\nstep = 99\n""")
    result = rollout(["--config", config, "--out", out, "--step", 3])  # the flag wins
    assert result.exit_code == 0, result.output
    assert 'step = 3' in (out / "rollout_config.toml").read_text()
    groups = rows_by_group(out)
    assert sorted(groups) == [9, 10, 11]
    assert [groups[g][0]["prompt_id"] for g in (9, 10, 11)] == ["reverse-1-9", "reverse-1-0",
                                                                "reverse-1-1"]


@pytest.mark.parametrize("name,content,message", [
    ("missing.jsonl", None, "no such file"),
    ("bad.jsonl", '{"prompt": "a"}\n{not json\n', "line 2 is not valid JSON"),
    ("noprompt.jsonl", '{"text": "a"}\n', "has no 'prompt' field"),
    ("empty.jsonl", "\n", "holds no prompts"),
    ("dupe.jsonl", '{"prompt": "a", "prompt_id": "x"}\n{"prompt": "b", "prompt_id": "x"}\n',
     "share prompt_id"),
    ("chat.jsonl", '{"prompt": [{"role": "user"}]}\n', "list of"),
    ("prompts.csv", "prompt\na\n", "unknown file type"),
    ("broken.parquet", "not parquet", "not a readable Parquet file"),
])
def test_bad_prompt_files_exit_2_and_write_nothing(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    out = tmp_path / "runs" / "step-000000"
    result = rollout(["--engines", "http://127.0.0.1:9", "--prompts", path, "--out", out,
                      "--reward", "reverse", "--rollout-batch-size", 2, "--max-response-len", 4])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "runs").exists()


def test_bad_config_file_exits_2(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[rollout]\nrollout_batch_size = 0\nbogus = 1\n')
    result = rollout(["--config", config])
    assert result.exit_code == 2
    assert "--rollout-batch-size" in result.output and "--bogus" in result.output


@pytest.mark.parametrize("extra,message", [
    (["--n-samples-per-prompt", 1, "--filter", "all-equal-reward"], "needs --n-samples-per-prompt"),
    (["--router", "http://127.0.0.1:9"], "exactly one of"),
    (["--top-p", 0], "--top-p"),
    (["--reward", "nonsense"], "names no reward"),
    (["--generate-fn", "json:nothing_here"], "has no attribute"),
])
def test_bad_flags_exit_2(prompts, tmp_path, extra, message):
    result = rollout(["--engines", "http://127.0.0.1:9", "--prompts", prompts, "--out",
                      tmp_path / "o", "--reward", "reverse", "--rollout-batch-size", 2,
                      "--max-response-len", 4, *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_dynamic_filter_counts(builtin_engine, prompts, tmp_path):
    from rltool.rollout.stage import RolloutConfig, run

    cfg = RolloutConfig(engines=[builtin_engine.url], prompts=str(prompts),
                        out=str(tmp_path / "step-000000"), n_samples_per_prompt=3,
                        rollout_batch_size=3, max_response_len=6, max_prompts=10,
                        reward=f"{HERE}:odd_label_constant_reward", filter="all-equal-reward",
                        quiet=True)
    result = run(cfg)
    groups = rows_by_group(cfg.out)
    c, m = result["counts"], result["metrics"]
    assert len(groups) == result["groups"] <= 3
    for rows in groups.values():
        assert len({r["reward"] for r in rows}) > 1 and int(rows[0]["label"][0]) % 2 == 0
    assert c["dropped_equal_reward"] >= 1
    assert c["fresh_groups"] == (len(groups) + c["dropped_equal_reward"] + c["over_sampled_groups"]
                                 + c["aborted_extra_groups"])
    (line,) = read_metrics(Path(cfg.out).parent / "rollout.jsonl")
    assert line["rollout/dynamic_filter/drop_zero_std"] == c["dropped_equal_reward"]
    assert line["rollout/dynamic_filter/prompts_started"] == c["fresh_groups"]
    assert m["rollout/zero_std/count"] == 0


def test_partial_rollout_carries_aborted_samples_to_the_next_step(tiny_model_dir, engine_b,
                                                                  prompts, tmp_path):
    """Step 0 over-samples on its own engine and aborts the extra groups mid-generation
    (/abort_request); step 1 resumes them on engine_b (version 5) from their tokens."""
    import pyarrow.parquet as pq

    from rltool.rollout.launch import start_engine
    from rltool.rollout.stage import RolloutConfig, run

    common = dict(prompts=str(prompts), n_samples_per_prompt=2, rollout_batch_size=2,
                  max_response_len=100, reward=f"{HERE}:distinct_reward", partial=True,
                  quiet=True, concurrency=16)
    own = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir)],
                       log_path=tmp_path / "engine.log", ready_timeout_s=120.0)
    try:
        step0 = run(RolloutConfig(engines=[own.url], out=str(tmp_path / "step-000000"),
                                  filter="all-equal-reward", over_sample_factor=3.0,
                                  max_prompts=6, generate_fn=f"{HERE}:short_batch_generate",
                                  **common))
    finally:
        own.stop()
    carry_file = tmp_path / "partial" / "step-000000.parquet"
    assert step0["carried_to"] == str(carry_file) and carry_file.exists()
    carried = step0["counts"]["carried_out_groups"]
    assert carried >= 1, step0["counts"]
    before = {r["uid"]: r for r in pq.read_table(carry_file).to_pylist()}
    aborted = [uid for uid, r in before.items() if r["status"] == "aborted"]
    assert aborted and any(before[uid]["response_token_ids"] for uid in aborted)

    # A batch that holds every carried group: nothing is aborted on engine_b (its /abort_request
    # path is not exercised twice).
    step1 = run(RolloutConfig(engines=[engine_b.url], out=str(tmp_path / "step-000001"), step=1,
                              **{**common, "rollout_batch_size": carried}))
    assert step1["carried_from"] == str(carry_file)
    assert step1["counts"]["carried_in_groups"] == carried
    after = {r["uid"]: r for r in open_shard(tmp_path / "step-000001").rows()}
    after.update({r["uid"]: r for r in
                  pq.read_table(tmp_path / "partial" / "step-000001.parquet").to_pylist()})
    for uid, old in before.items():
        new = after[uid]  # nothing carried over was lost
        prefix = old["response_token_ids"]
        assert new["response_token_ids"][:len(prefix)] == prefix
        assert new["rollout_logprobs"][:len(prefix)] == old["rollout_logprobs"]
        if old["status"] != "aborted":
            assert new["response_token_ids"] == prefix
        else:
            assert new["status"] in ("completed", "truncated")
            n = len(new["response_token_ids"])
            # One response, two policy versions: the old tokens keep theirs, the rest are 5.
            assert new["weight_versions"] == [0] * len(prefix) + [5] * (n - len(prefix))


def test_multi_turn_is_token_continuous_masked_and_sticky(builtin_engine, engine_b, prompts, tok,
                                                          tmp_path):
    out = tmp_path / "step-000000"
    result = rollout(["--engines", f"{builtin_engine.url},{engine_b.url}", "--prompts", prompts,
                      "--out", out, "--reward", "reverse", "--n-samples-per-prompt", 3,
                      "--rollout-batch-size", 4, "--max-response-len", 40,
                      "--generate-fn", f"{HERE}:recorded_multi_turn"])
    assert result.exit_code == 0, result.output
    check_multi_turn_shard(out, tok)


def check_multi_turn_shard(out, tok):
    tool_ids = tok.encode(TOOL_TEXT, add_special_tokens=False)
    rows = open_shard(out).rows()
    versions_used, drifted = set(), 0
    for r in rows:
        meta = json.loads(r["metadata"])
        assert "turn_inputs" in meta, (r["status"], r["finish_reason"])
        inputs, outputs = meta["turn_inputs"], meta["turn_outputs"]
        assert inputs[0] == r["prompt_token_ids"]
        assert len(inputs) == len(outputs) == 3 and r["finish_reason"] == "max_turns"
        for k in range(2):
            # The next turn is exactly the previous input + the model's tokens + the tool's.
            assert inputs[k + 1] == inputs[k] + outputs[k] + tool_ids
        assert r["prompt_token_ids"] + r["response_token_ids"] == inputs[2] + outputs[2] + tool_ids
        assert r["loss_mask"] == [m for out_k in outputs
                                  for m in [1] * len(out_k) + [0] * len(tool_ids)]
        model_versions = {v for v, m in zip(r["weight_versions"], r["loss_mask"]) if m}
        tool_versions = {v for v, m in zip(r["weight_versions"], r["loss_mask"]) if not m}
        assert len(model_versions) == 1  # every turn of the session ran on one engine
        assert tool_versions <= {-1}
        assert all(lp == 0.0 for lp, m in zip(r["rollout_logprobs"], r["loss_mask"]) if not m)
        versions_used |= model_versions
        # Re-templating the text would have changed tokens the model already conditioned on.
        drifted += meta["retemplated"][:len(inputs[1])] != inputs[1]
    assert versions_used == {0, 5}  # sessions spread over both engines
    assert drifted == len(rows)


@pytest.fixture(scope="module")
def gateway(builtin_engine, engine_b, tmp_path_factory):
    """The real smg gateway over both engines with consistent hashing, ended by PID."""
    import sys

    from rltool.supervisor import free_port, start

    port, metrics_port = free_port(), free_port()
    smg = Path(sys.executable).parent / "smg"
    proc = start([str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
                  "--worker-urls", builtin_engine.url, engine_b.url,
                  "--policy", "consistent_hashing", "--prometheus-host", "127.0.0.1",
                  "--prometheus-port", str(metrics_port)],
                 log_path=tmp_path_factory.mktemp("smg") / "smg.log", name="smg gateway")
    url = f"http://127.0.0.1:{port}"

    def both_registered() -> bool:
        try:
            workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return sum(w["is_healthy"] for w in workers) == 2

    try:
        proc.wait_until(both_registered, timeout_s=60, what="registering both engines",
                        poll_s=0.2)
        yield url
    finally:
        proc.stop()


def test_router_flag_through_smg_gateway_keeps_sessions_sticky(gateway, prompts, tok, tmp_path):
    out = tmp_path / "step-000000"
    # No --tokenizer: it comes from the gateway's /get_model_info.
    result = rollout(["--router", gateway, "--prompts", prompts, "--out", out, "--reward",
                      "reverse", "--n-samples-per-prompt", 3, "--rollout-batch-size", 4,
                      "--max-response-len", 40, "--generate-fn", f"{HERE}:recorded_multi_turn"])
    assert result.exit_code == 0, result.output
    check_multi_turn_shard(out, tok)



def test_eval_metrics_on_stdout_and_in_eval_jsonl(builtin_engine, prompts, tmp_path):
    import math

    out = tmp_path / "eval" / "step-000000"
    result = CliRunner().invoke(main, [
        "eval", "--quiet", "--engines", builtin_engine.url, "--prompts", str(prompts),
        "--n-samples-per-prompt", "3", "--max-prompts", "5", "--max-response-len", "6",
        "--reward", f"{HERE}:coin_reward", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    groups = rows_by_group(out)
    assert len(groups) == 5
    p1, pk = [], []
    for rows in groups.values():
        n, c = len(rows), sum(r["reward"] >= 1.0 for r in rows)
        p1.append(c / n)
        fail_all = 1.0
        for i in range(3):  # P(all k=3 draws without replacement fail), k = n
            fail_all *= (n - c - i) / (n - i)
        pk.append(1.0 - max(fail_all, 0.0))
    assert metrics["eval/pass@1"] == pytest.approx(sum(p1) / 5)
    assert metrics["eval/pass@k"] == pytest.approx(sum(pk) / 5)
    assert metrics["eval/k"] == 3
    rewards = [r["reward"] for rows in groups.values() for r in rows]
    assert metrics["eval/mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
    (line,) = read_metrics(out.parent / "eval.jsonl")
    assert line["eval/pass@k"] == metrics["eval/pass@k"] and not math.isnan(line["time"])


def _poll(url, done, timeout_s=60.0):
    """The first /get_server_info answer for which `done` holds (None after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/get_server_info", timeout=5).json()
        if done(info):
            return info
        time.sleep(0.02)
    return None


def test_engine_killed_mid_run_loses_no_sample(builtin_engine, engine_b, prompts, tmp_path):
    """Runs last in this module: it SIGKILLs engine_b."""
    from rltool.rollout.stage import RolloutConfig, run

    victim = engine_b
    try:
        cfg = RolloutConfig(engines=[builtin_engine.url, victim.url], prompts=str(prompts),
                            out=str(tmp_path / "step-000000"), reward="reverse",
                            n_samples_per_prompt=4, rollout_batch_size=6, max_response_len=64,
                            concurrency=8, quiet=True)
        # Paused in place, it takes requests and finishes none: the kill surely finds some.
        assert httpx.post(f"{victim.url}/pause_generation", json={"mode": "in_place"},
                          timeout=5).status_code == 200
        box = {}
        thread = threading.Thread(target=lambda: box.update(result=run(cfg)))
        thread.start()
        assert _poll(victim.url, lambda info: info["internal_states"][0]["num_running_reqs"]
                     + info["internal_states"][0]["num_waiting_reqs"] > 0) is not None
        os.kill(victim.pid, signal.SIGKILL)
        thread.join(timeout=120)
        assert not thread.is_alive()
    finally:
        victim.stop()
    result = box["result"]
    assert result["engines"][victim.url]["alive"] is False
    assert result["metrics"]["rollout/redispatched_requests"] >= 1
    rows = open_shard(cfg.out).rows()
    assert len(rows) == 24
    assert sorted((r["group_id"], r["sample_index"]) for r in rows) == [
        (g, i) for g in range(6) for i in range(4)]
    assert {r["status"] for r in rows} <= {"completed", "truncated"}
    # Every request the victim held went to the other engine, and only the tokens from there count.
    assert all(json.loads(r["metadata"])["engines"] == [builtin_engine.url] for r in rows)


def test_unreachable_engines_exit_3_and_write_nothing(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "rollouts" / "step-000000"
    result = rollout(["--engines", "http://127.0.0.1:9", "--prompts", prompts, "--out", out,
                      "--tokenizer", tiny_model_dir, "--reward", "reverse",
                      "--rollout-batch-size", 2, "--max-response-len", 4])
    assert result.exit_code == 3, result.output
    assert "every engine died" in result.output
    assert not out.exists() and not (out.parent / "rollout.jsonl").exists()


def test_groups_differ_on_a_deterministic_engine_without_a_seed(det_engine, prompts, tmp_path):
    """Regression: without --seed no sampling_seed was sent, so a deterministic engine seeded every
    request with 42 and the samples of a group were identical (zero GRPO advantage)."""
    out = tmp_path / "shard"
    result = rollout(["--engines", det_engine.url, "--prompts", prompts, "--out", out,
                      "--n-samples-per-prompt", 4, "--rollout-batch-size", 2, "--reward", "reverse",
                      "--max-response-len", 12, "--temperature", 1.0])
    assert result.exit_code == 0, result.output
    for group in rows_by_group(out).values():
        assert len({tuple(r["response_token_ids"]) for r in group}) > 1
    assert isinstance(open_shard(out).meta.sampling["seed"], int)
