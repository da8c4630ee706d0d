"""Trace events: one JSONL writer per process, read by `rltool profile`.

Every stage marks its phases with a one-line context manager:

    with trace.span("reward", cat="reward", step=k):
        ...

A span becomes one complete event (`"ph": "X"`, Chrome's Trace Event Format) with a start `ts` and
a duration `dur` in microseconds of wall-clock time, so events of different processes on one host
line up. Events are buffered and appended to `DIR/<role>-<pid>.jsonl` as whole lines (one `write`
per flush, the file opened with O_APPEND); a reader skips a torn last line. The format is
described in docs/formats.md ("Trace events").

Where the events go: `configure(DIR, role=...)` in this process, else the `RLTOOL_TRACE_DIR`
environment variable (set by `rltool loop` for the engines and trainers it starts; the role then
comes from `RLTOOL_TRACE_ROLE`, default the program name). With neither, `span` costs one
attribute check and writes nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rltool import atomic

ENV_DIR = "RLTOOL_TRACE_DIR"
ENV_ROLE = "RLTOOL_TRACE_ROLE"
ENV_TORCH_STEPS = "RLTOOL_TORCH_PROFILE_STEPS"  # e.g. "2,3": kernel traces of these loop steps
TORCH_DIR = "torch"
FLUSH_EVENTS = 512  # events buffered before a write; a flush also happens at exit and on close
FLUSH_INTERVAL_S = 2.0


class TraceWriter:
    """Buffered, thread-safe writer of one process's events to one JSONL file."""

    def __init__(self, path: str | os.PathLike, *, role: str):
        self.path = Path(path)
        self.role = role
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._last_flush = time.monotonic()
        # Wall-clock anchor + monotonic offsets: timestamps comparable across processes, and
        # durations immune to clock steps.
        self._wall0_us = time.time_ns() / 1000.0
        self._perf0 = time.perf_counter()
        # The folder and file appear with the first event: a stage that refuses its input
        # before doing anything leaves nothing on disk.
        self._fd = -1
        self._closed = False
        self._events = 0  # events emitted, not counting the process-name line
        self._buffer.append(self._line({"name": "process_name", "ph": "M", "ts": 0,
                                        "args": {"name": role}}))

    def now_us(self) -> float:
        return self._wall0_us + (time.perf_counter() - self._perf0) * 1e6

    def _line(self, event: dict[str, Any]) -> str:
        event.setdefault("pid", self.pid)
        event.setdefault("tid", threading.get_ident() & 0x3FFFFFFF)
        return json.dumps(event, separators=(",", ":"), default=str) + "\n"

    def emit(self, event: dict[str, Any]) -> None:
        line = self._line(event)
        with self._lock:
            self._buffer.append(line)
            self._events += 1
            due = (len(self._buffer) >= FLUSH_EVENTS
                   or time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S)
        if due:
            self.flush()

    def complete(self, name: str, *, cat: str, start_us: float, dur_us: float,
                 args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": round(start_us, 1),
                                 "dur": round(max(dur_us, 0.0), 1)}
        if args:
            event["args"] = args
        self.emit(event)

    def flush(self) -> None:
        with self._lock:
            if self._closed or self._events <= 0:
                return  # nothing but the process name yet
            if self._fd < 0:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            data, self._buffer = "".join(self._buffer), []
            self._last_flush = time.monotonic()
            if data:
                os.write(self._fd, data.encode())

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


_writer: TraceWriter | None = None
_resolved = False
_lock = threading.Lock()


def configure(directory: str | os.PathLike | None, *, role: str) -> TraceWriter | None:
    """Send this process's events to `directory/<role>-<pid>.jsonl` (None turns tracing off).
    Also exports the directory to child processes started afterwards."""
    global _writer, _resolved
    with _lock:
        if _writer is not None:
            _writer.close()
        _writer, _resolved = None, True
        if directory is None:
            os.environ.pop(ENV_DIR, None)
            return None
        os.environ[ENV_DIR] = str(directory)
        _writer = TraceWriter(Path(directory) / f"{role}-{os.getpid()}.jsonl", role=role)
        return _writer


@contextlib.contextmanager
def scope(directory: str | os.PathLike | None, *, role: str) -> Iterator[None]:
    """Trace the enclosed stage into `directory` unless this process already traces somewhere:
    a stage run alone traces beside its output, inside `rltool loop` it keeps the run's trace/.
    A stage that fails leaves no trace file in a directory the scope created."""
    if directory is None or writer() is not None:
        yield
        return
    created = atomic.missing_dirs(directory)
    w = configure(directory, role=role)
    done = False
    try:
        yield
        done = True
    finally:
        configure(None, role=role)
        if created and not done:
            w.path.unlink(missing_ok=True)
            atomic.remove_empty(created)


def _program_role() -> str:
    """`rltool serve ...` and `python -m rltool train ...` trace as `serve` / `train`."""
    argv = sys.argv
    if len(argv) > 1 and Path(argv[0]).name in ("rltool", "__main__.py"):
        return "".join(c for c in argv[1] if c.isalnum() or c in "-_") or "rltool"
    return "".join(c for c in Path(argv[0] or "python").stem if c.isalnum() or c in "-_") or "proc"


def writer() -> TraceWriter | None:
    """The process's writer; opened on first use from the environment."""
    global _writer, _resolved
    if _resolved and (_writer is None or _writer.pid == os.getpid()):
        return _writer
    with _lock:
        if _writer is not None and _writer.pid != os.getpid():  # a forked child: its own file
            _writer = None
        directory = os.environ.get(ENV_DIR)
        if directory and _writer is None:
            role = os.environ.get(ENV_ROLE) or _program_role()
            _writer = TraceWriter(Path(directory) / f"{role}-{os.getpid()}.jsonl", role=role)
        _resolved = True
        return _writer


@contextlib.contextmanager
def span(name: str, *, cat: str = "phase", **args: Any) -> Iterator[dict[str, Any]]:
    """Record the enclosed block as one complete event. The yielded dict takes extra args
    (e.g. a byte count known only at the end)."""
    w = writer()
    if w is None:
        yield args
        return
    start = w.now_us()
    try:
        yield args
    finally:
        w.complete(name, cat=cat, start_us=start, dur_us=w.now_us() - start, args=args)


def torch_steps() -> set[int]:
    raw = os.environ.get(ENV_TORCH_STEPS, "")
    try:
        return {int(s) for s in raw.split(",") if s.strip()}
    except ValueError:
        return set()  # a malformed value must not break training; `rltool profile` reports it


def torch_trace_path(directory: Path, *, name: str, step: int, pid: int) -> Path:
    return directory / TORCH_DIR / f"{name}-step-{step:06d}-{pid}.json"


@contextlib.contextmanager
def torch_profile(*, step: int | None, name: str) -> Iterator[None]:
    """torch.profiler around the block when `step` is one of RLTOOL_TORCH_PROFILE_STEPS and this
    process traces; the kernel trace goes to TRACE_DIR/torch/<name>-step-K-<pid>.json."""
    w = writer()
    if w is None or step is None or step not in torch_steps():
        yield
        return
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    out = torch_trace_path(w.path.parent, name=name, step=step, pid=os.getpid())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, out)  # readers never see half a trace


def counter(name: str, **values: float) -> None:
    """A counter sample (`"ph": "C"`), e.g. the requests in flight of an engine."""
    w = writer()
    if w is not None:
        w.emit({"name": name, "ph": "C", "ts": round(w.now_us(), 1), "args": values})


def flush() -> None:
    w = _writer
    if w is not None:
        w.flush()


@atexit.register
def _close_at_exit() -> None:
    w = _writer
    if w is not None and w.pid == os.getpid():
        w.close()
