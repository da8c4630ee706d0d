"""state.json: phase bookkeeping, load/save, corrupt files, the kill hook's trigger points."""

from __future__ import annotations

import pytest

from rltool.errors import BadInputError
from rltool.loop.state import LoopState
from rltool.rundir import RunDir


def test_phase_order_and_next_step(tmp_path):
    run = RunDir(tmp_path).create()
    state = LoopState(num_steps=3)
    assert not state.completed("rollout")
    state.done(run, "rollout", seconds=1.5)
    assert state.completed("rollout") and not state.completed("train")
    state.done(run, "publish", seconds=0.5)
    assert [p for p in ("rollout", "train", "publish", "sync", "eval") if state.completed(p)] == \
        ["rollout", "train", "publish"]
    loaded = LoopState.load(run)
    assert loaded == state and loaded.phase_times == {"rollout": 1.5, "publish": 0.5}
    state.next_step(run)
    loaded = LoopState.load(run)
    assert (loaded.step, loaded.phase, loaded.phase_times) == (1, None, {})


def test_missing_and_corrupt_state(tmp_path):
    run = RunDir(tmp_path).create()
    assert LoopState.load(run) is None
    run.state.write_text('{"step": 1, "phase": "training"}')
    with pytest.raises(BadInputError, match="unknown phase"):
        LoopState.load(run)
    run.state.write_text('{"step": 1, "colour": "red"}')
    with pytest.raises(BadInputError, match="not a loop state"):
        LoopState.load(run)
    run.state.write_text("{not json")
    with pytest.raises(BadInputError, match="not valid JSON"):
        LoopState.load(run)


def test_step_loop_freezes_long_lived_objects_and_restores_the_collector(monkeypatch):
    """The step loop's garbage-collector settings (rltool.loop.runner._freeze_long_lived): one
    collection, then what is left is frozen out of later ones and the young generation is
    collected less often; it returns the thresholds the loop restores when it returns. (The
    collection and the freeze are recorded here, not run: a full collection of the test process
    costs about a second.)"""
    import gc

    from rltool.loop import runner

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect"))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    before = gc.get_threshold()
    try:
        assert runner._freeze_long_lived() == before
        assert calls == ["collect", "freeze"]
        assert gc.get_threshold() == (runner.GC_YOUNG_ALLOCATIONS, *before[1:])
    finally:
        gc.set_threshold(*before)
