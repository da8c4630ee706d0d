"""Children are ended by PID only after their command line matches engines.json."""

from __future__ import annotations

import subprocess
import sys

import psutil

from rltool.loop.engines import ChildRegistry, end_orphans
from rltool.rundir import RunDir


def sleeper(tag: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(120)  # {tag}"])


def test_end_orphans_checks_command_line(tmp_path):
    run = RunDir(tmp_path).create()
    ours, stranger = sleeper("ours"), sleeper("stranger")
    try:
        registry = ChildRegistry(run)
        registry.add(role="engine", pid=ours.pid, cmdline=psutil.Process(ours.pid).cmdline(),
                     url="http://127.0.0.1:1")
        # A recorded PID whose process now runs something else (PID reuse) is left alone.
        registry.add(role="trainer", pid=stranger.pid, cmdline=["python", "-m", "rltool", "train"])
        registry.add(role="engine", pid=2 ** 22 + 7, cmdline=["gone"])  # no such process
        assert len(run.read_engines()) == 3
        ended = end_orphans(run, timeout_s=10)
        assert ended == [ours.pid]
        assert ours.wait(timeout=10) is not None
        assert stranger.poll() is None
        assert run.read_engines() == []
    finally:
        for p in (ours, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_registry_remove(tmp_path):
    run = RunDir(tmp_path).create()
    registry = ChildRegistry(run)
    registry.add(role="engine", pid=11, cmdline=["a"], url="u")
    registry.add(role="trainer", pid=12, cmdline=["b"])
    registry.remove(11)
    assert [e["pid"] for e in run.read_engines()] == [12]
