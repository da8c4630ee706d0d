"""The loop runs the rollout stage in-process and keeps its reward-failure rule."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rltool.data.shards import MANIFEST
from rltool.data.tasks import make_rows
from rltool.errors import RewardError
from rltool.loop import phases
from rltool.loop.config import LoopSettings
from rltool.loop.state import LoopState
from rltool.rundir import RunDir, read_metrics
from tests.loop.test_config import tables

REWARD = "tests.rollout.test_rollout_reward_failures:reward_fails_on_first_prompt"


def test_loop_rollout_stops_on_too_many_failed_rewards(builtin_engine, tiny_model_dir, tmp_path):
    """Bug: in a loop, a reward function that raised turned into failed samples with reward 0.0
    and the step went on to train on them. The loop's rollout phase now fails the step (exit 3
    from `rltool loop`) beyond [rollout] max_failed_rewards_frac, writing no shard and no
    metrics line; the key is honoured when raised."""
    rows = make_rows("reverse", num=4, seed=1)
    rows[0]["metadata"] = {"fail": True}  # a quarter of the reward calls raise
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engines = SimpleNamespace(urls=[builtin_engine.url], clients=None)

    def rollout_phase(run, **rollout_keys):
        settings = LoopSettings.from_tables(tables(
            tiny_model_dir, rollout__prompts=str(prompts), rollout__reward=REWARD,
            rollout__max_response_len=4, **{f"rollout__{k}": v for k, v in rollout_keys.items()}))
        ctx = phases.StepContext(run=run, settings=settings, engines=engines, registry=None,
                                 state=LoopState(step=0, policy_version=0))
        phases.rollout(ctx)

    run = RunDir(tmp_path / "run").create()
    with pytest.raises(RewardError, match="2 of 8 reward calls failed") as err:
        rollout_phase(run)
    assert err.value.exit_code == 3
    assert not run.rollout_step(0).exists() and read_metrics(run.metrics_file("rollout")) == []

    rollout_phase(run, max_failed_rewards_frac=0.25)
    assert (run.rollout_step(0) / MANIFEST).exists()
    [line] = read_metrics(run.metrics_file("rollout"))
    assert line["rollout/failed_rewards"] == 2 and line["rollout/reward_calls"] == 8
