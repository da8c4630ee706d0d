"""Progress: plain periodic lines when stderr is not a terminal (counts, rate, ETA, a closing
line only after a long stage), a rich bar on a terminal, nothing with -q; the stages' commands
show it and `-q` silences it."""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

from rltool import progress as progress_mod
from rltool.cli import main
from rltool.logs import setup_logging
from rltool.progress import Progress
from tests.helpers.checkpoints import make_weights, perturb, write_checkpoint


@pytest.fixture(autouse=True)
def info_logging():
    setup_logging(verbosity=0)
    yield
    setup_logging(verbosity=0)


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "rltool.progress"]


def test_plain_lines_with_counts_rate_eta_and_a_closing_line(caplog):
    with caplog.at_level(logging.INFO, logger="rltool.progress"):
        with Progress("train", total=4, unit="steps", terminal=False, interval_s=0) as p:
            for i in range(4):
                p.note(f"loss {i}")
                p.advance()
    out = lines(caplog)
    assert len(out) == 5
    assert out[0].startswith("train: 1/4 steps (25%), ") and "steps/s" in out[0]
    assert "eta 0:0" in out[0] and out[0].endswith("loss 0")
    assert out[-1].startswith("train: 4/4 steps (100%)") and "took 0:00" in out[-1]


def test_a_short_stage_prints_nothing_and_track_counts_items(caplog):
    with caplog.at_level(logging.INFO, logger="rltool.progress"):
        p = Progress("delta apply", total=3, unit="tensors", terminal=False, interval_s=3600)
        assert list(p.track("abc")) == ["a", "b", "c"]
    assert p.done == 3 and lines(caplog) == []


def test_quiet_and_minus_q_turn_it_off(caplog):
    assert Progress("x", total=1, quiet=True, terminal=True).mode == "off"
    setup_logging(verbosity=-1)
    assert Progress("x", total=1, terminal=True).mode == "off"
    assert not progress_mod.enabled()
    setup_logging(verbosity=0)
    assert Progress("x", total=1, terminal=False).mode == "lines"


def test_terminal_bar_shows_rate_and_closes_when_the_loop_raises():
    p = Progress("rollout samples", total=10, unit="samples", terminal=True)
    assert p.mode == "bar"
    items = p.track(range(10))
    with pytest.raises(RuntimeError):
        for i in items:
            if i == 3:
                task = p._bar.tasks[0]
                assert (task.completed, task.total) == (3, 10) and "samples/s" in task.fields["rate"]
                raise RuntimeError("stage failed")
    items.close()  # what the interpreter does once the loop's frame is gone
    assert p._bar is None


@pytest.fixture
def pair(tmp_path):
    w0 = make_weights("bf16", seed=0)
    return (write_checkpoint(tmp_path / "weight_v000003", w0),
            write_checkpoint(tmp_path / "new", perturb(w0, lr=1e-3, seed=1), version=4))


def test_commands_show_progress_lines_and_minus_q_silences_them(tmp_path, pair, monkeypatch):
    monkeypatch.setattr(progress_mod, "DEFAULT_INTERVAL_S", 0.0)
    base, new = pair
    r = CliRunner().invoke(main, ["delta", "diff", "--base", str(base), "--new", str(new),
                                  "--out", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    assert "delta encode: " in r.stderr and "tensors/s" in r.stderr
    for quiet, out in (([], "o1"), (["-q"], "o2")):
        r = CliRunner().invoke(main, ["delta", "apply", *quiet, "--base", str(base), "--delta",
                                      str(tmp_path / "d"), "--out", str(tmp_path / out)])
        assert r.exit_code == 0, r.output
        assert ("delta apply: " in r.stderr) == (not quiet)
