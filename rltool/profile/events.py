"""Reading a run's trace events and writing them as one Chrome/Perfetto trace.

Input: every `*.jsonl` under the trace folder (one file per process, rltool/trace.py). Output: a
JSON object `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}` in the Trace
Event Format that chrome://tracing and ui.perfetto.dev open. Complete events (`"ph": "X"`) of one
thread must nest; concurrent requests of an asyncio client share a thread and overlap, so each
overlapping event is moved to its own lane (a synthetic `tid` named after the lane).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rltool import atomic
from rltool.errors import BadInputError

PHASES_WITH_DURATION = {"X"}
KNOWN_PHASES = {"X", "B", "E", "i", "I", "C", "M", "b", "e", "n", "s", "t", "f"}
LANE_TID_BASE = 1 << 30  # above any real tid (writers mask thread ids to 30 bits)


def trace_dir(run: str | Path) -> Path:
    """RUN/trace, or the folder itself when it holds the JSONL files."""
    path = Path(run)
    if not path.exists():
        raise BadInputError(f"{path}: no such run directory or trace folder")
    if (path / "trace").is_dir():
        return path / "trace"
    if path.is_dir() and any(path.glob("*.jsonl")):
        return path
    raise BadInputError(f"{path} has no trace/ folder and no *.jsonl trace files; run "
                        "`rltool loop` (or a stage) to produce them")


def read_events(run: str | Path) -> list[dict[str, Any]]:
    """All events of all processes, sorted by start time; torn or foreign lines are skipped."""
    events: list[dict[str, Any]] = []
    for path in sorted(trace_dir(run).glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # the torn last line of a killed writer
            if isinstance(event, dict) and event.get("ph") in KNOWN_PHASES \
                    and isinstance(event.get("ts"), (int, float)):
                event["_role"] = path.stem.rsplit("-", 1)[0]
                events.append(event)
    if not any(e["ph"] == "X" for e in events):
        raise BadInputError(f"{trace_dir(run)} holds no complete trace events; was the run "
                            "traced (RUN/trace/*.jsonl)?")
    events.sort(key=lambda e: (e["ts"] if e["ph"] != "M" else -1, -e.get("dur", 0)))
    return events


def spans(events: list[dict[str, Any]], *, name: str | None = None, cat: str | None = None,
          role: str | None = None) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X" and (name is None or e.get("name") == name)
            and (cat is None or e.get("cat") == cat) and (role is None or e["_role"] == role)]


def _assign_lanes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Move complete events that overlap without nesting onto lanes of their own."""
    out: list[dict[str, Any]] = []
    open_ends: dict[tuple[Any, Any], list[float]] = {}  # (pid, tid) -> stack of end times
    lanes: dict[tuple[Any, Any], list[float]] = {}  # (pid, tid) -> end time per extra lane
    lane_tids: dict[tuple[Any, int], int] = {}
    names: list[dict[str, Any]] = []
    for e in events:
        if e["ph"] != "X":
            out.append(e)
            continue
        key = (e.get("pid"), e.get("tid"))
        start, end = e["ts"], e["ts"] + e["dur"]
        stack = open_ends.setdefault(key, [])
        while stack and stack[-1] <= start:
            stack.pop()
        if not stack or end <= stack[-1]:
            stack.append(end)
            out.append(e)
            continue
        ends = lanes.setdefault(key, [])
        for i, lane_end in enumerate(ends):
            if lane_end <= start:
                break
        else:
            i = len(ends)
            ends.append(0.0)
            lane_tids[(key, i)] = LANE_TID_BASE + len(names)
            names.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": key[0],
                          "tid": lane_tids[(key, i)],
                          "args": {"name": f"{e.get('cat', 'event')} lane {i + 1}"}})
        ends[i] = end
        out.append({**e, "tid": lane_tids[(key, i)]})
    return names + out


def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    clean = [{k: v for k, v in e.items() if not k.startswith("_")} for e in events]
    t0 = min(e["ts"] for e in clean if e["ph"] != "M")
    for e in clean:  # relative microseconds: readable numbers, same intervals
        if e["ph"] != "M":
            e["ts"] = round(e["ts"] - t0, 1)
    return {"traceEvents": _assign_lanes(clean), "displayTimeUnit": "ms",
            "otherData": {"producer": "rltool profile", "epoch_us": t0}}


def write_chrome_trace(events: list[dict[str, Any]], out: str | Path) -> Path:
    out = Path(out)
    atomic.write_text(out, json.dumps(chrome_trace(events), separators=(",", ":")))
    return out
