"""state.json: phase bookkeeping, load/save, corrupt files, the kill hook's trigger points."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

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


def test_recording_a_phase_reaches_its_kill_point_after_state_json_is_written(tmp_path):
    """RLTOOL_KILL_AT=loop.PHASE:N kills the loop right after the N-th record of PHASE: the
    state.json a resume reads already holds it."""
    code = ("import sys\n"
            "from rltool.loop.state import LoopState\n"
            "from rltool.rundir import RunDir\n"
            "run, state = RunDir(sys.argv[1]).create(), LoopState(num_steps=3)\n"
            "for step in range(3):\n"
            "    for phase in ('rollout', 'train', 'publish'):\n"
            "        state.done(run, phase)\n"
            "        print(step, phase, flush=True)\n"
            "    state.next_step(run)\n")
    env = dict(os.environ, RLTOOL_KILL_AT="loop.train:2")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.splitlines() == ["0 rollout", "0 train", "0 publish", "1 rollout"]
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert (state["step"], state["phase"]) == (1, "train")
