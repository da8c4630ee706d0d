"""The async loop's batch applies the rollout stage's reward-failure limit: a batch whose reward
calls mostly failed is refused (exit 3) before its shard or metrics are written, and a batch
within the limit reports its reward calls in rollout.jsonl."""

from __future__ import annotations

import json

import pytest

from rltool.errors import RewardError
from rltool.loop.async_batch import write_batch
from rltool.rollout.collect import reward_counts
from rltool.rollout.generate import Sample
from rltool.rollout.stage import RolloutConfig


def _sample(group: int, i: int, *, reward_failed: bool) -> Sample:
    s = Sample(uid=f"g{group}-{i}", prompt_id=f"p{group}", group_id=group, sample_index=i,
               prompt="p", prompt_token_ids=[1, 2], label="x")
    s.response_token_ids, s.loss_mask, s.rollout_logprobs, s.weight_versions = [5], [1], [-0.5], [0]
    s.status, s.finish_reason = "completed", "stop"
    if reward_failed:
        s.fail("reward_error: ValueError: broken")
    return s


class _Inputs:
    reward_fn = staticmethod(lambda *args: None)

    def __init__(self):
        self.written = False

    def shard_meta(self, cfg, **kwargs):
        return {}

    def write(self, cfg, groups, **kwargs):
        self.written = True


class _Stream:
    """What write_batch reads of a RolloutStream: a taken batch and the stream's positions."""

    def __init__(self, groups):
        self.groups, self.inputs = groups, _Inputs()

    def take(self, count, *, train_version):
        return self.groups, [], 0.0

    def positions(self):
        return [], len(self.groups)


def _cfg(tmp_path) -> RolloutConfig:
    (tmp_path / "p.jsonl").write_text('{"prompt": "p", "label": "x"}\n')
    return RolloutConfig(engines=["http://127.0.0.1:1"], prompts=str(tmp_path / "p.jsonl"),
                         out=str(tmp_path / "rollouts" / "step-000003"), step=3,
                         n_samples_per_prompt=2, rollout_batch_size=2, max_response_len=4,
                         reward="exact",
                         metrics=str(tmp_path / "rollout.jsonl"))


def test_reward_counts_read_the_failed_calls_back_from_the_samples():
    groups = [[_sample(0, 0, reward_failed=True), _sample(0, 1, reward_failed=False)]]
    counts, first = reward_counts(groups, rewarded=True)
    assert counts == {"reward_calls": 2, "failed_rewards": 1}
    assert first == "reward_error: ValueError: broken"
    assert reward_counts(groups, rewarded=False)[0]["reward_calls"] == 0


def test_a_batch_of_failed_rewards_writes_nothing(tmp_path):
    stream = _Stream([[_sample(g, i, reward_failed=True) for i in range(2)] for g in range(2)])
    cfg = _cfg(tmp_path)
    with pytest.raises(RewardError, match="4 of 4 reward calls failed at step 3"):
        write_batch(stream, cfg, train_version=0)
    assert not stream.inputs.written and not (tmp_path / "rollout.jsonl").exists()


def test_a_batch_within_the_limit_reports_its_reward_calls(tmp_path):
    stream = _Stream([[_sample(g, i, reward_failed=False) for i in range(2)] for g in range(2)])
    write_batch(stream, _cfg(tmp_path), train_version=0)
    line = json.loads((tmp_path / "rollout.jsonl").read_text().splitlines()[-1])
    assert stream.inputs.written
    assert (line["rollout/reward_calls"], line["rollout/failed_rewards"]) == (4, 0)



class _Launched:
    url, pid, cmdline = "http://127.0.0.1:1", 1, ["rltool", "serve"]


class _Registry:
    def add(self, **entry):
        pass


def test_the_eval_engine_pulls_versions_into_a_directory_of_its_own(tmp_path, monkeypatch):
    """Async loop + delta sync: the eval engine and the training engines never share the
    directory /pull_weights rewrites (a pull for one between the other's pull and load would
    make it serve the wrong version under the right tag)."""
    from types import SimpleNamespace

    from rltool.loop import async_runner, engines
    from rltool.rundir import RunDir

    launched: list[list[str]] = []
    monkeypatch.setattr(engines, "start_engine", lambda args, **kw: launched.append(args)
                        or _Launched())
    monkeypatch.setattr(async_runner, "EvalWorker",
                        lambda *a, **kw: SimpleNamespace(start=lambda: None, engine=a[2]))
    run = RunDir(tmp_path / "run").create()
    loop = SimpleNamespace(eval_interval=1, deterministic=False, engine_ready_timeout_s=1.0,
                           api_key=None, admin_api_key=None)
    ctx = SimpleNamespace(run=run, registry=_Registry(), settings=SimpleNamespace(
        eval=object(), loop=loop, engine_args=lambda: []))
    evaluator = async_runner._start_evaluator(ctx, "async")
    training = engines.EngineSet(run, _Registry(), num_engines=1, engine_args=[],
                                 deterministic=False, ready_timeout_s=1.0)
    for engine_set in (evaluator.engine, training):
        engine_set.start(tmp_path / "model")
    pulls = [args[args.index("--local-checkpoint-dir") + 1] for args in launched]
    assert pulls == [str(run.eval_local_weights), str(run.local_weights)]
    assert evaluator.engine.local_weights == run.eval_local_weights != training.local_weights
