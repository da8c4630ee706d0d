"""Running a benchmark as CI does, from the tests of benchmarks/: `python -m benchmarks.NAME`
from the repository root on the CPU (no CUDA device visible, one OpenMP thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`python -m benchmarks.NAME ARGS`, its output captured as text."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout_s)


def record_of(proc: subprocess.CompletedProcess) -> dict:
    """The record a successful run prints as stdout's last line (a failed run fails the test with
    the tail of its stderr)."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
