"""Kill points (rltool/faults.py) and the fault matrix: a stage SIGKILLed inside a phase shows no
partial artifact, and its re-run is bit-identical to an uninterrupted run.

The matrix runs a seeded sample of rltool.fault_sweep (the full sweep, `python -m
benchmarks.fault_sweep`, tries every kill point; its counts are in docs/reliability.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from rltool.fault_sweep import run_sweep

# The kill schedule; a failure names its point (NAME:N), which RLTOOL_KILL_AT=NAME:N reproduces.
SCHEDULE_SEED = 0


def run_points(spec: str | None, calls: list[str]) -> subprocess.CompletedProcess:
    code = ("from rltool.faults import kill_point\n"
            f"for name in {calls!r}:\n    kill_point(name)\n    print(name, flush=True)\n")
    env = dict(os.environ)
    env.pop("RLTOOL_KILL_AT", None)
    if spec is not None:
        env["RLTOOL_KILL_AT"] = spec
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def test_kill_point_fires_at_the_nth_call_of_its_name_only():
    calls = ["a", "b", "a", "b", "a"]
    proc = run_points("b:2", calls)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split() == ["a", "b", "a"]
    assert run_points(None, calls).stdout.split() == calls
    assert run_points("c:1", calls).returncode == 0


def test_a_malformed_kill_plan_is_refused():
    proc = run_points("a:0", ["a"])
    assert proc.returncode == 1 and "NAME:N with N >= 1" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["train", "delta diff", "delta apply", "delta pull"])
def test_killed_inside_a_stage_rerun_is_bit_identical(scenario):
    """SIGKILL at a seeded sample of points inside `rltool train` (mid-checkpoint-save) and
    `rltool delta diff/apply/pull` (mid-tensor, mid-file, mid-swap): nothing partial is visible
    under a final name, and the re-run's output equals the uninterrupted run's byte for byte."""
    r = run_sweep(only=[scenario], schedule_seed=SCHEDULE_SEED, max_per_point=1)[scenario]
    assert r["failures"] == [], r["failures"]
    assert r["kills"] == len(r["points"]), r  # every sampled point was reached
