"""Trainer side of weight sync: publish version N as a full checkpoint or a delta on the newest
version published before it, in three steps: decide (the cost model), encode, commit.

The decide step first picks the transport: with an engine that can take the weights in memory
(`in_memory`, which the loop passes for colocated engines on the trainer's host and device),
`--sync tensor|distributed` and `auto` choose the in-memory update and nothing is written to disk
unless `to_disk` asks for a (full) copy, e.g. at checkpoint steps; the caller then hands the
tensors over (rltool.delta.tensor_sync). Without such an engine `tensor` and `distributed` publish
a full version.

`publish_version(src, sync)` is the one entry point; `train --publish` and `loop` call it the same
way with their `SyncConfig` (`--sync full|delta|auto`). `auto` decides by the cost model
t ≈ S/B + t0 (+ processing time) for each mode:
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

The base (the previous version, complete) lives in a host-local cache directory kept by `pull_weights`,
so the publisher reuses the engine-side code path, and every delta it publishes is decoded and
checksum-verified once before the next one is built on it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltool import atomic, trace
from rltool.convert.fp8 import quantize_state
from rltool.delta.config import SyncConfig
from rltool.delta.deltadir import open_delta
from rltool.delta.diff import write_delta
from rltool.delta.pull import (SYNC_DIR, host_lock, open_cached, pull_weights, read_local_version,
                               swap_in)
from rltool.errors import BadInputError, CheckpointError, DeltaChainError
from rltool.io.checkpoint import Checkpoint, is_delta_dir, open_checkpoint
from rltool.io.header import INDEX_NAME
from rltool.io.hf_dir import CONFIG_NAME, DTYPES, write_hf_dir
from rltool.rundir import VERSION_FILE, list_versions, weight_dir_name

STATS_FILE = ".publish_stats.json"
CACHE_DIR = ".publish_cache"
# Seeds for the measured averages, from benchmarks/delta_sync.py on the 2-core CPU box (bytes/s).
DEFAULT_DECODE_BPS = 1.7e9  # 0.988 GB rebuilt in 0.57 s (lr 1e-6, native kernels)
DEFAULT_LINK_BPS = 1.25e9  # 10 Gb/s, when neither given nor measured yet
EMA = 0.5
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FP8_BLOCK = (128, 128)  # the block of `--precision fp8` (rltool convert fp8's default)


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


def _copy_full(src: Path, out: Path, *, marker: dict[str, Any]) -> None:
    with atomic.publish_dir(out) as tmp:
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if p.is_file() and not any(part.startswith(".") for part in rel.parts) \
                    and rel.as_posix() != INDEX_NAME:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, tmp / rel)
        atomic.write_json(tmp / VERSION_FILE, marker)
        if (src / INDEX_NAME).is_file():  # the index last: readers treat it as the marker
            shutil.copyfile(src / INDEX_NAME, tmp / INDEX_NAME)


def precision_of(sync: SyncConfig, dtype: str) -> str:
    """The precision a version is published in: `sync.precision`, else the weights' dtype."""
    return sync.precision or SHORT_DTYPES[DTYPES[dtype]]


def _write_state(out: Path, state: Mapping[str, Any], sync: SyncConfig, *,
                 source_model_dir: str | os.PathLike, dtype: str) -> None:
    """`state` as a HF directory in the sync's precision (fp8: `rltool convert fp8`'s format)."""
    quantize = None
    if sync.precision == "fp8":
        def quantize(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
            return quantize_state(tensors, FP8_BLOCK)
    write_hf_dir(out, dict(state), source_model_dir=source_model_dir,
                 dtype="bf16" if sync.precision == "bf16" else dtype, quantize=quantize)


def _read_state(model_dir: Path) -> tuple[dict[str, Any], str]:
    """A HF checkpoint directory's tensors and their dtype (to re-publish it in another
    precision)."""
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    config = json.loads((model_dir / CONFIG_NAME).read_text())
    if config.get("quantization_config"):
        raise BadInputError(f"{model_dir} is already quantized; publish its unquantized weights")
    return state, str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _stage_state_dict(state: Mapping[str, Any], cache: Path, sync: SyncConfig, *,
                      source_model_dir: Path, dtype: str, version: int) -> Path:
    staging = cache / SYNC_DIR / "next"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_state(staging, state, sync, source_model_dir=source_model_dir, dtype=dtype)
    atomic.write_json(staging / VERSION_FILE,
                      {"version": version, "precision": precision_of(sync, dtype)})
    return staging


@dataclass(frozen=True)
class Decision:
    """The cost model's answer: publish a delta or not, why, and the predicted times (seconds)."""

    delta: bool
    reason: str
    predicted_full_s: float | None = None
    predicted_delta_s: float | None = None
    in_memory: str | None = None  # "tensor" or "distributed": no disk version needed


def decide_transport(sync: SyncConfig, *, in_memory: str | None) -> Decision | None:
    """The in-memory decision, or None when the version goes to disk (full or delta, `decide`).
    `in_memory`: the in-memory transport the engines can take ("tensor" when they share the
    trainer's host and device, "distributed" when they can join its process group), or None."""
    if in_memory is None:
        return None
    if sync.sync == "distributed" or (sync.sync == "tensor" and in_memory == "tensor"):
        return Decision(False, f"--sync {sync.sync}", in_memory=sync.sync)
    if sync.sync == "auto" and in_memory == "tensor":
        return Decision(False, "auto: engines share the trainer's host and device",
                        in_memory="tensor")
    return None


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


def _encode(new: Checkpoint, candidate: Path, sync: SyncConfig, *, publish_dir: Path, cache: Path,
            version: int, base: int, base_model_path: str | os.PathLike | None,
            stats: dict[str, float], full_bytes: int, workers: int | None) -> dict[str, Any]:
    """Bring the cache to version `base` (pull_weights, verified) and write the delta on it to
    `candidate`; returns write_delta's stats. Raises DeltaChainError/BadInputError when no delta
    is possible."""
    t = time.perf_counter()
    pulled = pull_weights(local_checkpoint_dir=cache, source_dir=publish_dir,
                          target_version=base, base_model_path=base_model_path, workers=workers)
    if pulled["changed"]:
        _update(stats, "decode_Bps", full_bytes / max(time.perf_counter() - t, 1e-9))
    shutil.rmtree(candidate, ignore_errors=True)
    with trace.span("encode", cat="publish", version=version, base=base):
        delta_stats = write_delta(open_cached(cache), new, candidate, version=version,
                                  base_version=base, fmt=sync.delta_format,
                                  encoding=sync.delta_encoding, workers=workers)
    _update(stats, "encode_Bps", full_bytes / max(delta_stats["encode_s"], 1e-9))
    _update(stats, "wire_ratio", delta_stats["wire_bytes"] / max(full_bytes, 1))
    return delta_stats


def _newest_below(publish_dir: Path, version: int) -> int:
    earlier = [v for v in list_versions(publish_dir) if v < version]
    return earlier[-1] if earlier else version - 1


def publish_version(src: Mapping[str, Any] | str | os.PathLike, sync: SyncConfig, *,
                    publish_dir: str | os.PathLike, version: int,
                    base_version: int | None = None,
                    source_model_dir: str | os.PathLike | None = None, dtype: str = "fp32",
                    base_model_path: str | os.PathLike | None = None, t0_s: float = 0.0,
                    cache_dir: str | os.PathLike | None = None, workers: int | None = None,
                    in_memory: str | None = None, to_disk: bool = True) -> dict[str, Any]:
    """Publish `<publish_dir>/weight_v{version:06d}` as a full checkpoint or, by `sync`, a delta on
    `base_version` (default: the newest version published below `version`; version 0's base is
    `base_model_path` when `publish_dir` has no weight_v000000).

    `src`: a full HF checkpoint directory, or a state dict (HF names; written with config and
    tokenizer from `source_model_dir` at `dtype`). Returns metrics: perf/update_weights_density,
    perf/update_weights_wire_bytes, perf/update_weights_time and sync/* (mode chosen, reason,
    predicted times, path). With an in-memory decision (`decide_transport`) and not `to_disk`,
    nothing is written and sync/mode names the transport.
    """
    transport = decide_transport(sync, in_memory=in_memory)
    if transport is not None and not to_disk:
        return {"sync/mode": transport.in_memory, "sync/reason": transport.reason,
                "sync/version": version, "perf/update_weights_wire_bytes": 0,
                "sync/precision": precision_of(sync, dtype)}
    if transport is not None or sync.sync in ("tensor", "distributed"):
        # A disk copy of an in-memory version (or no in-memory receiver): a full version.
        result = publish_version(src, sync.model_copy(update={"sync": "full"}),
                                 publish_dir=publish_dir, version=version,
                                 base_version=base_version, source_model_dir=source_model_dir,
                                 dtype=dtype, base_model_path=base_model_path, t0_s=t0_s,
                                 cache_dir=cache_dir, workers=workers)
        if transport is not None:
            result.update({"sync/mode": transport.in_memory, "sync/reason": transport.reason})
        return result
    base = _newest_below(Path(publish_dir), version) if base_version is None else base_version
    if version > 0 and not 0 <= base < version:
        raise BadInputError(f"base version {base} must be below version {version}")
    t_start = time.perf_counter()
    publish_dir = Path(publish_dir)
    out = publish_dir / weight_dir_name(version)
    if out.exists():
        raise BadInputError(f"{out} already exists; a published version is never replaced "
                            "(resume from the checkpoint that produced it, or publish elsewhere)")
    if sync.precision is not None and not isinstance(src, Mapping):
        source_model_dir = Path(src)
        src, dtype = _read_state(source_model_dir)
    is_state = isinstance(src, Mapping)
    if is_state and source_model_dir is None:
        raise BadInputError("publishing a state dict needs source_model_dir (config + tokenizer)")
    if is_state and sync.sync == "full":
        # No delta will ever be built on it: write the version in place, no staging copy.
        marker = {"version": version, "precision": precision_of(sync, dtype)}
        with atomic.publish_dir(out, marker=VERSION_FILE, marker_content=marker) as tmp:
            _write_state(tmp, src, sync, source_model_dir=source_model_dir, dtype=dtype)
        return _metrics(out, None, Decision(False, "--sync full"), version=version,
                        full_bytes=_full_bytes(open_checkpoint(out)), link=None, t_start=t_start,
                        precision=marker["precision"])
    cache = Path(cache_dir) if cache_dir is not None else publish_dir / CACHE_DIR
    stats = _load_stats(publish_dir)
    staged = (_stage_state_dict(src, cache, sync, version=version, dtype=dtype,
                                source_model_dir=Path(source_model_dir)) if is_state else None)
    new_dir = staged if staged is not None else Path(src)
    new = open_checkpoint(new_dir)
    full_bytes = _full_bytes(new)
    # 1. decide whether a delta is worth encoding
    decision = decide(sync, version=version, full_bytes=full_bytes, stats=stats, t0_s=t0_s,
                      chain_length=_chain_length(publish_dir, base) if version > 0 else 0)
    delta_stats = None
    candidate = publish_dir / f".candidate-{out.name}"
    if decision.delta:
        # 2. encode it on the verified base, then decide with its measured size
        try:
            delta_stats = _encode(new, candidate, sync, publish_dir=publish_dir, cache=cache,
                                  version=version, base=base, base_model_path=base_model_path,
                                  stats=stats, full_bytes=full_bytes, workers=workers)
            decision = decide(sync, version=version, chain_length=0, full_bytes=full_bytes,
                              stats=stats, t0_s=t0_s, wire_bytes=delta_stats["wire_bytes"])
        except (DeltaChainError, BadInputError) as e:
            decision = Decision(False, f"no delta possible: {e}")
    # 3. commit: the delta candidate, or a full copy
    if decision.delta:
        os.rename(candidate, out)
        atomic.fsync_dir(publish_dir)
    else:
        shutil.rmtree(candidate, ignore_errors=True)
        delta_stats = None
        t = time.perf_counter()
        marker = {"version": version}
        if is_state:
            marker["precision"] = precision_of(sync, dtype)
        _copy_full(new_dir, out, marker=marker)
        _update(stats, "link_Bps", full_bytes / max(time.perf_counter() - t, 1e-9))
    if staged is not None:
        # The staged state dict is exactly `version`: make it the cache's base for the next publish.
        with host_lock(cache / SYNC_DIR / "lock", timeout_s=600):
            if read_local_version(cache) != version:
                swap_in(staged, cache, version=version)
        shutil.rmtree(staged, ignore_errors=True)
    atomic.write_json(publish_dir / STATS_FILE, stats)
    return _metrics(out, delta_stats, decision, version=version, full_bytes=full_bytes,
                    link=link_bandwidth_Bps(sync, stats), t_start=t_start,
                    precision=precision_of(sync, dtype) if is_state else None)


def _full_bytes(ckpt: Checkpoint) -> int:
    return sum(ckpt.spec(n)[2] for n in ckpt.names())


def _metrics(out: Path, delta_stats: dict[str, Any] | None, decision: Decision, *, version: int,
             full_bytes: int, link: float | None, t_start: float,
             precision: str | None) -> dict[str, Any]:
    wire = delta_stats["wire_bytes"] if delta_stats else sum(
        p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "perf/update_weights_density": delta_stats["density"] if delta_stats else 1.0,
        "perf/update_weights_wire_bytes": wire,
        "perf/update_weights_time": time.perf_counter() - t_start,
        "sync/mode": "delta" if delta_stats else "full", "sync/reason": decision.reason,
        "sync/version": version, "sync/full_bytes": full_bytes,
        "sync/predicted_full_s": decision.predicted_full_s,
        "sync/predicted_delta_s": decision.predicted_delta_s,
        "sync/link_Bps": link, "sync/path": str(out),
        **({"sync/precision": precision} if precision else {}),
    }
