"""`rltool loop` with an environment: the synchronous and the asynchronous loop run `--env`
episodes (the built-in guess game) and train on them with turn-level advantages."""

from __future__ import annotations

import json

import pytest
import tomli_w
from click.testing import CliRunner

from rltool.cli import main
from rltool.data.shards import open_shard
from rltool.rundir import RunDir, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def config(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("agentic-loop")
    for name, n in (("rl", 4), ("eval", 2)):
        (root / f"{name}.jsonl").write_text("".join(
            json.dumps({"prompt": "guess my number from 1 to 64.", "prompt_id": f"{name}{i}",
                        "label": str(5 + i)}) + "\n" for i in range(n)))
    episode = {"env": "guess", "max_turns": 3, "max_tokens_per_turn": 4}
    path = root / "run.toml"
    path.write_text(tomli_w.dumps({
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"prompts": str(root / "rl.jsonl"), "n_samples_per_prompt": 2,
                    "rollout_batch_size": 2, "max_response_len": 96, **episode},
        "train": {"lr": 1e-2, "global_batch_size": 2, "advantage_estimator": "turn_grpo"},
        "sync": {},
        "eval": {"prompts": str(root / "eval.jsonl"), "n_samples_per_prompt": 2, **episode},
        "loop": {"num_steps": 2, "eval_interval": 2, "seed": 1},
    }))
    return path


@pytest.mark.parametrize("mode", [["--mode", "sync"],
                                  ["--mode", "async", "--placement", "disaggregated"]])
def test_loop_trains_on_episodes(config, tmp_path, mode):
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["loop", "-q", "--config", str(config), "--run-dir",
                                       str(run), "--json", *mode])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 2
    rd = RunDir(run)
    for step in range(2):
        rows = open_shard(rd.rollout_step(step)).rows()
        assert rows and all(r["turn_starts"] and len(r["turn_starts"]) == len(r["turn_rewards"])
                            for r in rows)
        assert all(r["reward"] == pytest.approx(sum(r["turn_rewards"]), abs=1e-5) for r in rows)
    metrics = read_metrics(run / "metrics" / "rollout.jsonl")
    assert all(m["rollout/env/episodes"] == 4 and m["rollout/env/failed"] == 0 for m in metrics)
    assert [r["step"] for r in read_metrics(rd.metrics_file("train"))]
    # sync: eval/step-000001; async evaluates by policy version: eval/step-000004
    (evaluated,) = [d for d in (run / "eval").iterdir() if (d / "_SUCCESS").exists()]
    assert all(r["turn_starts"] is not None for r in open_shard(evaluated).rows())
