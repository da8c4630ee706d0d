"""What limits a step that torch.profiler recorded: the device's busy time and the host gaps
between its kernels, device time per kernel kind, the top kernels, and the calls that made the
host wait for the device (torch's CUDA sync debug mode warnings), by the line that made them.

Input is the profiler's chrome trace (`prof.export_chrome_trace`: device events have `cat` in
DEVICE_EVENTS and `ts`/`dur` in microseconds); benchmarks/train_megatron.py summarises its
profiled step with it.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

# Device kernels by what they compute, for the profile summary (first match wins).
KERNEL_KINDS = (
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|gmma|wgmma", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("softmax", re.compile(r"softmax|logsumexp|cross_entropy", re.I)),
    ("reduction", re.compile(r"reduce|norm", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|index|cat|fill", re.I)),
)
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_kind(name: str, cat: str) -> str:
    """The kind of a device event: by the kernel's name before its template arguments (which
    name unrelated functors), else by the whole name."""
    if cat != "kernel":
        return cat.removeprefix("gpu_")
    for text in (name.split("<")[0], name):
        for kind, pattern in KERNEL_KINDS:
            if pattern.search(text):
                return kind
    return "other"


def trace_summary(events: list[dict[str, Any]], step_s: float, *, top: int = 10,
                  gap_us: float = 50.0) -> dict[str, Any]:
    """What limits a profiled step, from its chrome-trace events (device kernels, copies and
    memsets: `cat` in DEVICE_EVENTS, `ts`/`dur` in microseconds) and the step's unprofiled time:
    the device's busy time (the union of its events over all streams) as a fraction of the step,
    the idle gaps between device work (where the device waits for the host), device time per
    kernel kind and the top kernels, and `limit`: the largest of the step's shares (device idle,
    or a kernel kind)."""
    device = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", ""), e["cat"])
                    for e in events if e.get("cat") in DEVICE_EVENTS and e.get("ph") == "X")
    busy_us, gaps, end = 0.0, [], None
    for start, stop, name, _ in device:
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, name))
            busy_us += stop - start
            end = stop
        elif stop > end:
            busy_us += stop - end
            end = stop
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for start, stop, name, cat in device:
        kind = kernel_kind(name, cat)
        by_kind[kind] = by_kind.get(kind, 0.0) + (stop - start)
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += stop - start
        entry[1] += 1
    step_us = step_s * 1e6
    long_gaps = sorted((g for g in gaps if g[0] >= gap_us), reverse=True)
    shares = {"device idle": max(0.0, 1.0 - busy_us / step_us),
              **{kind: t / step_us for kind, t in by_kind.items()}}
    limit = max(shares, key=shares.get)
    return {
        "device_busy_s": busy_us / 1e6,
        "gpu_busy_fraction": busy_us / step_us,
        "device_events": len(device),
        "device_span_s": (device[-1][1] - device[0][0]) / 1e6 if device else 0.0,
        "host_gaps": {"count": len(gaps), "idle_s": sum(g for g, _ in gaps) / 1e6,
                      f"count_over_{gap_us:g}us": len(long_gaps),
                      f"idle_over_{gap_us:g}us_s": sum(g for g, _ in long_gaps) / 1e6,
                      "largest": [{"ms": g / 1e3, "before": name[:80]}
                                  for g, name in long_gaps[:5]]},
        "device_s_by_kind": {k: t / 1e6 for k, t in sorted(by_kind.items(),
                                                            key=lambda kv: -kv[1])},
        "top_kernels": [{"name": name[:100], "ms": t / 1e3, "calls": n}
                        for name, (t, n) in sorted(by_name.items(),
                                                   key=lambda kv: -kv[1][0])[:top]],
        "limit": f"{limit} ({shares[limit]:.0%} of the step)",
    }


def sync_sites(caught: list[warnings.WarningMessage], *, top: int = 8) -> dict[str, Any]:
    """The sync debug mode's warnings -> their count and the Python lines that made them (the
    file's last two path parts), most frequent first."""
    sites = Counter(f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
                    for w in caught if "synchroniz" in str(w.message))
    return {"count": sum(sites.values()),
            "sites": [{"at": at, "calls": n} for at, n in sites.most_common(top)]}
