"""What a run's trace says: per-step phase times, each resource's wait ratio, the measured
throughput of the engines and the trainer, and the async speedup the measured times allow.

Definitions (docs/profile.md):
- a step's phases are the loop's `phase` spans inside its `step` span; `other` is the step's wall
  time not covered by any phase;
- a resource's busy time is the union of its spans (engines: `request` spans, per engine URL;
  trainer: `train` spans, else the `train` phase); wait ratio = 1 - busy / wall over the traced
  steps;
- t_R = rollout, t_T = train + publish, t_W = sync (weight load) per step, means over steps;
  t_sync = t_R + t_T + t_W, the one-step-off async bound t_async >= max(t_R, t_T) + t_W, and the
  speedup bound t_sync / t_async.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean
from typing import Any

from rltool.profile.events import spans

US = 1e-6


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start_us, end_us) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total * US


def _within(e: dict[str, Any], window: dict[str, Any]) -> bool:
    return window["ts"] <= e["ts"] and e["ts"] + e["dur"] <= window["ts"] + window["dur"] + 1.0


def step_table(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per traced step: wall seconds, seconds per phase, `other`, phase sum / wall."""
    rows = []
    phases = spans(events, cat="phase", role="loop")
    for step in spans(events, name="step", cat="step", role="loop"):
        row: dict[str, Any] = {"step": step.get("args", {}).get("step"),
                               "wall_s": step["dur"] * US}
        inside = [p for p in phases if _within(p, step)]
        for p in inside:
            row[p["name"]] = row.get(p["name"], 0.0) + p["dur"] * US
        covered = union_s([(p["ts"], p["ts"] + p["dur"]) for p in inside])
        row["other"] = max(row["wall_s"] - covered, 0.0)
        row["phase_sum_ratio"] = covered / row["wall_s"] if row["wall_s"] > 0 else 0.0
        rows.append(row)
    return rows


def wait_ratios(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{resource: {busy_s, wall_s, wait_ratio}} over the traced steps."""
    steps = spans(events, name="step", cat="step")
    if steps:
        t0 = min(s["ts"] for s in steps)
        t1 = max(s["ts"] + s["dur"] for s in steps)
    else:
        xs = spans(events)
        t0, t1 = min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs)
    wall = (t1 - t0) * US
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in spans(events, cat="request"):
        groups[f"engine {e.get('args', {}).get('engine', '?')}"].append(
            (max(e["ts"], t0), min(e["ts"] + e["dur"], t1)))
    trainer = spans(events, cat="train") or spans(events, name="train", cat="phase")
    groups["trainer"] = [(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in trainer]
    out = {}
    for name, intervals in sorted(groups.items()):
        busy = union_s([iv for iv in intervals if iv[1] > iv[0]])
        out[name] = {"busy_s": busy, "wall_s": wall,
                     "wait_ratio": 1.0 - busy / wall if wall > 0 else 0.0}
    return out


def phase_means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean t_R, t_T, t_W and step wall over the steps (0.0 for a phase never traced)."""
    def avg(*names: str) -> float:
        return mean(sum(r.get(n, 0.0) for n in names) for r in rows) if rows else 0.0
    return {"t_R_s": avg("rollout"), "t_T_s": avg("train", "publish"), "t_W_s": avg("sync"),
            "step_wall_s": avg("wall_s")}


def async_speedup(*, t_R_s: float, t_T_s: float, t_W_s: float) -> dict[str, float]:
    """The synchronous step, the one-step-off bound on the async step, and the speedup bound."""
    t_sync = t_R_s + t_T_s + t_W_s
    t_async = max(t_R_s, t_T_s) + t_W_s
    return {"t_sync_s": t_sync, "t_async_bound_s": t_async,
            "speedup_bound": t_sync / t_async if t_async > 0 else 1.0}


def measured_speedup(rows: list[dict[str, Any]]) -> float:
    """Sum of phase times over step wall time: how much the run overlapped its phases (1.0 for
    the synchronous loop; above 1 only when phases ran concurrently)."""
    wall = sum(r["wall_s"] for r in rows)
    phase = sum(v for r in rows for k, v in r.items()
                if k not in ("step", "wall_s", "other", "phase_sum_ratio"))
    return (phase + sum(r["other"] for r in rows)) / wall if wall > 0 else 1.0


def engine_throughput(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per engine: requests, tokens, busy seconds, prompt and completion tokens per busy second
    (mu_P, mu_D; the builtin engine does not time prefill apart, so both share the busy time),
    mean requests in flight, and the request-length statistics the recommendations use."""
    by_engine: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in spans(events, cat="request"):
        by_engine[str(e.get("args", {}).get("engine", "?"))].append(e)
    out = {}
    for engine, reqs in sorted(by_engine.items()):
        busy = union_s([(e["ts"], e["ts"] + e["dur"]) for e in reqs])
        args = [e.get("args", {}) for e in reqs]
        prompt = sum(a.get("prompt_tokens", 0) for a in args)
        completion = sum(a.get("completion_tokens", 0) for a in args)
        cached = sum(a.get("cached_tokens", 0) for a in args)
        in_flight = sum(e["dur"] for e in reqs) * US / busy if busy > 0 else 0.0
        out[engine] = {
            "requests": len(reqs), "busy_s": busy, "prompt_tokens": prompt,
            "completion_tokens": completion,
            "mu_P_tokens_per_s": prompt / busy if busy > 0 else 0.0,
            "mu_D_tokens_per_s": completion / busy if busy > 0 else 0.0,
            "tokens_per_s": (prompt + completion) / busy if busy > 0 else 0.0,
            "mean_in_flight": in_flight,
            "mean_sequence_tokens": (prompt + completion) / len(reqs) if reqs else 0.0,
            "mean_prompt_tokens": prompt / len(reqs) if reqs else 0.0,
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
        }
    return out


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    rows = step_table(events)
    means = phase_means(rows)
    predicted = async_speedup(t_R_s=means["t_R_s"], t_T_s=means["t_T_s"], t_W_s=means["t_W_s"])
    return {"steps": rows, "phase_means": means, "wait_ratios": wait_ratios(events),
            "engines": engine_throughput(events),
            "async": {**predicted, "measured_speedup": measured_speedup(rows)}}
