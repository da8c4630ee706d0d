"""Run-directory paths, state.json / engines.json and the JSONL metrics writer/reader."""

from __future__ import annotations

import json
import time

import pytest

from rltool.errors import BadInputError
from rltool.rundir import (MetricsWriter, RunDir, list_versions, parse_step_dir_name,
                           parse_weight_dir_name, read_metrics, step_dir_name, weight_dir_name)


def test_paths_follow_the_design_layout(tmp_path):
    run = RunDir(tmp_path / "run")
    r = run.root
    assert run.config == r / "config.toml"
    assert run.state == r / "state.json"
    assert run.engines == r / "engines.json"
    assert run.weight_version(7) == r / "weights" / "weight_v000007"
    assert run.ckpt_step(7) == r / "train" / "ckpt" / "step-000007"
    assert run.rollout_step(7) == r / "rollouts" / "step-000007"
    assert run.eval_step(10) == r / "eval" / "step-000010"
    assert run.train_config(7) == r / "train" / "step-000007.toml"
    assert run.report == r / "report"
    assert run.metrics_file("rollout") == r / "metrics" / "rollout.jsonl"
    assert run.log_file("engine-0") == r / "logs" / "engine-0.log"
    run.create()
    for d in ("weights", "train/ckpt", "rollouts", "eval", "metrics", "trace", "logs"):
        assert (r / d).is_dir(), d


def test_names_round_trip():
    assert weight_dir_name(0) == "weight_v000000"
    assert weight_dir_name(1234567) == "weight_v1234567"
    assert parse_weight_dir_name("weight_v1234567") == 1234567
    assert step_dir_name(3) == "step-000003"
    assert parse_step_dir_name("step-000003") == 3
    for bad in ("weight_v12", ".weight_v000001.x.tmp", "weight_v000001x", "step-3"):
        assert parse_weight_dir_name(bad) is None and parse_step_dir_name(bad) is None


def test_list_versions_ignores_temporaries_and_files(tmp_path):
    for name in ("weight_v000002", "weight_v000000", ".weight_v000003.abc.tmp", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "weight_v000009").write_text("a file, not a version")
    assert list_versions(tmp_path) == [0, 2]
    assert list_versions(tmp_path / "missing") == []


def test_state_and_engines_json(tmp_path):
    run = RunDir(tmp_path).create()
    assert run.read_state() is None and run.read_engines() == []
    state = {"step": 3, "policy_version": 5, "phase": "train"}
    run.write_state(state)
    assert run.read_state() == state
    engines = [{"url": "http://127.0.0.1:30000", "pid": 1234, "cmd": ["rltool", "serve"]}]
    run.write_engines(engines)
    assert run.read_engines() == engines
    assert json.loads(run.engines.read_text()) == {"engines": engines}
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["engines.json", "state.json"]


@pytest.mark.parametrize("text,match", [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object")])
def test_corrupt_state_is_a_clear_error(tmp_path, text, match):
    run = RunDir(tmp_path)
    run.state.write_text(text)
    with pytest.raises(BadInputError, match=match):
        run.read_state()


@pytest.mark.parametrize("text", ["{oops", '{"engine": []}', "[]"])
def test_corrupt_engines_is_a_clear_error(tmp_path, text):
    run = RunDir(tmp_path)
    run.engines.write_text(text)
    with pytest.raises(BadInputError, match="engines.json"):
        run.read_engines()


def test_metrics_lines_have_step_version_time(tmp_path):
    run = RunDir(tmp_path)
    t0 = time.time()
    with MetricsWriter(run.metrics_file("train")) as w:
        w.log({"train/loss": 0.5}, step=1, policy_version=1)
        w.log({"train/loss": 0.25, "perf/tokens_per_s": 100.0}, step=2, policy_version=3)
    lines = run.metrics_file("train").read_text().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["policy_version"] for r in rows] == [1, 3]
    assert all(t0 <= r["time"] <= time.time() for r in rows)
    assert rows[1]["perf/tokens_per_s"] == 100.0
    assert read_metrics(run.metrics_file("train")) == rows
    # appending from a second writer (a resumed stage) keeps the earlier lines
    with MetricsWriter(run.metrics_file("train")) as w:
        w.log({"train/loss": 0.1}, step=3, policy_version=4)
    assert [r["step"] for r in read_metrics(run.metrics_file("train"))] == [1, 2, 3]


def test_metrics_reserved_names_and_closed_writer(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="reserved"):
        w.log({"step": 9}, step=1, policy_version=0)
    w.close()
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.log({}, step=1, policy_version=0)
    assert read_metrics(tmp_path / "m.jsonl") == []


def test_read_metrics_skips_torn_lines(tmp_path):
    """A torn last line (writer mid-write) and a torn middle line (writer died, resumed run
    appended) are skipped rather than failing the reader."""
    path = tmp_path / "rollout.jsonl"
    good = [{"step": i, "policy_version": i, "time": 1.0, "x": i} for i in range(3)]
    path.write_text(json.dumps(good[0]) + "\n" + '{"step": 1, "poli' + json.dumps(good[1]) + "\n"
                    + json.dumps(good[2]) + "\n" + '{"step": 3, "pol')
    assert read_metrics(path) == [good[0], good[2]]
    path.write_text(json.dumps(good[0]) + "\n")
    assert read_metrics(path) == [good[0]]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_metrics_writer_cuts_a_torn_last_line_before_appending(tmp_path):
    """Bug: a metrics JSONL whose last line was torn by a kill got the next row glued onto the
    torn line, so readers dropped that row too. The writer now cuts the torn tail on open."""
    path = tmp_path / "train.jsonl"
    with MetricsWriter(path) as w:
        first = w.log({"x": 1}, step=1, policy_version=1)
    with open(path, "a") as f:  # what a writer killed mid-line leaves behind
        f.write('{"step": 2, "policy_version": 2, "ti')
    with MetricsWriter(path) as w:
        second = w.log({"x": 3}, step=3, policy_version=3)
    assert read_metrics(path) == [first, second]
    assert path.read_text() == json.dumps(first) + "\n" + json.dumps(second) + "\n"


def test_metrics_writer_cuts_a_torn_only_line_longer_than_a_chunk(tmp_path):
    """A torn tail with no newline before it (the first line was torn) is cut to empty, also
    when it spans several read chunks; a complete file is left byte-for-byte alone."""
    path = tmp_path / "rollout.jsonl"
    path.write_text('{"step": 0, "pad": "' + "x" * 200_000)
    with MetricsWriter(path) as w:
        row = w.log({}, step=1, policy_version=0)
    assert path.read_text() == json.dumps(row) + "\n"
    before = path.read_bytes()
    MetricsWriter(path).close()
    assert path.read_bytes() == before
