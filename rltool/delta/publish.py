"""Trainer side of weight sync: publish version N as a full checkpoint or a delta on version N-1.

`auto` decides by the cost model t ≈ S/B + t0 (+ processing time) for each mode:
  full   t_full  = S/B + t0                       (S: full bytes; the engine loads it directly)
  delta  t_delta = W/B + t0 + S/decode_Bps        (W: the delta's wire bytes, measured by encoding
                                                   it; the engine's pull rebuilds S bytes)
with B the link bandwidth to the engines (given, or measured from full publishes) and decode_Bps
measured on earlier publishes (an exponential average kept in `<publish_dir>/.publish_stats.json`,
seeded from the benchmark). Mid-chain, `auto` first predicts t_delta from history (the last wire
ratio W/S and encode throughput, encode time included) and skips encoding when full clearly
wins; right after a full version it always encodes and measures. A full version is forced when
the chain of deltas ending at the base is `full_every - 1` long (so pulls apply at most that many
deltas), and whenever the base cannot be reconstructed.

The base (version N-1, complete) lives in a host-local cache directory kept by `pull_weights`,
so the publisher reuses the engine-side code path, and every delta it publishes is decoded and
checksum-verified once before the next one is built on it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rltool import atomic
from rltool.rundir import VERSION_FILE
from rltool.delta.checkpoint import INDEX_NAME, is_delta_dir, open_checkpoint
from rltool.delta.deltadir import open_delta
from rltool.delta.diff import write_delta
from rltool.delta.pull import SYNC_DIR, swap_in, host_lock, pull_weights, read_local_version
from rltool.errors import BadInputError, CheckpointError, DeltaChainError
from rltool.rundir import weight_dir_name

MODES = ("full", "delta", "auto")
STATS_FILE = ".publish_stats.json"
CACHE_DIR = ".publish_cache"
# Seeds for the measured averages, from benchmarks/delta_sync.py on the 2-core CPU box (bytes/s).
DEFAULT_DECODE_BPS = 1.7e9  # 0.988 GB rebuilt in 0.57 s (lr 1e-6, native kernels)
DEFAULT_LINK_BPS = 1.25e9  # 10 Gb/s, when neither given nor measured yet
EMA = 0.5


def _load_stats(publish_dir: Path) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads((publish_dir / STATS_FILE).read_text()).items()}
    except (FileNotFoundError, json.JSONDecodeError, ValueError, AttributeError):
        return {}


def _update(stats: dict[str, float], key: str, value: float) -> None:
    stats[key] = value if key not in stats else EMA * value + (1 - EMA) * stats[key]


def predict_times(*, full_bytes: int, wire_bytes: int, link_Bps: float, decode_Bps: float,
                  t0_s: float = 0.0) -> tuple[float, float]:
    """(t_full, t_delta) of the cost model above, in seconds."""
    return (full_bytes / link_Bps + t0_s,
            wire_bytes / link_Bps + t0_s + full_bytes / decode_Bps)


def breakeven_bandwidth(*, full_bytes: int, wire_bytes: int, process_s: float) -> float:
    """Link bandwidth (bytes/s) below which a delta beats a full version: S/B > W/B + process_s."""
    return (full_bytes - wire_bytes) / process_s if process_s > 0 else float("inf")


def _chain_length(publish_dir: Path, base: int) -> int:
    """How many deltas in a row end at version `base` (0 when `base` is full or absent)."""
    length, v = 0, base
    while True:
        path = publish_dir / weight_dir_name(v)
        try:
            if not path.is_dir() or not is_delta_dir(path):
                return length
            v = open_delta(path).base_version
        except (CheckpointError, DeltaChainError):
            return length  # a broken link: the pull will say so, and publish falls back to full
        length += 1


def _copy_full(src: Path, out: Path, *, version: int) -> None:
    with atomic.publish_dir(out) as tmp:
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if p.is_file() and not any(part.startswith(".") for part in rel.parts) \
                    and rel.as_posix() != INDEX_NAME:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, tmp / rel)
        atomic.write_json(tmp / VERSION_FILE, {"version": version})
        if (src / INDEX_NAME).is_file():  # the index last: readers treat it as the marker
            shutil.copyfile(src / INDEX_NAME, tmp / INDEX_NAME)


def _stage_state_dict(state: Mapping[str, Any], cache: Path, *, source_model_dir: Path | None,
                      dtype: str, version: int) -> Path:
    from rltool.train.publish import write_hf_dir

    if source_model_dir is None:
        raise BadInputError("publishing a state dict needs source_model_dir (config + tokenizer)")
    staging = cache / SYNC_DIR / "next"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_hf_dir(staging, dict(state), source_model_dir=source_model_dir, dtype=dtype)
    atomic.write_json(staging / VERSION_FILE, {"version": version})
    return staging


def publish_version(new_state_or_dir: Mapping[str, Any] | str | os.PathLike, *,
                    publish_dir: str | os.PathLike, version: int, mode: str = "auto",
                    fmt: str = "rltool", encoding: str = "xor", full_every: int = 10,
                    base_model_path: str | os.PathLike | None = None,
                    source_model_dir: str | os.PathLike | None = None, dtype: str = "fp32",
                    link_bandwidth_Bps: float | None = None, t0_s: float = 0.0,
                    cache_dir: str | os.PathLike | None = None,
                    workers: int | None = None, base_version: int | None = None
                    ) -> dict[str, Any]:
    """Publish `<publish_dir>/weight_v{version:06d}` as a full checkpoint or a delta on version-1
    (or on `base_version`, the previous published version when one step applied several
    optimizer steps).

    `new_state_or_dir`: a full HF checkpoint directory, or a state dict (HF names; written with
    config/tokenizer from `source_model_dir` at `dtype`, like rltool.train.publish). Version 0's
    base is `base_model_path` when `publish_dir` has no weight_v000000. Returns metrics:
    perf/update_weights_density, perf/update_weights_wire_bytes, perf/update_weights_time and
    sync/* details (mode chosen, reason, predicted times).
    """
    if mode not in MODES:
        raise BadInputError(f"unknown --sync {mode!r}; choose one of {', '.join(MODES)}")
    if full_every < 1:
        raise BadInputError(f"--full-every must be >= 1, got {full_every}")
    base = version - 1 if base_version is None else base_version
    if version > 0 and not 0 <= base < version:
        raise BadInputError(f"base version {base} must be below version {version}")
    t_start = time.perf_counter()
    publish_dir = Path(publish_dir)
    out = publish_dir / weight_dir_name(version)
    if out.exists():
        raise BadInputError(f"{out} already exists; a published version is never replaced")
    cache = Path(cache_dir) if cache_dir is not None else publish_dir / CACHE_DIR
    stats = _load_stats(publish_dir)
    staged = None
    if isinstance(new_state_or_dir, Mapping):
        staged = _stage_state_dict(new_state_or_dir, cache, version=version, dtype=dtype,
                                   source_model_dir=Path(source_model_dir) if source_model_dir
                                   else None)
        new_dir = staged
    else:
        new_dir = Path(new_state_or_dir)
    new = open_checkpoint(new_dir)
    full_bytes = sum(new.spec(n)[2] for n in new.names())
    link = link_bandwidth_Bps or stats.get("link_Bps", DEFAULT_LINK_BPS)
    decode_Bps = stats.get("decode_Bps", DEFAULT_DECODE_BPS)

    reason, delta_stats = "", None
    chain = _chain_length(publish_dir, base) if version > 0 else 0
    predicted_full = predicted_delta = None
    if mode == "full":
        reason = "--sync full"
    elif version == 0:
        reason = "version 0 has no base"
    elif chain + 1 >= full_every:
        reason = f"a full version every {full_every} (--full-every)"
    elif mode == "auto" and chain > 0 and {"wire_ratio", "encode_Bps"} <= stats.keys():
        # Mid-chain, with history: predict the delta (encode included) before paying for it.
        # Right after a full version auto always measures again, so history cannot go stale.
        predicted_full, predicted_delta = predict_times(
            full_bytes=full_bytes, wire_bytes=int(full_bytes * stats["wire_ratio"]),
            link_Bps=link, decode_Bps=decode_Bps, t0_s=t0_s)
        predicted_delta += full_bytes / stats["encode_Bps"]
        if predicted_delta >= predicted_full:
            reason = "cost model (measured history): full faster"
    if not reason:
        try:
            t = time.perf_counter()
            pulled = pull_weights(local_checkpoint_dir=cache, source_dir=publish_dir,
                                  target_version=base, base_model_path=base_model_path,
                                  workers=workers)
            if pulled["changed"]:
                _update(stats, "decode_Bps", full_bytes / max(time.perf_counter() - t, 1e-9))
            candidate = publish_dir / f".candidate-{out.name}"
            shutil.rmtree(candidate, ignore_errors=True)
            delta_stats = write_delta(open_checkpoint(cache), new, candidate, version=version,
                                      base_version=base, fmt=fmt, encoding=encoding,
                                      workers=workers)
            _update(stats, "encode_Bps", full_bytes / max(delta_stats["encode_s"], 1e-9))
            _update(stats, "wire_ratio", delta_stats["wire_bytes"] / max(full_bytes, 1))
        except (DeltaChainError, BadInputError) as e:
            reason = f"no delta possible: {e}"
    if delta_stats is not None:
        predicted_full, predicted_delta = predict_times(
            full_bytes=full_bytes, wire_bytes=delta_stats["wire_bytes"], link_Bps=link,
            decode_Bps=decode_Bps, t0_s=t0_s)
        if mode == "delta" or predicted_delta < predicted_full:
            os.rename(candidate, out)
            atomic.fsync_dir(publish_dir)
            reason = reason or ("--sync delta" if mode == "delta" else "cost model: delta faster")
        else:
            shutil.rmtree(candidate)
            delta_stats, reason = None, "cost model: full faster"
    if delta_stats is None:
        t = time.perf_counter()
        _copy_full(new_dir, out, version=version)
        _update(stats, "link_Bps", full_bytes / max(time.perf_counter() - t, 1e-9))
    if staged is not None:
        # The staged state dict is exactly `version`: make it the cache's base for the next publish.
        with host_lock(cache / SYNC_DIR / "lock", timeout_s=600):
            if read_local_version(cache) != version:
                swap_in(staged, cache, cache / SYNC_DIR / "state.json", version=version)
        shutil.rmtree(staged, ignore_errors=True)
    atomic.write_json(publish_dir / STATS_FILE, stats)
    wire = delta_stats["wire_bytes"] if delta_stats else sum(
        p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "perf/update_weights_density": delta_stats["density"] if delta_stats else 1.0,
        "perf/update_weights_wire_bytes": wire,
        "perf/update_weights_time": time.perf_counter() - t_start,
        "sync/mode": "delta" if delta_stats else "full", "sync/reason": reason,
        "sync/version": version, "sync/full_bytes": full_bytes,
        "sync/predicted_full_s": predicted_full, "sync/predicted_delta_s": predicted_delta,
        "sync/link_Bps": link, "sync/path": str(out),
    }
