"""Loop config validation: every table checked by its stage's model before anything is written."""

from __future__ import annotations

import pytest

from rltool.errors import ConfigError
from rltool.loop.config import LoopSettings, parse_set_options
from rltool.rundir import RunDir


def tables(model_dir, **changes):
    data = {
        "model": {"path": str(model_dir)},
        "rollout": {"prompts": "p.jsonl", "reward": "reverse:partial", "max_response_len": 8,
                    "rollout_batch_size": 4, "n_samples_per_prompt": 2},
        "train": {"lr": 1e-3},
        "sync": {"sync": "full"},
        "loop": {"num_steps": 3},
    }
    for key, value in changes.items():
        table, _, name = key.partition("__")
        if value is None:
            data[table].pop(name, None)
        else:
            data.setdefault(table, {})[name] = value
    return data


def test_valid_config_builds_stage_configs(tiny_model_dir, tmp_path):
    s = LoopSettings.from_tables(tables(tiny_model_dir, eval__prompts="e.jsonl",
                                       loop__eval_interval=2))
    run = RunDir(tmp_path / "run")
    r = s.rollout_config(run, step=2, urls=["http://a:1"])
    assert r.out == str(run.rollout_step(2)) and r.step == 2 and r.engines == ["http://a:1"]
    t = s.train_config(run, step=2, load="x")
    assert t.rollouts == [str(run.rollout_step(2))] and t.save == str(run.ckpt)
    assert t.publish is None and t.lr == 1e-3
    e = s.eval_config(run, step=1, urls=["http://a:1"], policy_version=2)
    # [eval] inherits reward and max_response_len from [rollout]
    assert e.reward == "reverse:partial" and e.max_response_len == 8 and e.policy_version == 2
    assert [k for k in range(3) if s.is_eval_step(k)] == [1, 2]


def test_deterministic_sets_trainer_and_seed(tiny_model_dir, tmp_path):
    s = LoopSettings.from_tables(tables(tiny_model_dir, loop__deterministic=True, loop__seed=7))
    run = RunDir(tmp_path)
    assert s.train_config(run, step=0, load="x").deterministic is True
    assert s.rollout_config(run, step=0, urls=["http://a:1"]).seed == 7


@pytest.mark.parametrize("change, message", [
    ({"rollout__out": "x"}, "the loop decides per step"),
    ({"train__load": "x"}, "the loop decides per step"),
    ({"rollout__n_samples_per_prompt": 0}, "--n-samples-per-prompt (in [rollout])"),
    ({"train__lr": -1.0}, "--lr (in [train])"),
    ({"train__bogus": 1}, "unknown key 'bogus'"),
    ({"sync__sync": "sometimes"}, "--sync (in [sync])"),
    ({"loop__placement": "remote"}, "--placement (in [loop])"),
    ({"sync__sync": "tensor", "loop__placement": "disaggregated"}, "use --placement colocated"),
    ({"loop__save_interval": 0}, "--save-interval (in [loop])"),
    ({"loop__num_steps": None}, "--num-steps (in [loop])"),
    ({"loop__eval_interval": 2}, "needs an [eval] table"),
    ({"model__path": "/nonexistent"}, "not a HF weights directory"),
    ({"rollout__reward": None}, "--reward (in [rollout])"),
    ({"loop__engine": "inprocess"}, "[sync] sync = \"auto\" or \"tensor\""),
    ({"loop__engine": "inprocess", "sync__sync": "auto", "loop__num_engines": 2},
     "num_engines = 1"),
    ({"loop__engine": "inprocess", "sync__sync": "auto", "loop__placement": "disaggregated"},
     "placement = \"colocated\""),
    ({"loop__engine": "inprocess", "sync__sync": "auto", "loop__engine_args": ["--port", "1"]},
     "'--port' is not an in-process engine option"),
    ({"loop__engine": "inprocess", "sync__sync": "auto",
      "loop__engine_args": ["--allowed-hosts", "engine.example"]},
     "'--allowed-hosts' is not an in-process engine option"),
    ({"loop__engine": "inprocess", "sync__sync": "tensor",
      "loop__engine_args": ["--max-running-requests", "many"]},
     "--max-running-requests (in [loop.engine_args])"),
    ({"loop__engine": "inprocess", "sync__sync": "auto", "loop__engine_args": ["--bogus"]},
     "unknown key 'bogus'"),
    ({"loop__engine": "inprocess", "sync__sync": "auto",
      "loop__engine_urls": ["http://127.0.0.1:1"], "loop__num_engines": None},
     "excludes engine_urls"),
    ({"loop__engine_urls": ["http://[::1"], "loop__num_engines": None},
     "'http://[::1' is not a valid URL"),
    ({"loop__router_url": "engine:30000", "loop__num_engines": None},
     "'engine:30000' is not an http(s) URL with a host"),
    ({"sync__precision": "fp16"}, "--precision (in [sync])"),
    ({"sync__sync": "distributed", "sync__precision": "fp8", "loop__placement": "colocated"},
     "not sent over --sync distributed"),
    ({"sync__sync": "auto", "sync__precision": "fp8",
      "loop__engine_urls": ["http://127.0.0.1:1"], "loop__num_engines": None},
     "reaches external engines on disk only"),
])
def test_bad_config_names_the_key(tiny_model_dir, change, message):
    with pytest.raises(ConfigError) as err:
        LoopSettings.from_tables(tables(tiny_model_dir, **change))
    assert message in str(err.value)


@pytest.mark.parametrize("key", ["sync", "delta_format", "full_every"])
def test_weight_sync_key_under_train_names_the_sync_table(tiny_model_dir, key):
    """Bug: `sync = "delta"` under [train] of a loop config validated (TrainConfig takes the
    weight-sync keys for `rltool train`) and was silently ignored: the loop publishes with
    [sync]. It is an error that names [sync], from the file and from --set alike."""
    value = {"sync": "delta", "delta_format": "slime", "full_every": 3}[key]
    with pytest.raises(ConfigError, match=rf"\[train\] sets \['{key}'\].*\[sync\] table"):
        LoopSettings.from_tables(tables(tiny_model_dir, **{f"train__{key}": value}))
    with pytest.raises(ConfigError, match=r"\[sync\] table"):
        LoopSettings.from_tables(tables(tiny_model_dir),
                                 overrides=parse_set_options([f"train.{key}={value!r}"]))


def test_unknown_table_refused(tiny_model_dir):
    data = tables(tiny_model_dir)
    data["trian"] = {"lr": 1}
    with pytest.raises(ConfigError, match="unknown table"):
        LoopSettings.from_tables(data)


def test_set_options_override_tables(tiny_model_dir):
    overrides = parse_set_options(["train.lr=0.5", "rollout.reward=copy:exact",
                                   "loop.engine-args=['--dtype', 'fp32']"])
    assert overrides == {"train": {"lr": 0.5}, "rollout": {"reward": "copy:exact"},
                         "loop": {"engine_args": ["--dtype", "fp32"]}}
    s = LoopSettings.from_tables(tables(tiny_model_dir), overrides=overrides)
    assert s.train.lr == 0.5 and s.loop.engine_args == ["--dtype", "fp32"]
    with pytest.raises(ConfigError, match="TABLE.KEY=VALUE"):
        parse_set_options(["lr=1"])
    with pytest.raises(ConfigError, match="unknown table"):
        LoopSettings.from_tables(tables(tiny_model_dir), overrides={"nope": {"a": 1}})


def test_to_tables_round_trips(tiny_model_dir):
    s = LoopSettings.from_tables(tables(tiny_model_dir, eval__prompts="e.jsonl"))
    again = LoopSettings.from_tables(s.to_tables())
    assert again == s


@pytest.mark.parametrize("changes,message", [
    ({"loop__mode": "async"}, "--placement disaggregated"),
    ({"loop__mode": "async", "loop__placement": "disaggregated",
      "rollout__filter": "all-equal-reward"}, "remove \\[rollout\\] filter and partial"),
    ({"loop__mode": "async", "loop__placement": "disaggregated", "rollout__partial": True},
     "remove \\[rollout\\] filter and partial"),
    ({"loop__engine_cores": [10_000]}, "--engine-cores .* not available"),
    ({"loop__trainer_cores": []}, "--trainer-cores"),
    ({"loop__update_mode": "in_place"}, "--update-mode .*'in-place'"),
])
def test_async_settings_refused(tiny_model_dir, changes, message):
    with pytest.raises(ConfigError, match=message):
        LoopSettings.from_tables(tables(tiny_model_dir, **changes))


@pytest.mark.parametrize("sync", ["tensor", "distributed"])
def test_async_takes_in_memory_sync_with_disaggregated_engines(tiny_model_dir, sync):
    """The async loop's engines run on the trainer's host, so tensor and distributed apply; the
    synchronous disaggregated loop trains in a subprocess and keeps refusing them."""
    from rltool.loop.phases import in_memory_transport, sync_mode

    s = LoopSettings.from_tables(tables(tiny_model_dir, sync__sync=sync, loop__mode="async",
                                        loop__placement="disaggregated", loop__max_staleness=2,
                                        loop__engine_cores=[0], loop__trainer_cores=[0]))
    assert (s.loop.mode, s.loop.max_staleness, s.loop.update_mode) == ("async", 2, "in-place")
    assert in_memory_transport(s) == "tensor" and sync_mode(s) == sync
    with pytest.raises(ConfigError, match="--placement colocated"):
        LoopSettings.from_tables(tables(tiny_model_dir, sync__sync=sync,
                                        loop__placement="disaggregated"))


def test_inprocess_engine_reads_engine_args_as_serve_flags(tiny_model_dir):
    settings = LoopSettings.from_tables(tables(
        tiny_model_dir, sync__sync="auto", loop__engine="inprocess", loop__deterministic=True,
        loop__engine_args=["--max-running-requests", "128", "--disable-radix-cache"]))
    cfg = settings.serve_config(tiny_model_dir)
    assert (cfg.max_running_requests, cfg.disable_radix_cache, cfg.deterministic) == (128, True,
                                                                                      True)
    assert cfg.model == tiny_model_dir and cfg.engine == "builtin"
