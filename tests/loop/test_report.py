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
