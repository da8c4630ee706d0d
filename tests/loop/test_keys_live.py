"""A short CPU loop with keys planted everywhere a config can hold one: no file of the run, no log
line and no engine command line holds a key, and the engines still serve with them."""

from __future__ import annotations

import logging

import httpx
import psutil
import pytest

from rltool.data.tasks import make_rows, write_prompts
from rltool.loop import runner
from rltool.loop.config import LoopSettings
from rltool.rundir import RunDir, read_metrics

USER, ADMIN, TEACHER = "planted-user-3b7e01", "planted-admin-c4d962", "planted-teacher-08af5e"
KEYS = (USER, ADMIN, TEACHER)


@pytest.mark.slow
def test_planted_keys_reach_no_file_log_or_command_line(tiny_model_dir, tmp_path, caplog, capfd):
    """Bug: keys were on command lines (engine_args went to `rltool serve` as given, where
    /proc/PID/cmdline shows them, and engines.json recorded that command line) and the run's
    config.toml kept [rollout] api_key and the keys inside engine_args verbatim."""
    write_prompts(make_rows("reverse", num=4, seed=1), tmp_path / "rl.jsonl")
    data = {"model": {"path": str(tiny_model_dir)},
            "rollout": {"prompts": str(tmp_path / "rl.jsonl"), "reward": "reverse:partial",
                        "n_samples_per_prompt": 2, "rollout_batch_size": 2,
                        "max_response_len": 4, "api_key": USER,
                        "opd_teacher_api_key": TEACHER},
            "eval": {"prompts": str(tmp_path / "rl.jsonl"), "n_samples_per_prompt": 1,
                     "api_key": USER},
            "train": {"lr": 1e-2, "global_batch_size": 4},
            "sync": {"sync": "full"},
            "loop": {"num_steps": 1, "eval_interval": 1, "admin_api_key": ADMIN,
                     "engine_args": ["--api-key", USER, "--admin-api-key", ADMIN,
                                     "--num-threads", "1"]}}
    run = tmp_path / "run"
    seen: dict[str, object] = {}

    def on_step(row):  # the engines are alive: look at them from outside
        for entry in RunDir(run).read_engines():
            cmdline = " ".join(psutil.Process(entry["pid"]).cmdline())
            seen.setdefault("cmdlines", []).append(cmdline)
            url = entry["url"]
            seen["no key"] = httpx.get(url + "/get_weight_version", timeout=30).status_code
            seen["user key"] = httpx.post(url + "/flush_cache", timeout=30, headers={
                "Authorization": f"Bearer {USER}"}).status_code
            seen["admin key"] = httpx.post(url + "/flush_cache", timeout=30, headers={
                "Authorization": f"Bearer {ADMIN}"}).status_code

    caplog.set_level(logging.DEBUG)
    runner.start(LoopSettings.from_tables(data), run, on_step=on_step)
    assert [r["step"] for r in read_metrics(RunDir(run).metrics_file("loop"))] == [0]
    # The engines served with both keys, handed over by environment.
    assert (seen["no key"], seen["user key"], seen["admin key"]) == (401, 401, 200)
    assert seen["cmdlines"] and all("--num-threads" in c for c in seen["cmdlines"])
    texts = {"command line": "\n".join(seen["cmdlines"]), "log records": caplog.text,
             "output": "".join(capfd.readouterr())}
    texts |= {str(p): p.read_bytes().decode("latin-1") for p in run.rglob("*") if p.is_file()}
    assert any(name.endswith("config.toml") for name in texts)
    assert any("/logs/" in name for name in texts)
    leaks = sorted(name for name, text in texts.items() if any(k in text for k in KEYS))
    assert leaks == []
