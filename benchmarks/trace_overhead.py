"""Cost of trace spans: microseconds per span with tracing off and on, and the share of a
profiled run's step time the spans of that run cost (target < 2%).

    python -m benchmarks.trace_overhead [RUN] [--out DIR]    # RUN: a traced loop run directory

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from rltool import trace

from benchmarks import harness

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", nargs="?", help="a traced loop run directory")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bench = harness.Run("trace_overhead")
    result = {"off_us": per_span_s(on=False) * 1e6, "on_us": per_span_s(on=True) * 1e6}
    if args.run:
        from rltool.profile.events import read_events, spans

        events = read_events(args.run)
        steps = spans(events, name="step", cat="step")
        wall_s = sum(s["dur"] for s in steps) * 1e-6
        inside = [e for e in spans(events) if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"]
                                                  for s in steps)]
        result.update(spans_per_step=len(inside) / max(len(steps), 1), step_s=wall_s / len(steps),
                      overhead_fraction=len(inside) * result["on_us"] * 1e-6 / wall_s)
    bench.finish(result, out=args.out)


if __name__ == "__main__":
    main()
