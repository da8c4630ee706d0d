"""rltool.supervisor: readiness, early death, timeouts and ending a child with what it forked."""

from __future__ import annotations

import json
import signal
import sys
import textwrap

import psutil
import pytest

from rltool.errors import EngineError, EngineTimeoutError
from rltool.supervisor import announce_ready, start, withdraw_ready


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_ready_file_is_waited_for_and_read(tmp_path):
    ready = tmp_path / "ready.json"
    child = start(py(f"""
        import time
        from rltool.supervisor import announce_ready
        time.sleep(0.3)
        announce_ready({str(ready)!r}, url="http://x:1", pid=7)
        time.sleep(60)
        """), log_path=tmp_path / "child.log")
    try:
        assert child.wait_ready_file(ready, timeout_s=30) == {"url": "http://x:1", "pid": 7}
        assert child.alive()
    finally:
        assert child.stop(timeout_s=10) is not None
    assert not child.alive()


def test_a_child_dying_before_ready_reports_its_log(tmp_path):
    child = start(py("import sys; print('boom: bad config', flush=True); sys.exit(4)"),
                  log_path=tmp_path / "child.log", name="engine")
    with pytest.raises(EngineError) as err:
        child.wait_ready_file(tmp_path / "never.json", timeout_s=30)
    message = str(err.value)
    assert "the engine exited with code 4 before it was ready" in message
    assert "boom: bad config" in message and str(tmp_path / "child.log") in message


def test_a_timeout_stops_the_child(tmp_path):
    """wait_until's deadline raises EngineTimeoutError and stops the child (SIGTERM) rather than
    leaving it running; checked by the error and the child's exit status, not by timing."""
    child = start(py("import time; time.sleep(60)"), log_path=tmp_path / "child.log")
    try:
        with pytest.raises(EngineTimeoutError) as err:
            child.wait_until(lambda: None, timeout_s=0.3, what="ready")
        assert "still not ready after 0s" in str(err.value)
        assert not child.alive() and child.popen.returncode == -signal.SIGTERM
    finally:
        child.kill()


def test_stop_ends_what_the_child_forked_and_escalates_to_sigkill(tmp_path):
    """stop() escalates to SIGKILL of the process group when SIGTERM is ignored, ending the child
    and its grandchild; checked by the exit status and the grandchild's end, not by timing."""
    pid_file = tmp_path / "grandchild.pid"
    # The child ignores SIGTERM and forks a grandchild that does too: only SIGKILL of the group
    # ends both.
    child = start(py(f"""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        g = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                              " time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(g.pid))
        time.sleep(60)
        """), log_path=tmp_path / "child.log", term_group=True)
    # (None until the pid is written: the file exists, empty, between its open and its write)
    grandchild = child.wait_until(
        lambda: (pid_file.read_text().strip() or None) if pid_file.exists() else None,
        timeout_s=30, what="forking")
    grandchild = psutil.Process(int(grandchild))
    code = child.stop(timeout_s=0.5)
    assert code == -signal.SIGKILL  # SIGTERM was ignored: stop escalated to killing the group
    grandchild.wait(timeout=10)  # reaped by init once killed: gone, not left running


def test_ready_file_round_trip(tmp_path):
    ready = tmp_path / "r.json"
    announce_ready(ready, url="http://h:2", pid=None)
    assert json.loads(ready.read_text()) == {"url": "http://h:2", "pid": None}
    withdraw_ready(ready)
    withdraw_ready(ready)  # already gone: fine
    assert not ready.exists()
    announce_ready(None, url="u", pid=1)  # no ready file asked for
