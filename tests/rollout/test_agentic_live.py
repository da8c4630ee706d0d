"""Agentic RL end to end on CPU: `rollout --env` against a live builtin engine with a scripted
environment of known rewards (in-process and through `rltool env serve`), then `train` with
turn-level advantages on the shard. The trainer sees exactly the engine's tokens: its recomputed
logprobs of every model token equal the engine's, which a re-tokenized conversation would not
give; environment failures fail their episodes only."""

from __future__ import annotations

import json
import sys

import pytest

from rltool.data.shards import open_shard
from rltool.rollout.stage import RolloutConfig, run
from tests.env.envs import turn_reward

ENV = "tests.env.envs:Scripted"
PROMPTS = [{"prompt": "abc", "prompt_id": "a", "label": "bonus"},
           {"prompt": "xyz", "prompt_id": "b"},
           {"prompt": "hang", "prompt_id": "c", "metadata": {"fault": "hang"}},
           {"prompt": "crash", "prompt_id": "d", "metadata": {"fault": "raise"}}]
pytestmark = pytest.mark.timeout(300)


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rollout(engine, tmp_path, *, env, prompts, name, **kw):
    cfg = RolloutConfig(engines=[engine.url], prompts=str(prompts), out=str(tmp_path / name),
                        env=env, n_samples_per_prompt=2, rollout_batch_size=len(
                            prompts.read_text().splitlines()),
                        max_response_len=72, max_tokens_per_turn=5, max_turns=3,
                        env_step_timeout_s=3.0, seed=0, quiet=True, **kw)
    return run(cfg), open_shard(tmp_path / name).rows()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def env_shard(builtin_engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agentic")
    prompts = write_prompts(tmp / "prompts.jsonl", PROMPTS)
    result, rows = rollout(builtin_engine, tmp, env=ENV, prompts=prompts, name="step-000000")
    return tmp / "step-000000", result, rows


def check_episode(row, tok):
    """Turn rewards recomputed from the shard's tokens; observation tokens masked and templated."""
    ids, mask, starts = row["response_token_ids"], row["loss_mask"], row["turn_starts"]
    ends = starts[1:] + [len(ids)]
    want = []
    for k, (s, e) in enumerate(zip(starts, ends)):
        model = [t for t, m in zip(ids[s:e], mask[s:e]) if m]
        assert mask[s:e] == [1] * len(model) + [0] * (e - s - len(model))  # model, then env
        assert model, "every turn starts with model tokens"
        want.append(turn_reward(tok.decode(model, skip_special_tokens=True)))
        env_text = tok.decode(ids[s + len(model):e], skip_special_tokens=False)
        if k < len(starts) - 1:
            assert env_text.endswith(f"<|im_start|>tool\nturn {k + 1} ok<|im_end|>\n"
                                     "<|im_start|>assistant\n"), env_text
    if row["label"] == "bonus":
        want[-1] += 1.0
    assert row["turn_rewards"] == pytest.approx(want, abs=1e-6)
    assert row["reward"] == pytest.approx(sum(want), abs=1e-5)
    versions = [v for v, m in zip(row["weight_versions"], mask) if not m]
    assert set(versions) <= {-1} and all(lp == 0.0 for lp, m in
                                         zip(row["rollout_logprobs"], mask) if not m)


def test_episodes_with_known_rewards_and_failures(env_shard, tok):
    _, result, rows = env_shard
    assert result["rows"] == 8 and result["groups"] == 4
    by_prompt = {}
    for row in rows:
        by_prompt.setdefault(row["prompt_id"], []).append(row)
    for pid in ("a", "b"):
        for row in by_prompt[pid]:
            assert row["status"] == "completed" and len(row["turn_starts"]) == 3, row
            check_episode(row, tok)
    assert all(r["status"] == "failed" and r["finish_reason"].startswith("env_timeout: step 1")
               for r in by_prompt["c"])
    assert all(r["status"] == "failed" and "scripted crash" in r["finish_reason"]
               for r in by_prompt["d"])
    m = result["metrics"]
    assert (m["rollout/env/failed"], m["rollout/env/timeouts"], m["rollout/env/episodes"]) == (
        4, 2, 8)
    assert open_shard(env_shard[0]).meta.extra["env"] == ENV


def test_trainer_sees_the_engines_tokens_and_trains_turn_level(env_shard, tiny_model_dir,
                                                               tmp_path):
    from rltool.train import run as train
    from rltool.train.config import TrainConfig
    from rltool.train.stage import recompute_logprobs

    shard, _, rows = env_shard
    ok = [r for r in rows if r["status"] != "failed"]
    recomputed = recompute_logprobs(tiny_model_dir, [shard], max_tokens_per_microbatch=256,
                                    deterministic=True)
    assert len(recomputed) == len(ok)  # the failed groups are left out
    for row, got in zip(ok, recomputed):
        model = [(a, b) for a, b, m in zip(row["rollout_logprobs"], got, row["loss_mask"]) if m]
        assert [a for a, _ in model] == pytest.approx([b for _, b in model], abs=2e-3)
    result = train(TrainConfig(rollouts=[str(shard)], load=str(tiny_model_dir),
                               advantage_estimator="turn_grpo", num_steps=1, lr=1e-3,
                               max_tokens_per_microbatch=256, save=str(tmp_path / "ckpt")))
    assert result.optimizer_steps == 1


def test_rollout_through_env_serve(builtin_engine, tmp_path, tok):
    from rltool.supervisor import start

    ready = tmp_path / "ready.json"
    child = start([sys.executable, "-m", "rltool", "env", "serve", "--env", ENV, "--port", "0",
                   "--api-key", "k", "--step-timeout-s", "3", "--ready-file", str(ready)],
                  log_path=tmp_path / "env.log", name="env")
    try:
        url = child.wait_ready_file(ready, timeout_s=60)["url"]
        prompts = write_prompts(tmp_path / "p.jsonl", [PROMPTS[0], PROMPTS[3]])
        result, rows = rollout(builtin_engine, tmp_path, env=url, prompts=prompts, name="remote",
                               env_api_key="k")
    finally:
        child.stop()
    good = [r for r in rows if r["prompt_id"] == "a"]
    assert len(good) == 2 and all(r["status"] == "completed" for r in good)
    for row in good:
        check_episode(row, tok)
    bad = [r for r in rows if r["prompt_id"] == "d"]
    assert all(r["status"] == "failed" and "500" in r["finish_reason"] for r in bad)
    assert result["metrics"]["rollout/env/failed"] == 2
