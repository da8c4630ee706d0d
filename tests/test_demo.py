"""`make demo` (python -m rltool.demo) runs and only ever deletes its own directory."""

from __future__ import annotations

import json

import pytest

from rltool import demo


def test_demo_builds_a_run_directory(tmp_path, capsys):
    root = tmp_path / "demo-run"
    demo.main([str(root)])
    out = capsys.readouterr().out
    assert "initial weights" in out and "untrained sample" in out and "reward" in out
    assert json.loads((root / "weights" / "weight_v000000" / "rltool_version.json").read_text()) \
        == {"version": 0}
    assert len((root / "prompts.jsonl").read_text().splitlines()) == 64
    demo.main([str(root)])  # re-runnable: its own directory is replaced


def test_demo_refuses_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        demo.main([str(tmp_path / "mine")])
    assert e.value.code == 2 and "not a demo directory" in capsys.readouterr().err
    assert (tmp_path / "mine" / "keep.txt").exists()
