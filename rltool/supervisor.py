"""Child processes: one way to start them, wait until they serve, and end them.

`start` runs a command in its own session (process group, so nothing it forks outlives it
unnoticed) with stdout and stderr appended to a log file. `Child.wait_until` polls a readiness
check -- a ready file appearing (`wait_ready_file`), an HTTP route answering 200 (`wait_healthy`),
or any predicate -- and fails early, with the log's tail, when the child exits first, or at its
deadline. `Child.stop` sends SIGTERM (to the child, or to its whole group for programs that fork
workers, such as SGLang), waits, then SIGKILLs the group. A child is only ever ended through the
handle that started it, never by name.

Ready files are written atomically as {url, pid} (`announce_ready`) and removed on the way out
(`withdraw_ready`), so a reader never sees a partial file or, after a clean exit, a stale URL.
`free_port` picks a port for a child (or a rendezvous) to listen on.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from rltool import atomic
from rltool.errors import EngineError, EngineTimeoutError

POLL_S = 0.05
HEALTH_POLL_S = 0.25
LOG_TAIL_CHARS = 4000
T = TypeVar("T")


def log_tail(path: str | os.PathLike | None, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `chars` characters of a log file ('' when it cannot be read)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - chars, 0))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Child:
    """A started child. `url` is set once it serves (engines)."""

    popen: subprocess.Popen
    cmdline: list[str]
    log_path: Path | None
    name: str = "child"
    term_group: bool = False  # SIGTERM the whole group, not only the child
    url: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def with_log(self, message: str) -> str:
        tail = log_tail(self.log_path)
        return f"{message}; log {self.log_path} ends with:\n{tail}" if self.log_path else message

    def wait_until(self, check: Callable[[], T | None], *, timeout_s: float, what: str,
                   poll_s: float = POLL_S) -> T:
        """Poll `check` until it returns something other than None or False, and return that.
        Raises EngineError when the child exits first and EngineTimeoutError (after stopping the
        child) when `timeout_s` passes; both carry the log's tail."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = check()
            if result is not None and result is not False:
                return result
            code = self.popen.poll()
            if code is not None:
                raise EngineError(self.with_log(f"the {self.name} exited with code {code} "
                                                f"before it was {what}"))
            if time.monotonic() > deadline:
                self.stop()
                raise EngineTimeoutError(self.with_log(f"the {self.name} was stopped: still not "
                                                       f"{what} after {timeout_s:.0f}s"))
            time.sleep(poll_s)

    def wait_ready_file(self, path: str | os.PathLike, *, timeout_s: float) -> dict[str, Any]:
        """Wait for the ready file the child writes atomically once it serves; its content."""
        path = Path(path)

        def read() -> dict[str, Any] | None:
            try:
                return json.loads(path.read_text())
            except FileNotFoundError:
                return None

        return self.wait_until(read, timeout_s=timeout_s, what="ready")

    def wait_healthy(self, url: str, path: str, *, timeout_s: float,
                     api_key: str | None = None) -> None:
        wait_healthy(url, path, timeout_s=timeout_s, api_key=api_key, child=self)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to timeout_s, then SIGKILL the process group. Returns the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self.term_group:
                    os.killpg(self.pid, signal.SIGTERM)
                else:
                    os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(timeout_s)
        return self.popen.returncode

    def kill(self, timeout_s: float = 10.0) -> int | None:
        """SIGKILL the child's process group (it and whatever it forked) and reap the child."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=timeout_s)
        return self.popen.returncode


def start(cmdline: list[str], *, log_path: str | os.PathLike | None, name: str = "child",
          env: dict[str, str] | None = None, capture_stdout: bool = False,
          term_group: bool = False, die_with_parent: bool = False) -> Child:
    """Start `cmdline` in its own session; output is appended to `log_path` (stdout goes to a
    pipe instead with capture_stdout). `env` replaces the child's environment when given.
    `die_with_parent` (Linux): the kernel SIGKILLs the child when the thread that started it
    ends, so the child of a process that is killed (a Ray actor) is not left behind; start it
    from a thread that lives as long as the child should."""
    log = None
    if log_path is not None:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
    try:
        stdout = subprocess.PIPE if capture_stdout else (log or subprocess.DEVNULL)
        popen = subprocess.Popen(cmdline, stdout=stdout,
                                 stderr=log if log is not None else subprocess.DEVNULL,
                                 stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                 preexec_fn=_parent_death_signal if die_with_parent else None)
    finally:
        if log is not None:
            log.close()  # the child holds its own descriptor
    return Child(popen=popen, cmdline=list(cmdline), log_path=log_path, name=name,
                 term_group=term_group)


def _parent_death_signal() -> None:
    """In the forked child: ask for SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def wait_healthy(url: str, path: str, *, timeout_s: float, api_key: str | None = None,
                 child: Child | None = None) -> None:
    """Wait until GET url+path answers 200 (a started child, or a server someone else runs)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=5.0, headers=headers) as client:
        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return client.get(url + path).status_code == 200
            return False

        if child is not None:
            child.wait_until(healthy, timeout_s=timeout_s, what=f"answering {path}",
                             poll_s=HEALTH_POLL_S)
            return
        deadline = time.monotonic() + timeout_s
        while not healthy():
            if time.monotonic() > deadline:
                raise EngineTimeoutError(f"{url} did not answer {path} within {timeout_s:.0f}s")
            time.sleep(HEALTH_POLL_S)


def announce_ready(ready_file: str | os.PathLike | None, *, url: str, pid: int | None) -> None:
    if ready_file is not None:
        atomic.write_json(ready_file, {"url": url, "pid": pid})


def withdraw_ready(ready_file: str | os.PathLike | None) -> None:
    if ready_file is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready_file)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (IPv4 or IPv6) now. The socket is closed before the port is
    used, so another process may take it in between: callers whose child binds it must handle
    that (the kernel rarely hands the same ephemeral port out again at once)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def exit_now(code: int) -> NoReturn:
    """End this process without Python's teardown of its modules: with torch (and a CUDA
    context) loaded, about a second (two to three on a GPU host) that every stop of a server
    waited for. For a server whose work is done: the exit handlers still run (a trace file is
    closed by one), then the log and standard streams are flushed."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
