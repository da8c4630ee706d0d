"""`rltool profile RUN` as a library: read the trace, write the Chrome trace, summarize."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rltool.profile.analyze import summarize
from rltool.profile.events import read_events, trace_dir, write_chrome_trace

CHROME_TRACE = "chrome_trace.json"


def profile_run(run: str | Path, *, out: str | Path | None = None) -> dict[str, Any]:
    """Summary of a traced run plus the path of its Chrome trace (default RUN/trace/../
    profile/chrome_trace.json, i.e. beside the trace folder)."""
    events = read_events(run)
    folder = trace_dir(run)
    target = Path(out) if out else folder.parent / "profile" / CHROME_TRACE
    result = summarize(events)
    result["chrome_trace"] = str(write_chrome_trace(events, target))
    result["trace_dir"] = str(folder)
    result["processes"] = sorted({e["_role"] for e in events})
    return result
