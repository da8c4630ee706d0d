"""Cost of trace spans: microseconds per span with tracing off and on, and the share of a
profiled run's step time the spans of that run cost (target < 2%).

    python benchmarks/trace_overhead.py [RUN]    # RUN: a traced loop run directory
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from rltool import trace

N = 20000


def per_span_s(*, on: bool) -> float:
    if on:
        trace.configure(tempfile.mkdtemp(), role="bench")
    t = time.perf_counter()
    for i in range(N):
        with trace.span("x", cat="request", engine="http://127.0.0.1:1") as ev:
            ev["prompt_tokens"] = i
    seconds = (time.perf_counter() - t) / N
    trace.configure(None, role="bench")
    return seconds


def main() -> None:
    result = {"off_us": per_span_s(on=False) * 1e6, "on_us": per_span_s(on=True) * 1e6}
    if len(sys.argv) > 1:
        from rltool.profile.events import read_events, spans

        events = read_events(sys.argv[1])
        steps = spans(events, name="step", cat="step")
        wall_s = sum(s["dur"] for s in steps) * 1e-6
        inside = [e for e in spans(events) if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"]
                                                  for s in steps)]
        result.update(spans_per_step=len(inside) / max(len(steps), 1), step_s=wall_s / len(steps),
                      overhead_fraction=len(inside) * result["on_us"] * 1e-6 / wall_s)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
