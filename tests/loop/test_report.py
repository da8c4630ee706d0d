"""`rltool report` from hand-written metrics: per-step train means, summary, plots, HTML."""

from __future__ import annotations

import pytest

from rltool.errors import BadInputError
from rltool.loop.report import load_metrics, summarize, write_report
from rltool.rundir import MetricsWriter, RunDir


def test_report_from_metrics(tmp_path):
    run = RunDir(tmp_path).create()
    with MetricsWriter(run.metrics_file("loop")) as w:
        for step, reward in enumerate([0.2, 0.5, 0.9]):
            w.log({"rollout/raw_reward": reward, "perf/loop/rollout_time": 1.0,
                   "perf/loop/train_time": 2.0 + step}, step=step, policy_version=2 * step + 2)
    with MetricsWriter(run.metrics_file("train")) as w:
        for version, (step, kl) in enumerate([(0, 0.0), (0, 0.2), (1, 0.1), (1, 0.3), (2, 0.5),
                                              (2, 0.7)], start=1):
            w.log({"train/ppo_kl": kl, "rollout_step": step}, step=version,
                  policy_version=version)
        # a line repeated by a resumed step replaces the earlier copy of its version
        w.log({"train/ppo_kl": 0.9, "rollout_step": 2}, step=6, policy_version=6)
    metrics = load_metrics(run)
    assert [(r["step"], round(r["train/ppo_kl"], 6)) for r in metrics["train"]] == \
        [(0, 0.1), (1, 0.2), (2, 0.7)]
    rows = {r[0]: r[1:] for r in summarize(metrics)}
    assert rows["rollout/raw_reward"] == ("0.2", "0.9", "0.9")
    result = write_report(run.root)
    page = (run.root / "report" / "index.html").read_text()
    assert page.count("<img") == len(result["plots"]) == 5
    for plot in result["plots"]:
        assert open(plot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_without_metrics(tmp_path):
    with pytest.raises(BadInputError, match="no loop metrics"):
        write_report(tmp_path)


def test_report_plots_eval_by_version_and_wall_time_and_staleness(tmp_path):
    run = RunDir(tmp_path).create()
    with MetricsWriter(run.metrics_file("loop")) as w:
        for step in range(3):
            w.log({"rollout/raw_reward": 0.1 * step, "perf/loop/wall_time": 1.0,
                   "staleness/mean": 0.5, "staleness/max": 1}, step=step,
                  policy_version=2 * step + 2)
    with MetricsWriter(run.metrics_file("eval")) as w:  # results arrive out of step order
        for version in (4, 2):
            w.log({"eval/mean_reward": version / 10}, step=version, policy_version=version)
    metrics = load_metrics(run)
    assert [r["policy_version"] for r in metrics["eval"]] == [4, 2]
    result = write_report(run.root)
    names = sorted(p.rsplit("/", 1)[-1] for p in result["plots"])
    assert {"eval_by_version.png", "eval_by_time.png", "staleness.png"} <= set(names)
    assert len(names) == 8


def test_report_tables_phase_times_and_plots_memory_of_a_cuda_run(tmp_path):
    run = RunDir(tmp_path).create()
    with MetricsWriter(run.metrics_file("loop")) as w:
        for step in range(2):
            w.log({"rollout/raw_reward": 0.5, "perf/loop/rollout_time": 1.0 + step,
                   "perf/loop/trainer_offload_time": 0.25, "memory/train_peak_gib": 40.0 + step,
                   "memory/rollout_peak_gib": 1.5}, step=step, policy_version=step + 1)
    result = write_report(run.root)
    rows = {r["metric"]: r for r in result["summary"]}
    assert (rows["perf/loop/rollout_time"]["first"], rows["perf/loop/rollout_time"]["last"]) == \
        ("1", "2")
    assert rows["perf/loop/trainer_offload_time"]["last"] == "0.25"
    assert rows["memory/train_peak_gib"]["last"] == "41"
    assert "perf/loop/sync_time" not in rows  # not logged: no row
    assert "memory.png" in {p.rsplit("/", 1)[-1] for p in result["plots"]}
