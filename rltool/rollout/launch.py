"""Start `rltool serve` as a child process and wait until it is ready.

The child runs in its own process group with `--port 0 --ready-file <tmp>`; readiness is the ready
file ({url, pid}) appearing, failure is the process exiting first (the error carries the log tail)
or the timeout. `EngineProcess.stop` ends exactly the process it started: SIGTERM, then SIGKILL
to its process group (never by name).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rltool.errors import EngineError, EngineTimeoutError

POLL_S = 0.05
LOG_TAIL_CHARS = 4000


@dataclass
class EngineProcess:
    url: str
    pid: int
    cmdline: list[str]
    popen: subprocess.Popen

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to timeout_s, then SIGKILL the process group. Returns the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=timeout_s)
        return self.popen.returncode


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - chars, 0))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def start_engine(args: list[str], *, log_path: Path, ready_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> EngineProcess:
    """Run `python -m rltool serve *args` and return once it serves (see module docstring).
    `env` replaces the child's environment when given."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ready_dir = Path(tempfile.mkdtemp(prefix="rltool-engine-"))
    ready_file = ready_dir / "ready.json"
    cmdline = [sys.executable, "-m", "rltool", "serve", *args]
    if not _has_flag(args, "--port"):
        cmdline += ["--port", "0"]
    cmdline += ["--ready-file", str(ready_file)]
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(cmdline, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            if ready_file.exists():
                info = json.loads(ready_file.read_text())
                return EngineProcess(url=info["url"], pid=popen.pid, cmdline=cmdline, popen=popen)
            code = popen.poll()
            if code is not None:
                raise EngineError(f"the engine exited with code {code} before it was ready; "
                                  f"log {log_path} ends with:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                EngineProcess(url="", pid=popen.pid, cmdline=cmdline, popen=popen).stop()
                raise EngineTimeoutError(f"the engine was not ready within {ready_timeout_s:.0f}s;"
                                         f" log {log_path} ends with:\n{log_tail(log_path)}")
            time.sleep(POLL_S)
    except BaseException:
        if popen.poll() is None:
            EngineProcess(url="", pid=popen.pid, cmdline=cmdline, popen=popen).stop()
        raise
    finally:
        with contextlib.suppress(OSError):
            ready_file.unlink(missing_ok=True)
            ready_dir.rmdir()
