"""The engine's decode steps from its trace: each step's wall time split into device work and
host work.

A traced engine marks each decode step (`decode.step`, its `batch` in the args), the model's
decode forward inside it (`decode.forward`) and the sampler (`decode.sample`). Device work is
the time of the forward and sampler spans inside the step (on the CPU they run synchronously,
so their spans time the work itself; on CUDA they time the launches); host work is the rest:
the scheduler's per-request work, page-table bookkeeping, building the step's tensors, reading
tokens back. A `decode.step` span that ran a block of N steps (`steps` in its args) counts as N
steps of 1/N of its time.
"""

from __future__ import annotations

from typing import Any

from rltool.profile.events import spans

STEP = "decode.step"
DEVICE_SPANS = ("decode.forward", "decode.sample")
ROUNDING_US = 0.2  # the writer rounds ts and dur to 0.1 µs: a child may end past its parent by that


def decode_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per `decode.step` span, in time order: batch, steps (N of a block), and wall,
    device and host microseconds per decode step."""
    device = sorted((e for e in spans(events) if e.get("name") in DEVICE_SPANS),
                    key=lambda e: e["ts"])
    rows = []
    for step in spans(events, name=STEP):
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = sum(e["dur"] for e in device
                     if e["pid"] == step["pid"] and e.get("tid") == step.get("tid")
                     and start - ROUNDING_US <= e["ts"]
                     and e["ts"] + e["dur"] <= end + ROUNDING_US)
        args = step.get("args", {})
        n = max(int(args.get("steps", 1)), 1)
        rows.append({"batch": args.get("batch"), "steps": n, "wall_us": step["dur"] / n,
                     "device_us": inside / n, "host_us": (step["dur"] - inside) / n})
    return rows
