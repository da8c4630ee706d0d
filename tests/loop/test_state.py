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


def test_step_loop_freezes_long_lived_objects_and_restores_the_collector():
    """The step loop's garbage-collector settings (rltool.loop.runner._freeze_long_lived):
    what exists after the first step is frozen out of collections and the young generation is
    collected less often; the loop gives both back when it returns."""
    import gc

    from rltool.loop import runner

    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    restore = runner._freeze_long_lived()
    try:
        assert restore == before
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (runner.GC_YOUNG_ALLOCATIONS, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*restore)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
