"""`rltool profile RUN` as a library: read the trace, write the Chrome trace, summarize."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rltool import trace
from rltool.errors import BadInputError
from rltool.profile.analyze import summarize
from rltool.profile.events import read_events, trace_dir, write_chrome_trace
from rltool.rundir import RunDir

CHROME_TRACE = "chrome_trace.json"


def kernel_traces(folder: Path, steps: list[int], *, top: int = 10) -> dict[str, Any]:
    """The torch.profiler traces of `steps` and their most expensive operations (inclusive
    time summed over calls)."""
    import json
    from collections import defaultdict

    found: dict[str, Any] = {}
    for step in steps:
        files = sorted((folder / trace.TORCH_DIR).glob(f"*-step-{step:06d}-*.json"))
        if not files:
            raise BadInputError(
                f"--torch-profiler: no kernel trace for step {step} in {folder / trace.TORCH_DIR}; "
                f"run (or resume) the loop with {trace.ENV_TORCH_STEPS}={step} to capture it")
        totals: dict[str, float] = defaultdict(float)
        for path in files:
            try:
                events = json.loads(path.read_text()).get("traceEvents", [])
            except json.JSONDecodeError as e:
                raise BadInputError(f"{path} is not a JSON trace ({e})") from None
            for e in events:
                if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "kernel", "gpu_op"):
                    totals[e.get("name", "?")] += float(e.get("dur", 0))
        ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
        found[str(step)] = {"files": [str(p) for p in files],
                            "top_ops": [{"op": k, "total_us": v} for k, v in ranked]}
    return found


def profile_run(run: str | Path, *, out: str | Path | None = None,
                torch_steps: list[int] | None = None) -> dict[str, Any]:
    """Summary of a traced run plus the path of its Chrome trace (default
    RUN/profile/chrome_trace.json, RUN being the folder that holds trace/)."""
    events = read_events(run)
    folder = trace_dir(run)
    target = Path(out) if out else RunDir(folder.parent).profile / CHROME_TRACE
    result = summarize(events)
    result["chrome_trace"] = str(write_chrome_trace(events, target))
    result["trace_dir"] = str(folder)
    result["processes"] = sorted({e["_role"] for e in events})
    if torch_steps:
        result["kernel_traces"] = kernel_traces(folder, torch_steps)
    return result
