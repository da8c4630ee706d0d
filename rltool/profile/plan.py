"""`rltool plan` as a library: every cost model for one model config and cluster, with the
assumptions replaced by a profiled run's measurements (`from_profile`), and each prediction a run
can check compared with what it measured (`check`)."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from statistics import mean
from typing import Any

from pydantic import BaseModel, Field

from rltool.errors import BadInputError
from rltool.profile import caches, models
from rltool.profile.analyze import async_speedup, summarize
from rltool.profile.events import read_events
from rltool.profile.modelcfg import ModelShape, load_shape

GB = 1e9


class PlanInputs(BaseModel):
    """Assumptions of the cost models; `--from-profile` overwrites the measured ones."""

    gpus: int = Field(8, ge=1, description="GPUs in the cluster.")
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node.")
    rollout_gpus: int = Field(0, ge=0, description="Disaggregated: GPUs for engines "
                              "(default half).")
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    etp: int = Field(1, ge=1)
    engine_tp: int = Field(1, ge=1, description="GPUs per engine.")
    gpu_memory_gib: float = Field(80.0, gt=0)
    mem_fraction: float = Field(0.85, gt=0, le=1, description="Engine memory fraction.")
    micro_batch_tokens: int = Field(8192, ge=1)
    recompute: str = Field("full", pattern="^(full|none)$")
    weight_bits: int = Field(16, description="Bits per weight sent to the engines.")
    rollout_bits: int = Field(16, description="Engine weight bits (8 for fp8 rollout).")
    kv_bits: int = 16
    ssm_bits: int = 32
    conv_bits: int = 16
    B_tensor_GBps: float = Field(100.0, gt=0, description="Colocated device-copy bandwidth.")
    B_distributed_GBps: float = Field(25.0, gt=0, description="Trainer-to-engine NCCL bandwidth.")
    B_full_GBps: float = Field(2.0, gt=0, description="Filesystem bandwidth (full/delta sync).")
    decode_GBps: float = Field(4.0, gt=0, description="Delta decode throughput.")
    t0_s: float = Field(0.5, ge=0, description="Fixed cost of one weight update.")
    density: float = Field(0.1, ge=0, le=1, description="Fraction of weights a step changes.")
    t_R_s: float = Field(60.0, ge=0, description="Rollout seconds per step.")
    t_T_s: float = Field(30.0, ge=0, description="Train (+ publish) seconds per step.")
    t_W_s: float | None = Field(None, description="Weight sync seconds (default: the "
                                "weight-sync model's full mode).")
    cache_tokens: int = Field(262144, ge=0, description="N: live tokens in the hybrid cache.")
    cache_sequences: int = Field(256, ge=0, description="K: live sequences.")
    pool_gib: float = Field(40.0, gt=0, description="Engine cache pool per GPU.")
    mamba_full_memory_ratio: float = Field(0.9, gt=0, description="r of the pool split.")
    pd_engines: int = Field(0, ge=0, description="Engines for the PD model (0: leave out).")
    mu_P_rps: float = Field(10.0, gt=0, description="Prefill requests/s per engine.")
    mu_D_rps: float = Field(5.0, gt=0, description="Decode requests/s per engine.")
    prompt_tokens: int = Field(2048, ge=1, description="L: prompt tokens per request.")
    B_KV_GBps: float = Field(25.0, gt=0, description="KV transfer bandwidth P -> D.")
    hit_rate: float = Field(0.5, ge=0, le=1, description="Prefix-cache hit rate h.")
    t_prefill_s: float = Field(0.2, ge=0, description="Prefill seconds of one request.")
    B_io_GBps: float = Field(20.0, gt=0, description="Host-to-device KV bandwidth.")
    t_book_s: float = Field(0.001, ge=0, description="HiCache bookkeeping per request.")
    kv_pool_tokens: int = Field(0, ge=0, description="KV pool tokens per engine for the "
                                "recommendations (0: the placement model's estimate).")

    model_config = {"extra": "forbid", "allow_inf_nan": False}


def plan(model: str | Path, inputs: PlanInputs, *,
         profile_run: str | Path | None = None) -> dict[str, Any]:
    """Every model; with a profiled run also the workload-aware recommendations."""
    from rltool.profile.recommend import recommend

    shape = load_shape(model)
    out = run_models(shape, inputs)
    if profile_run is not None:
        pool = inputs.kv_pool_tokens or out[0]["rows"][0].get("kv_tokens_per_engine", 0)
        out.append(recommend(read_events(profile_run), kv_pool_tokens=pool))
    return {"model_config": str(model), "models": out, "inputs": inputs.model_dump()}


def run_models(shape: ModelShape, x: PlanInputs) -> list[dict[str, Any]]:
    rollout_gpus = x.rollout_gpus or x.gpus // 2
    out = [models.placement(shape, gpus=x.gpus, gpus_per_node=x.gpus_per_node,
                            rollout_gpus=rollout_gpus, tp=x.tp, pp=x.pp, cp=x.cp, ep=x.ep,
                            etp=x.etp, engine_tp=x.engine_tp, gpu_memory_gib=x.gpu_memory_gib,
                            mem_fraction=x.mem_fraction, micro_batch_tokens=x.micro_batch_tokens,
                            recompute=x.recompute)]
    sync = models.weight_sync(shape, weight_bits=x.weight_bits, bandwidth_Bps={
        "tensor": x.B_tensor_GBps * GB, "distributed": x.B_distributed_GBps * GB,
        "full": x.B_full_GBps * GB}, decode_Bps=x.decode_GBps * GB, t0_s=x.t0_s,
        density=x.density)
    out.append(sync)
    t_w = x.t_W_s if x.t_W_s is not None else sync["rows"][2]["t_W_s"]
    out.append(models.async_bound(t_R_s=x.t_R_s, t_T_s=x.t_T_s, t_W_s=t_w))
    out.append(models.precision(shape, kv_tokens=x.cache_tokens, rollout_bits=x.rollout_bits,
                                kv_bits=x.kv_bits))
    out.append(caches.hybrid_cache(shape, tokens=x.cache_tokens, sequences=x.cache_sequences,
                                   pool_gib=x.pool_gib, ratio=x.mamba_full_memory_ratio,
                                   kv_bits=x.kv_bits, ssm_bits=x.ssm_bits,
                                   conv_bits=x.conv_bits))
    if x.pd_engines:
        out.append(caches.prefill_decode(shape, engines=x.pd_engines, mu_p=x.mu_P_rps,
                                         mu_d=x.mu_D_rps, prompt_tokens=x.prompt_tokens,
                                         kv_bits=x.kv_bits, kv_link_Bps=x.B_KV_GBps * GB))
    out.append(caches.hicache(shape, hit_rate=x.hit_rate, prompt_tokens=x.prompt_tokens,
                              t_prefill_s=x.t_prefill_s, io_Bps=x.B_io_GBps * GB,
                              t_book_s=x.t_book_s, kv_bits=x.kv_bits,
                              version_lifetime_s=x.t_R_s))
    return out


def measured(run: str | Path, *, steps: slice = slice(None)) -> dict[str, Any]:
    """Measurements of a traced run that replace assumptions (names as in PlanInputs)."""
    summary = summarize(read_events(run))
    rows = summary["steps"][steps]
    if not rows:
        raise BadInputError(f"{run}: the trace has no complete loop step to measure")
    values: dict[str, Any] = {
        "t_R_s": mean(r.get("rollout", 0.0) for r in rows),
        "t_T_s": mean(r.get("train", 0.0) + r.get("publish", 0.0) for r in rows),
        "t_W_s": mean(r.get("sync", 0.0) for r in rows)}
    engines = summary["engines"].values()
    if engines:
        prompt = mean(e["mean_prompt_tokens"] for e in engines)
        completion = mean(e["completion_tokens"] / max(e["requests"], 1) for e in engines)
        values["prompt_tokens"] = max(int(round(prompt)), 1)
        values["mu_P_rps"] = mean(e["mu_P_tokens_per_s"] for e in engines) / max(prompt, 1e-9)
        values["mu_D_rps"] = mean(e["mu_D_tokens_per_s"] for e in engines) / max(completion, 1e-9)
        values["hit_rate"] = mean(e["prefix_hit_rate"] for e in engines)
    return {k: v for k, v in values.items() if v} | {"steps_measured": len(rows)}


def from_profile(inputs: PlanInputs, run: str | Path) -> tuple[PlanInputs, dict[str, Any]]:
    found = measured(run)
    update = {k: v for k, v in found.items() if k in PlanInputs.model_fields}
    return inputs.model_copy(update=update), found


def _weights_bytes(run: Path) -> tuple[int, int]:
    """(bytes of the version-0 safetensors, bits per element of its first tensor)."""
    from rltool.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(run / "weights" / "weight_v000000")
    total, bits = 0, 0
    for name in ckpt.names():
        _, shape, nbytes = ckpt.spec(name)
        total += nbytes
        bits = bits or nbytes * 8 // max(math.prod(shape), 1)
    return total, bits


def check(run: str | Path, *, model: str | Path | None = None) -> dict[str, Any]:
    """Predictions calibrated on the first half of a run's steps against the second half, and
    the parameter count (memory model) against the published weights."""
    run = Path(run)
    try:
        config = tomllib.loads((run / "config.toml").read_text())
    except FileNotFoundError:
        raise BadInputError(f"--check {run}: no config.toml; not a loop run directory") from None
    model_dir = Path(model) if model else Path(config["model"]["path"])
    if not model_dir.is_absolute() and not model_dir.exists():
        model_dir = run / "weights" / "weight_v000000"
    shape = load_shape(model_dir)
    rows = summarize(read_events(run))["steps"]
    if len(rows) < 2:
        raise BadInputError(f"--check {run}: needs at least 2 traced steps (has {len(rows)})")
    half = len(rows) // 2
    calib, held = measured(run, steps=slice(0, half)), rows[half:]
    out = []
    size, bits = _weights_bytes(run)
    p = shape.params()
    predicted_bytes = (p["dense"] + p["expert"]) * bits / 8
    out.append(_error("weight bytes (memory model's parameter count)", predicted_bytes, size))
    t_w = mean(r.get("sync", 0.0) for r in held)
    out.append(_error("t_W (sync seconds)", calib["t_W_s"], t_w))
    sync_step = async_speedup(t_R_s=calib["t_R_s"], t_T_s=calib["t_T_s"], t_W_s=calib["t_W_s"])
    wall = mean(r.get("rollout", 0.0) + r.get("train", 0.0) + r.get("publish", 0.0)
                + r.get("sync", 0.0) for r in held)
    out.append(_error("t_sync (step seconds; the async speedup's numerator)",
                      sync_step["t_sync_s"], wall))
    return {"run": str(run), "calibration_steps": half, "checked_steps": len(held),
            "checks": out, "not_checkable": ["prefill_decode",
                                             "hicache (two live engines: --check-engine URL "
                                             "--baseline-engine URL)",
                                             "hybrid_cache (a live engine's pools: "
                                             "--check-engine URL)",
                                             "async speedup (it compares a sync and an "
                                             "async run: benchmarks/async_loop.py)"]}


def _error(name: str, predicted: float, observed: float) -> dict[str, Any]:
    rel = (predicted - observed) / observed if observed else float("inf")
    return {"prediction": name, "predicted": predicted, "measured": observed,
            "relative_error": rel}
