"""The planner's cost models for training placement, memory, weight sync, async and precision.
Each function returns `{"model", "inputs", "rows", "notes"}`: the inputs it used (so a reader can
redo the arithmetic), one row per alternative, and what the model leaves out. Formulas and
their assumptions: docs/profile.md."""

from __future__ import annotations

from typing import Any

from rltool.profile.modelcfg import ModelShape

GIB = 1024 ** 3
# Mixed-precision Adam (Megatron defaults): bf16 weights, fp32 main gradients, fp32 master
# weights + two moments held by the distributed optimizer (sharded over data parallel ranks).
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12
# Activation bytes per token per layer per hidden unit: 34 without recomputation (Korthikanti
# et al., flash attention, bf16), 2 with full recomputation (only each layer's input is kept).
ACTIVATION_FACTOR = {"none": 34, "full": 2}
INDEX_BITS = 32  # a delta stores one int32 position per changed element


def Model(name: str, inputs: dict[str, Any], rows: list[dict[str, Any]],
          notes: list[str] | None = None) -> dict[str, Any]:
    return {"model": name, "inputs": inputs, "rows": rows, "notes": notes or []}


def divisibility(*, gpus: int, gpus_per_node: int, tp: int, pp: int, cp: int, ep: int,
                 etp: int, experts: int) -> list[str]:
    """Why a layout cannot run (empty: it may; divisibility is necessary, not sufficient)."""
    problems = []
    if gpus % (tp * pp * cp):
        problems.append(f"TP*PP*CP={tp * pp * cp} does not divide {gpus} GPUs")
    if tp > gpus_per_node or gpus_per_node % tp:
        problems.append(f"TP={tp} must divide the {gpus_per_node} GPUs of a node")
    if experts:
        if gpus % (etp * ep * pp):
            problems.append(f"ETP*EP*PP={etp * ep * pp} does not divide {gpus} GPUs")
        if experts % ep:
            problems.append(f"EP={ep} does not divide {experts} experts")
        if etp * ep > gpus_per_node and (etp * ep) % gpus_per_node:
            problems.append(f"ETP*EP={etp * ep} spans nodes unevenly ({gpus_per_node} per node)")
    return problems


def trainer_memory(shape: ModelShape, *, gpus: int, tp: int, pp: int, cp: int, ep: int, etp: int,
                   micro_batch_tokens: int, recompute: str) -> dict[str, float]:
    """Bytes per GPU of the trainer: weights, gradients, optimizer, activations."""
    p = shape.params()
    dense = p["dense"] / (tp * pp)
    expert = p["expert"] / (etp * ep * pp) if p["expert"] else 0.0
    dp = max(gpus // (tp * pp * cp), 1)
    edp = max(gpus // (etp * ep * pp), 1)
    act = micro_batch_tokens / cp * shape.hidden * (shape.layers / pp) \
        * ACTIVATION_FACTOR[recompute] / tp
    return {"weights": (dense + expert) * WEIGHT_BYTES,
            "gradients": (dense + expert) * GRAD_BYTES,
            "optimizer": (dense / dp + expert / edp) * OPTIMIZER_BYTES,
            "activations": act}


def placement(shape: ModelShape, *, gpus: int, gpus_per_node: int, rollout_gpus: int, tp: int,
              pp: int, cp: int, ep: int, etp: int, engine_tp: int, gpu_memory_gib: float,
              mem_fraction: float, micro_batch_tokens: int, recompute: str) -> dict[str, Any]:
    p = shape.params()
    engine_weights = (p["dense"] + p["expert"]) * WEIGHT_BYTES / engine_tp
    kv_per_token = 2 * shape.attention_layers * shape.kv_heads * shape.head_dim * 2 / engine_tp
    capacity = gpu_memory_gib * GIB
    rows = []
    for layout, train_gpus, roll_gpus in (("colocated", gpus, gpus),
                                          ("disaggregated", gpus - rollout_gpus, rollout_gpus)):
        if train_gpus <= 0 or roll_gpus <= 0:
            rows.append({"layout": layout, "trainer_gpus": train_gpus, "rollout_gpus": roll_gpus,
                         "fits": False, "problems": "no GPUs left for one side"})
            continue
        problems = divisibility(gpus=train_gpus, gpus_per_node=gpus_per_node, tp=tp, pp=pp, cp=cp,
                                ep=ep, etp=etp, experts=shape.experts)
        if roll_gpus % engine_tp:
            problems.append(f"engine TP={engine_tp} does not divide {roll_gpus} rollout GPUs")
        mem = trainer_memory(shape, gpus=train_gpus, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                             micro_batch_tokens=micro_batch_tokens, recompute=recompute)
        trainer = sum(mem.values())
        kv_pool = mem_fraction * capacity - engine_weights
        # colocated: the engines release their memory while the trainer runs, so the peak is
        # the larger of the two; disaggregated GPUs hold one side each.
        fits = trainer <= capacity and kv_pool > 0
        if trainer > capacity:
            problems.append(f"trainer needs {trainer / GIB:.1f} GiB > {gpu_memory_gib:g} GiB")
        if kv_pool <= 0:
            problems.append(f"engine weights {engine_weights / GIB:.1f} GiB leave no KV pool")
        rows.append({"layout": layout, "trainer_gpus": train_gpus, "rollout_gpus": roll_gpus,
                     "engines": roll_gpus // engine_tp,
                     **{f"{k}_gib": v / GIB for k, v in mem.items()},
                     "trainer_total_gib": trainer / GIB, "engine_weights_gib": engine_weights / GIB,
                     "kv_pool_gib": max(kv_pool, 0) / GIB,
                     "kv_tokens_per_engine": int(max(kv_pool, 0) / kv_per_token)
                     if kv_per_token else 0,
                     "fits": fits and not problems, "problems": "; ".join(problems) or "-"})
    return Model("placement", {
        "params_dense": p["dense"], "params_expert": p["expert"], "gpus": gpus,
        "gpus_per_node": gpus_per_node, "rollout_gpus": rollout_gpus, "tp": tp, "pp": pp,
        "cp": cp, "ep": ep, "etp": etp, "engine_tp": engine_tp, "gpu_memory_gib": gpu_memory_gib,
        "mem_fraction": mem_fraction, "micro_batch_tokens": micro_batch_tokens,
        "recompute": recompute}, rows, [
        "divisibility is necessary, not sufficient: a layout that passes may still fail on "
        "attention-head or hidden-size divisibility, pipeline balance or memory fragmentation",
        "memory: bf16 weights, fp32 gradients, fp32 Adam states sharded over data parallel; "
        "activations per token per layer = hidden x (34 bytes, or 2 with full recompute)"])


def weight_sync(shape: ModelShape, *, weight_bits: int, bandwidth_Bps: dict[str, float],
                decode_Bps: float, t0_s: float, density: float) -> dict[str, Any]:
    """t_W = S_W / B_W + t0 per mode; a delta sends density*(1 + index bits / weight bits) of the
    bytes and decodes S_W at decode_Bps, so it wins below the break-even density
    rho* = (1 - B/B_decode) / (1 + INDEX_BITS/b)."""
    p = shape.params()
    size = (p["dense"] + p["expert"]) * weight_bits / 8
    rows = []
    for mode in ("tensor", "distributed", "full"):
        rows.append({"mode": mode, "bytes": size, "bandwidth_Bps": bandwidth_Bps[mode],
                     "t_W_s": size / bandwidth_Bps[mode] + t0_s})
    link = bandwidth_Bps["full"]
    overhead = 1 + INDEX_BITS / weight_bits
    wire = density * size * overhead
    rows.append({"mode": "delta", "bytes": wire, "bandwidth_Bps": link,
                 "t_W_s": wire / link + size / decode_Bps + t0_s})
    breakeven = max(0.0, (1 - link / decode_Bps) / overhead)
    return Model("weight_sync", {"weight_bytes": size, "weight_bits": weight_bits,
                                 "t0_s": t0_s, "density": density, "decode_Bps": decode_Bps,
                                 **{f"B_{k}_Bps": v for k, v in bandwidth_Bps.items()}},
                 rows + [{"mode": "delta break-even density", "bytes": "", "bandwidth_Bps": "",
                          "t_W_s": breakeven}],
                 ["delta: beats full below the break-even density (the last row's t_W_s column);"
                  " tensor/distributed send every byte over device links"])


def async_bound(*, t_R_s: float, t_T_s: float, t_W_s: float) -> dict[str, Any]:
    t_sync = t_R_s + t_T_s + t_W_s
    t_async = max(t_R_s, t_T_s) + t_W_s
    return Model("async", {"t_R_s": t_R_s, "t_T_s": t_T_s, "t_W_s": t_W_s}, [{
        "t_sync_s": t_sync, "t_async_bound_s": t_async,
        "speedup_bound": t_sync / t_async if t_async > 0 else 1.0}],
        ["one-step-off async overlaps rollout with training; the weight sync still stops "
         "generation, so t_async >= max(t_R, t_T) + t_W and the speedup is at most 2"])


def precision(shape: ModelShape, *, kv_tokens: int, rollout_bits: int, kv_bits: int
              ) -> dict[str, Any]:
    """Bytes P*b/8 per tensor class at bf16 and with the rollout side at `rollout_bits`."""
    p = shape.params()
    n = p["dense"] + p["expert"]
    kv_elems = kv_tokens * 2 * shape.attention_layers * shape.kv_heads * shape.head_dim
    classes = [("trainer weights", n, 16, 16), ("gradients (fp32 main grads)", n, 32, 32),
               ("optimizer (fp32 master + 2 moments)", 3 * n, 32, 32),
               ("engine weights", n, 16, rollout_bits),
               ("weight sync payload", n, 16, rollout_bits),
               ("KV cache", kv_elems, 16, kv_bits)]
    rows = [{"tensor": name, "elements": count, "bits_bf16": b0, "bytes_bf16": count * b0 / 8,
             "bits_planned": b1, "bytes_planned": count * b1 / 8,
             "halves": "yes" if b1 * 2 == b0 else ("no" if b1 == b0 else f"x{b1 / b0:g}")}
            for name, count, b0, b1 in classes]
    return Model("precision", {"params": n, "kv_tokens": kv_tokens, "rollout_bits": rollout_bits,
                               "kv_bits": kv_bits}, rows,
                 ["fp8 rollout halves engine weights and the sync payload; gradients and "
                  "optimizer states stay fp32, so trainer memory does not halve"])
