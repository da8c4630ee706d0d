"""`make demo` (python -m rltool.demo): a shortened run learns, and the demo only ever deletes its
own directory."""

from __future__ import annotations

import json

import pytest

from rltool import demo


@pytest.mark.slow
def test_shortened_demo_improves_the_reward(tmp_path, capsys):
    """SFT warm start (60 steps) + 20 RL steps: the stated improvement is +0.1 mean reward from
    the first 3 RL steps to the last 3 (measured runs gain +0.2 to +0.3 over 20 steps)."""
    root = tmp_path / "demo-run"
    demo.main([str(root), "--steps", "20", "--json"])
    out = capsys.readouterr().out
    assert "rltool loop" in out and "reward vs step" in out
    summary = json.loads((root / "summary.json").read_text())
    rewards = summary["rewards"]
    assert len(rewards) == 20 and summary["sft_steps"] == 60 and summary["seed"] == demo.SEED
    assert rewards[0] <= 0.3, "the warm start must leave the first RL step at reward <= 0.3"
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.1, rewards
    png = (root / "run" / "report" / "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (root / "run" / "eval" / "step-000019" / "_SUCCESS").exists()
    # Prompts are disjoint: no SFT string appears among the RL or eval prompts.
    labels = {f: {json.loads(l)["label"] for l in (root / f).read_text().splitlines()}
              for f in ("rl.jsonl", "eval.jsonl", "sft.jsonl")}
    assert not labels["sft.jsonl"] & (labels["rl.jsonl"] | labels["eval.jsonl"])


def test_demo_refuses_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        demo.main([str(tmp_path / "mine")])
    assert e.value.code == 2 and "not a demo directory" in capsys.readouterr().err
    assert (tmp_path / "mine" / "keep.txt").exists()
