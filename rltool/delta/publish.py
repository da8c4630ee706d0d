"""Trainer side of weight sync: publish version N to the engines as a full checkpoint, a delta on
the newest version published before it, or in memory.

`publish_version(src, sync)` is the one entry point; `train --publish` and `loop` call it the same
way with their `SyncConfig` (`--sync full|delta|auto|tensor|distributed`). It freezes its inputs
into a `PublishRequest`, `decide_route` picks the publisher, and the publisher runs:

  in-memory  an engine takes the weights in memory (`in_memory`, which the loop passes for
             colocated engines on the trainer's host and device, or external engines that join its
             process group) and `to_disk` asks for no copy: nothing is written, the caller then
             hands the tensors over (rltool.delta.tensor_sync).
  full       `--sync full`, the disk copy of an in-memory version (`to_disk`, e.g. at checkpoint
             steps), and `tensor`/`distributed` without an engine that takes them in memory.
  delta      `--sync delta|auto`: the cost model (rltool.delta.cost) says whether a delta is
             worth encoding; if so it is encoded on the base and, with its measured size, kept or
             dropped. A full version is published instead for version 0, every `full_every`
             versions, when the cost model says so, and whenever the base cannot be rebuilt.

The base (the previous version, complete) lives in a host-local cache directory kept by
`pull_weights`, so the publisher reuses the engine-side code path, and every delta it publishes is
decoded and checksum-verified once before the next one is built on it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from rltool import atomic, trace
from rltool.convert import int4
from rltool.convert.fp8 import quantize_state
from rltool.delta.config import SyncConfig
from rltool.delta.cost import (Decision, decide, link_bandwidth_Bps, load_stats, save_stats,
                               update_average)
from rltool.delta.deltadir import open_delta
from rltool.delta.diff import write_delta
from rltool.delta.pull import (SYNC_DIR, host_lock, open_cached, pull_weights, read_local_version,
                               swap_in)
from rltool.errors import BadInputError, CheckpointError, DeltaChainError
from rltool.io.checkpoint import Checkpoint, is_delta_dir, open_checkpoint
from rltool.io.header import INDEX_NAME
from rltool.io.hf_dir import CONFIG_NAME, DTYPES, write_hf_dir
from rltool.rundir import VERSION_FILE, list_versions, weight_dir_name

CACHE_DIR = ".publish_cache"
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FP8_BLOCK = (128, 128)  # the block of `--precision fp8` (rltool convert fp8's default)


@dataclass(frozen=True)
class PublishRequest:
    """What `publish_version` was asked to publish (its arguments, paths as `Path`)."""

    src: Mapping[str, Any] | Path  # a state dict (HF names) or a full HF checkpoint directory
    sync: SyncConfig
    publish_dir: Path
    version: int
    base_version: int | None  # None: the newest version published below `version`
    source_model_dir: Path | None  # config + tokenizer for a state dict
    dtype: str
    base_model_path: Path | None  # version 0 when publish_dir has no weight_v000000
    t0_s: float
    cache_dir: Path | None  # None: <publish_dir>/.publish_cache
    workers: int | None
    in_memory: str | None  # the in-memory transport the engines can take, if any
    to_disk: bool

    @property
    def out(self) -> Path:
        return self.publish_dir / weight_dir_name(self.version)

    @property
    def candidate(self) -> Path:
        return self.publish_dir / f".candidate-{self.out.name}"

    @property
    def is_state(self) -> bool:
        return isinstance(self.src, Mapping)

    @property
    def precision(self) -> str:
        return precision_of(self.sync, self.dtype)


@dataclass(frozen=True)
class Route:
    """Which publisher takes a request and why. `transport` ("tensor" or "distributed") names the
    in-memory transport the engines take this version by, also when a full copy goes to disk."""

    publisher: Literal["in-memory", "full", "delta"]
    reason: str
    transport: str | None = None


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


def decide_route(request: PublishRequest) -> Route:
    """The publisher for `request`, and why. A disk copy of an in-memory version is full, also
    under `auto`: the engines take that version in memory, so the cost model, which weighs what
    they pull, has nothing to weigh."""
    transport = decide_transport(request.sync, in_memory=request.in_memory)
    if transport is not None:
        return Route("full" if request.to_disk else "in-memory", transport.reason,
                     transport=transport.in_memory)
    if request.sync.sync in ("full", "tensor", "distributed"):
        # tensor/distributed with no engine that takes them in memory: published, and reported,
        # exactly as --sync full.
        return Route("full", "--sync full")
    return Route("delta", f"--sync {request.sync.sync}")


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
    request = PublishRequest(
        src=src if isinstance(src, Mapping) else Path(src), sync=sync,
        publish_dir=Path(publish_dir), version=version, base_version=base_version,
        source_model_dir=None if source_model_dir is None else Path(source_model_dir),
        dtype=dtype, base_model_path=None if base_model_path is None else Path(base_model_path),
        t0_s=t0_s, cache_dir=None if cache_dir is None else Path(cache_dir), workers=workers,
        in_memory=in_memory, to_disk=to_disk)
    route = decide_route(request)
    return PUBLISHERS[route.publisher](request, route)


def publish_in_memory(request: PublishRequest, route: Route) -> dict[str, Any]:
    """Nothing to write: the caller hands the tensors over by `route.transport`."""
    return {"sync/mode": route.transport, "sync/reason": route.reason,
            "sync/version": request.version, "perf/update_weights_wire_bytes": 0,
            "sync/precision": request.precision}


def publish_full(request: PublishRequest, route: Route) -> dict[str, Any]:
    """A full version. A state dict is written in place, with no staging copy in the cache: the
    sync modes routed here never build a delta on it."""
    t_start = time.perf_counter()
    request = _resolve(request)
    out, mode = request.out, route.transport or "full"
    decision = Decision(False, route.reason)
    if request.is_state:
        marker = {"version": request.version, "precision": request.precision}
        with atomic.publish_dir(out, marker=VERSION_FILE, marker_content=marker) as tmp:
            _write_state(tmp, request.src, request.sync, source_model_dir=request.source_model_dir,
                         dtype=request.dtype)
        return _metrics(out, None, decision, mode=mode, version=request.version,
                        full_bytes=_full_bytes(open_checkpoint(out)), link=None, t_start=t_start,
                        precision=request.precision)
    stats = load_stats(request.publish_dir)
    full_bytes = _full_bytes(open_checkpoint(request.src))
    _commit_full(request, request.src, stats=stats, full_bytes=full_bytes)
    save_stats(request.publish_dir, stats)
    return _metrics(out, None, decision, mode=mode, version=request.version,
                    full_bytes=full_bytes, link=link_bandwidth_Bps(request.sync, stats),
                    t_start=t_start, precision=None)


def publish_delta(request: PublishRequest, route: Route) -> dict[str, Any]:
    """A delta on the base when the cost model keeps one, else a full version: decide whether a
    delta is worth encoding, encode it on the verified base, decide with its measured size,
    commit. A state dict is staged in the cache and becomes its base for the next publish."""
    t_start = time.perf_counter()
    request = _resolve(request)
    sync, publish_dir, out = request.sync, request.publish_dir, request.out
    cache = request.cache_dir if request.cache_dir is not None else publish_dir / CACHE_DIR
    stats = load_stats(publish_dir)
    staged = _stage_state_dict(request, cache) if request.is_state else None
    new_dir = staged if staged is not None else request.src
    new = open_checkpoint(new_dir)
    full_bytes = _full_bytes(new)
    chain_length = _chain_length(publish_dir, request.base_version) if request.version > 0 else 0
    decision = decide(sync, version=request.version, full_bytes=full_bytes, stats=stats,
                      t0_s=request.t0_s, chain_length=chain_length)
    delta_stats = None
    if decision.delta:
        try:
            delta_stats = _encode(request, new, cache=cache, stats=stats, full_bytes=full_bytes)
            decision = decide(sync, version=request.version, chain_length=0,
                              full_bytes=full_bytes, stats=stats, t0_s=request.t0_s,
                              wire_bytes=delta_stats["wire_bytes"])
        except (DeltaChainError, BadInputError) as e:
            decision = Decision(False, f"no delta possible: {e}")
    if decision.delta:
        os.rename(request.candidate, out)
        atomic.fsync_dir(publish_dir)
    else:
        delta_stats = None
        _commit_full(request, new_dir, stats=stats, full_bytes=full_bytes)
    if staged is not None:
        # The staged state dict is exactly `version`: make it the cache's base for the next publish.
        with host_lock(cache / SYNC_DIR / "lock", timeout_s=600):
            if read_local_version(cache) != request.version:
                swap_in(staged, cache, version=request.version)
        shutil.rmtree(staged, ignore_errors=True)
    save_stats(publish_dir, stats)
    return _metrics(out, delta_stats, decision, mode="delta" if delta_stats else "full",
                    version=request.version, full_bytes=full_bytes,
                    link=link_bandwidth_Bps(sync, stats), t_start=t_start,
                    precision=request.precision if request.is_state else None)


PUBLISHERS: dict[str, Callable[[PublishRequest, Route], dict[str, Any]]] = {
    "in-memory": publish_in_memory, "full": publish_full, "delta": publish_delta}


def _resolve(request: PublishRequest) -> PublishRequest:
    """`request` checked for a disk version, with its base resolved and, for a precision other
    than the checkpoint's, a directory read into a state dict (it is re-quantized on write)."""
    base = request.base_version
    if base is None:
        base = _newest_below(request.publish_dir, request.version)
    if request.version > 0 and not 0 <= base < request.version:
        raise BadInputError(f"base version {base} must be below version {request.version}")
    if request.out.exists():
        raise BadInputError(f"{request.out} already exists; a published version is never "
                            "replaced (resume from the checkpoint that produced it, or publish "
                            "elsewhere)")
    if request.sync.precision is not None and not request.is_state:
        state, dtype = _read_state(request.src)
        request = replace(request, src=state, dtype=dtype, source_model_dir=request.src)
    if request.is_state and request.source_model_dir is None:
        raise BadInputError("publishing a state dict needs source_model_dir (config + tokenizer)")
    return replace(request, base_version=base)


def _newest_below(publish_dir: Path, version: int) -> int:
    earlier = [v for v in list_versions(publish_dir) if v < version]
    return earlier[-1] if earlier else version - 1


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


def _encode(request: PublishRequest, new: Checkpoint, *, cache: Path, stats: dict[str, float],
            full_bytes: int) -> dict[str, Any]:
    """Bring the cache to the base version (pull_weights, verified) and write the delta on it to
    the request's candidate directory; returns write_delta's stats. Raises
    DeltaChainError/BadInputError when no delta is possible."""
    base, candidate = request.base_version, request.candidate
    t = time.perf_counter()
    pulled = pull_weights(local_checkpoint_dir=cache, source_dir=request.publish_dir,
                          target_version=base, base_model_path=request.base_model_path,
                          workers=request.workers)
    if pulled["changed"]:
        update_average(stats, "decode_Bps", full_bytes / max(time.perf_counter() - t, 1e-9))
    shutil.rmtree(candidate, ignore_errors=True)
    with trace.span("encode", cat="publish", version=request.version, base=base):
        delta_stats = write_delta(open_cached(cache), new, candidate, version=request.version,
                                  base_version=base, fmt=request.sync.delta_format,
                                  encoding=request.sync.delta_encoding, workers=request.workers)
    update_average(stats, "encode_Bps", full_bytes / max(delta_stats["encode_s"], 1e-9))
    update_average(stats, "wire_ratio", delta_stats["wire_bytes"] / max(full_bytes, 1))
    return delta_stats


def _commit_full(request: PublishRequest, new_dir: Path, *, stats: dict[str, float],
                 full_bytes: int) -> None:
    """Copy the full checkpoint `new_dir` to the version, timing the write as a link sample."""
    shutil.rmtree(request.candidate, ignore_errors=True)
    t = time.perf_counter()
    marker: dict[str, Any] = {"version": request.version}
    if request.is_state:
        marker["precision"] = request.precision
    _copy_full(new_dir, request.out, marker=marker)
    update_average(stats, "link_Bps", full_bytes / max(time.perf_counter() - t, 1e-9))


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
    """`state` as a HF directory in the sync's precision (fp8: `rltool convert fp8`'s format;
    int4: `rltool convert int4`'s, with its defaults for the model)."""
    quantize = None
    if sync.precision == "fp8":
        def quantize(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
            return quantize_state(tensors, FP8_BLOCK)
    elif sync.precision == "int4":
        quantize = _int4_quantizer(state, source_model_dir=source_model_dir, dtype=dtype)
    write_hf_dir(out, dict(state), source_model_dir=source_model_dir,
                 dtype="bf16" if sync.precision == "bf16" else dtype, quantize=quantize)


def int4_format(model_dir: str | os.PathLike) -> int4.Int4Format:
    """The INT4 format `[sync] precision = "int4"` publishes a model in."""
    return int4.default_format(json.loads((Path(model_dir) / CONFIG_NAME).read_text()))


def _int4_quantizer(state: Mapping[str, Any], *, source_model_dir: str | os.PathLike,
                    dtype: str) -> Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]:
    """write_hf_dir's `quantize` for INT4: each weight to quantize is cast to `dtype` and
    quantized on the device the trainer's tensor is on (the same bits as on the host), then
    brought to the host; the host copies write_hf_dir made of those weights are dropped."""
    import torch

    fmt = int4_format(source_model_dir)
    torch_dtype = getattr(torch, DTYPES[dtype])

    def quantize(tensors: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        out: dict[str, Any] = {}
        for name, t in tensors.items():
            if not fmt.quantizes(name, tuple(t.shape), floating=t.is_floating_point()):
                out[name] = t
                continue
            src = state[name].detach().to(dtype=torch_dtype)
            one, _ = int4.quantize_state({name: src}, fmt)
            out.update({n: v.to("cpu").contiguous() for n, v in one.items()})
        return out, fmt.quantization_config()

    return quantize


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


def _stage_state_dict(request: PublishRequest, cache: Path) -> Path:
    staging = cache / SYNC_DIR / "next"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_state(staging, request.src, request.sync, source_model_dir=request.source_model_dir,
                 dtype=request.dtype)
    atomic.write_json(staging / VERSION_FILE,
                      {"version": request.version, "precision": request.precision})
    return staging


def _full_bytes(ckpt: Checkpoint) -> int:
    return sum(ckpt.spec(n)[2] for n in ckpt.names())


def _metrics(out: Path, delta_stats: dict[str, Any] | None, decision: Decision, *, mode: str,
             version: int, full_bytes: int, link: float | None, t_start: float,
             precision: str | None) -> dict[str, Any]:
    wire = delta_stats["wire_bytes"] if delta_stats else sum(
        p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "perf/update_weights_density": delta_stats["density"] if delta_stats else 1.0,
        "perf/update_weights_wire_bytes": wire,
        "perf/update_weights_time": time.perf_counter() - t_start,
        "sync/mode": mode, "sync/reason": decision.reason,
        "sync/version": version, "sync/full_bytes": full_bytes,
        "sync/predicted_full_s": decision.predicted_full_s,
        "sync/predicted_delta_s": decision.predicted_delta_s,
        "sync/link_Bps": link, "sync/path": str(out),
        **({"sync/precision": precision} if precision else {}),
    }
