"""What limits a step that torch.profiler recorded: the device's busy time and the host gaps
between its kernels, device time per kernel kind, the top kernels, and the calls that made the
host wait for the device (torch's CUDA sync debug mode warnings), by the line that made them.

Input is the profiler's chrome trace (`prof.export_chrome_trace`: device events have `cat` in
DEVICE_EVENTS and `ts`/`dur` in microseconds). `profiled` runs a call under the profiler and
returns all of it: benchmarks/train_megatron.py profiles a train step with it, and
benchmarks/engine_graph_sampling.py a batch the engine's scheduler thread decodes.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rltool import atomic

# Device kernels by what they compute, for the profile summary (first match wins). The engine's
# own Triton kernels go by their function names: decode attention's two stages, the sampler's
# two passes, the Gated DeltaNet kernels, the fused RoPE + KV store.
KERNEL_KINDS = (
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|gmma|wgmma|matmul|^_w4a16$", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn|^_stage[12]$", re.I)),
    ("sampling", re.compile(r"^_partial$|^_combine$|sampling|multinomial|gumbel", re.I)),
    ("linear attention", re.compile(r"^_conv$|^_decode$|^_gated_norm$|^_chunk_", re.I)),
    ("rope and kv store", re.compile(r"^_rope_store$|rotary", re.I)),
    ("softmax", re.compile(r"softmax|logsumexp|cross_entropy", re.I)),
    ("reduction", re.compile(r"reduce|norm", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|index|cat|fill|"
                               r"silu|quantize", re.I)),
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


def profiled(fn: Callable[[], Any], step_s: float | None = None, *,
             table: Path | None = None) -> dict[str, Any]:
    """Run `fn` once under torch.profiler (CUDA's synchronizing calls recorded as warnings, from
    every thread); its operator table to `table` if given, and a summary: the top host
    operators by self CPU time and, on CUDA, `trace_summary` against `step_s` (the unprofiled
    time of the work, since the profiler's host overhead inflates it; the profiled seconds if
    None) and `host_syncs` (`sync_sites`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof, warnings.catch_warnings(record=True) as caught:
        # every sync debug warning, not only the first per line (other warnings as before)
        warnings.filterwarnings("always", message=".*synchroniz")
        start = time.perf_counter()
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
        profiled_s = time.perf_counter() - start
    averages = prof.key_averages()
    host = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:5]
    summary: dict[str, Any] = {
        "profiled_s": profiled_s,
        "host_top_ops": [{"name": e.key[:80], "self_cpu_ms": e.self_cpu_time_total / 1e3,
                          "calls": e.count} for e in host]}
    if table is not None:
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        atomic.write_text(table, averages.table(sort_by=key, row_limit=25))
        summary["table"] = str(table)
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        summary.update(trace_summary(events, step_s or profiled_s))
        summary["host_syncs"] = sync_sites(caught)
    return summary
