"""The publish cost model: whether version N reaches the engines faster as a full checkpoint or
as a delta, from the link bandwidth and throughputs measured on earlier publishes.

  full   t_full  = S/B + t0                       (S: full bytes; the engine loads it directly)
  delta  t_delta = W/B + t0 + S/decode_Bps        (W: the delta's wire bytes, measured by encoding
                                                   it; the engine's pull rebuilds S bytes)

with B the link bandwidth to the engines (given, or measured from full publishes) and decode_Bps
measured on earlier publishes (an exponential average kept in `<publish_dir>/.publish_stats.json`,
seeded from the benchmark). Mid-chain, `auto` first predicts t_delta from history (the last wire
ratio W/S and encode throughput, encode time included) and skips encoding when full clearly
wins; right after a full version it always encodes and measures. A full version is forced when
the chain of deltas ending at the base is `full_every - 1` long (so pulls apply at most that many
deltas).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rltool import atomic
from rltool.delta.config import SyncConfig

STATS_FILE = ".publish_stats.json"
# Seeds for the measured averages, from benchmarks/delta_sync.py on the 2-core CPU box (bytes/s).
DEFAULT_DECODE_BPS = 1.7e9  # 0.988 GB rebuilt in 0.57 s (lr 1e-6, native kernels)
DEFAULT_LINK_BPS = 1.25e9  # 10 Gb/s, when neither given nor measured yet
EMA = 0.5


def load_stats(publish_dir: Path) -> dict[str, float]:
    """The measured averages of earlier publishes to `publish_dir` (none yet: empty)."""
    try:
        return {k: float(v) for k, v in json.loads((publish_dir / STATS_FILE).read_text()).items()}
    except (FileNotFoundError, json.JSONDecodeError, ValueError, AttributeError):
        return {}


def save_stats(publish_dir: Path, stats: Mapping[str, float]) -> None:
    atomic.write_json(publish_dir / STATS_FILE, dict(stats))


def update_average(stats: dict[str, float], key: str, value: float) -> None:
    stats[key] = value if key not in stats else EMA * value + (1 - EMA) * stats[key]


def predict_times(*, full_bytes: int, wire_bytes: int, link_Bps: float, decode_Bps: float,
                  t0_s: float = 0.0) -> tuple[float, float]:
    """(t_full, t_delta) of the cost model above, in seconds."""
    return (full_bytes / link_Bps + t0_s,
            wire_bytes / link_Bps + t0_s + full_bytes / decode_Bps)


def breakeven_bandwidth(*, full_bytes: int, wire_bytes: int, process_s: float) -> float:
    """Link bandwidth (bytes/s) below which a delta beats a full version: S/B > W/B + process_s."""
    return (full_bytes - wire_bytes) / process_s if process_s > 0 else float("inf")


@dataclass(frozen=True)
class Decision:
    """The cost model's answer: publish a delta or not, why, and the predicted times (seconds)."""

    delta: bool
    reason: str
    predicted_full_s: float | None = None
    predicted_delta_s: float | None = None
    in_memory: str | None = None  # "tensor" or "distributed": no disk version needed


def link_bandwidth_Bps(sync: SyncConfig, stats: Mapping[str, float]) -> float:
    """The trainer-to-engine bandwidth in bytes/s: `link_bandwidth_gbps` (gigabits/s) when given,
    else measured from earlier full publishes, else DEFAULT_LINK_BPS."""
    if sync.link_bandwidth_gbps:
        return sync.link_bandwidth_gbps * 1e9 / 8
    return stats.get("link_Bps", DEFAULT_LINK_BPS)


def decide(sync: SyncConfig, *, version: int, chain_length: int, full_bytes: int,
           stats: Mapping[str, float], t0_s: float = 0.0,
           wire_bytes: int | None = None) -> Decision:
    """Before encoding (`wire_bytes` None): whether a delta is worth encoding at all. After
    (`wire_bytes` measured): whether to publish it."""
    link = link_bandwidth_Bps(sync, stats)
    decode_Bps = stats.get("decode_Bps", DEFAULT_DECODE_BPS)
    if wire_bytes is not None:
        t_full, t_delta = predict_times(full_bytes=full_bytes, wire_bytes=wire_bytes,
                                        link_Bps=link, decode_Bps=decode_Bps, t0_s=t0_s)
        if sync.sync == "delta":
            return Decision(True, "--sync delta", t_full, t_delta)
        if t_delta < t_full:
            return Decision(True, "cost model: delta faster", t_full, t_delta)
        return Decision(False, "cost model: full faster", t_full, t_delta)
    if sync.sync == "full":
        return Decision(False, "--sync full")
    if version == 0:
        return Decision(False, "version 0 has no base")
    if chain_length + 1 >= sync.full_every:
        return Decision(False, f"a full version every {sync.full_every} (--full-every)")
    if sync.sync == "auto" and chain_length > 0 and {"wire_ratio", "encode_Bps"} <= stats.keys():
        # Mid-chain, with history: predict the delta (encode included) before paying for it.
        # Right after a full version auto always measures again, so history cannot go stale.
        t_full, t_delta = predict_times(
            full_bytes=full_bytes, wire_bytes=int(full_bytes * stats["wire_ratio"]),
            link_Bps=link, decode_Bps=decode_Bps, t0_s=t0_s)
        t_delta += full_bytes / stats["encode_Bps"]
        if t_delta >= t_full:
            return Decision(False, "cost model (measured history): full faster", t_full, t_delta)
    return Decision(True, "encode and measure")
