"""`--recompute auto`, the automatic micro-batch token cap (`--max-tokens-per-microbatch 0`) and the
refusal of a training setting that cannot fit the device, all before any model is built.

The predicted peak of a rank comes from rltool.train.megatron_memplan (megatron backend) or
rltool.train.memplan's train phase (torch backend: the trainer's state, `torch_state`, plus its
activation estimate); under `--lora-rank` both count the frozen base's weights and the
adapters' training state. It must fit the device's memory less a reserve: 2 GiB (CUDA context,
library workspaces; rltool.train.memplan.DEVICE_RESERVE) and 5% of the device (the caching
allocator's blocks left free between micro-batches of different lengths).

The choice, fastest first (every candidate is checked against the plan):

- recompute: none, then selective (megatron), then full -- each step recomputes more of the
  forward pass (full: about a third more compute), so the least recompute that fits wins;
- the cap (0 = automatic): the largest multiple of 1,024 tokens up to 65,536 that fits, and at
  least the longest sample (a micro-batch holds one sample whole);
- both automatic: the least recompute whose largest fitting cap reaches AUTO_MIN_TOKENS (4,096,
  or the longest sample when longer), with that cap; when none does, the one that fits the
  largest cap. Less recompute is preferred over a larger cap because at 4k+ tokens the GEMMs of
  the presets' shapes are already large (an assumption, not yet measured on a GPU);
- with `--recompute auto` and `--logprob-chunk-tokens` left at its default, each recompute
  choice is tried with the default chunk, then with 2,048 and 1,024 rows, before more recompute:
  a smaller chunk of logits costs a few more, still large, LM-head GEMMs, a recompute a third
  more compute (the 3B shapes on an 80 GB H100: no recompute with chunks of 1,024 rows instead of
  full recompute).

Without a known device (no CUDA and no `--device-memory-gb`) nothing is checked: `auto` is
`none` and the automatic cap 4,096 tokens.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rltool.errors import CheckpointError, ConfigError
from rltool.train import megatron_memplan as mplan
from rltool.train import memplan

log = logging.getLogger(__name__)

GIB = float(1 << 30)
FRAGMENTATION = 0.05  # of the device, besides memplan.DEVICE_RESERVE
AUTO_MIN_TOKENS = 4096
AUTO_MAX_TOKENS = 65536
DEFAULT_TOKENS = 4096  # the automatic cap where no device is known
TOKEN_STEP = 1024

# (recompute, micro-batch tokens, logprob chunk rows or None: the options') -> device bytes
Predict = Callable[[str, int, "int | None"], int]
AUTO_CHUNKS = (2048, 1024)  # the smaller logprob chunks `--recompute auto` may take


def room(device_bytes: int) -> int:
    """What a plan may use of a device of `device_bytes` (the module docstring's reserve)."""
    return int(device_bytes - memplan.DEVICE_RESERVE - FRAGMENTATION * device_bytes)


def device_bytes(options: Any) -> int | None:
    """The device budget: `--device-memory-gb`, else the CUDA device's total memory (read from
    its properties, without creating a context), else None (the CPU: nothing to fit)."""
    if options.device_memory_gb is not None:
        return int(options.device_memory_gb * 1e9)
    if options.device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return int(torch.cuda.get_device_properties(local).total_memory)


# The linears of a decoder layer whose input is a normed hidden state (fp32 under autocast).
NORMED_INPUTS = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})


def torch_state(n: int, options: Any, *, lora: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes of the torch backend's state for `n` parameters: parameters (fp32, or
    bf16 with `--param-dtype bf16`), fp32 gradients (the main gradients with bf16 parameters),
    fp32 master weights (bf16 parameters only) and AdamW's two moments; the optimizer's part on
    the host with `--optimizer-cpu-offload` (with a host copy of the gradients). `lora`: the
    adapters' parameters under LoRA (`lora_params`): the `n` of the base are frozen (parameters
    only), gradients, masters and moments are the adapters'."""
    bf16 = options.param_dtype == "bf16"
    t = lora or n
    device = {"params": (2 if bf16 else 4) * (n + lora), "grads": 4 * t}
    optimizer = {"master_weights": 4 * t} if bf16 else {}
    optimizer["optimizer"] = 8 * t
    if not options.optimizer_cpu_offload:
        return device | optimizer, {}
    host = dict(optimizer, grads=4 * t)
    if not bf16:
        host["params"] = 4 * t  # the fp32 parameters the host optimizer steps
    return device, host


def lora_params(shape: memplan.Shape, options: Any) -> int:
    """The LoRA adapters' parameters of `options` on `shape` (0 without LoRA)."""
    if not options.lora_rank:
        return 0
    return shape.lora_params(options.lora_rank, options.lora_target_modules)


def megatron_lora(options: Any, hf_config: dict[str, Any]) -> mplan.Lora | None:
    """The adapters of `--lora-rank` for the megatron plan (None without LoRA), after the
    megatron backend's refusals of what its LoRA does not cover."""
    if not options.lora_rank:
        return None
    from rltool.train import megatron_lora as mlora

    mlora.check_layout(options, hf_config)
    return mplan.Lora(rank=options.lora_rank, dropout=options.lora_dropout,
                      targets=tuple(mlora.resolve_targets(list(options.lora_target_modules))))


def predictor(options: Any, hf_config: dict[str, Any], *, world_size: int) -> Predict:
    """The device bytes of one rank as a function of (recompute, tokens)."""
    if options.backend == "megatron":
        shape = mplan.ModelShape.of(hf_config)
        layout = mplan.Layout.of(options, world_size=world_size)
        fraction = options.optimizer_offload_fraction if options.optimizer_cpu_offload else 0.0
        adapters = megatron_lora(options, hf_config)

        def megatron(recompute: str, tokens: int, chunk: int | None = None) -> int:
            return mplan.plan(shape, layout, dtype=options.dtype, recompute=recompute,
                              micro_batch_tokens=tokens,
                              logprob_chunk_tokens=chunk or options.logprob_chunk_tokens,
                              offload_fraction=fraction, lora=adapters).device_bytes
        return megatron
    shape = memplan.Shape.of(hf_config)

    def torch_backend(recompute: str, tokens: int, chunk: int | None = None) -> int:
        return sum(torch_activations(shape, options, recompute=recompute, tokens=tokens,
                                     chunk=chunk).values()
                   ) + sum(torch_state(shape.params, options,
                                       lora=lora_params(shape, options))[0].values())
    return torch_backend


def torch_activations(shape: memplan.Shape, options: Any, *, recompute: str, tokens: int,
                      chunk: int | None = None) -> dict[str, int]:
    """The torch backend's activations (rltool.train.memplan's estimate); fp32 parameters under
    bf16 autocast without recompute add the bf16 copy of every weight that the forward casts and
    keeps for the backward pass (recomputed layers drop theirs).

    Under LoRA without recompute the layers keep what their forward saves once: memplan's layer
    term counts as much again for full training, which a LoRA step does not reach (measured on
    the Qwen2.5-3B shapes, one H100, 2026-12-07: 134 kB per layer and token with bf16 parameters
    against the single term's 126 kB). With fp32 parameters under bf16 autocast each adapter on a
    linear that reads a normed (fp32) hidden state casts it to bf16 on its own and keeps that copy
    for its weight gradient, beyond the two copies the layer term counts; a frozen base projection
    casts its input too but keeps none (it computes no weight gradient). Measured on the same
    shapes and card with rank 16 on all linears: 52.00 GiB at 5,120 tokens, 66.20 GiB at 8,192
    (planned 50.23 and 64.54; counting the base projections' copies too planned 53.75 and 70.17)."""
    out = memplan.activation_bytes(shape, tokens=tokens, compute_dtype=options.dtype,
                                   recompute=recompute == "full",
                                   logprob_chunk_tokens=chunk or options.logprob_chunk_tokens)
    autocast = options.dtype == "bf16" and options.param_dtype == "fp32"
    if autocast and recompute != "full":
        out["autocast_weights"] = 2 * shape.params
    if options.lora_rank and recompute == "none":
        out["layers"] //= 2
        if autocast:
            targets = shape.linears() if list(options.lora_target_modules) == ["all-linear"] \
                else options.lora_target_modules
            casts = max(0, len(NORMED_INPUTS.intersection(targets)) - 2)
            out["autocast_inputs"] = casts * 2 * shape.hidden * tokens * shape.layers
    return out


def trainer_bytes(options: Any, hf_config: dict[str, Any], *, world_size: int = 1
                  ) -> tuple[dict[str, int], dict[str, int]]:
    """(train step, resident state) device bytes of a trainer with concrete `recompute` and
    `max_tokens_per_microbatch`, by part: the colocated loop's plan of the megatron backend and
    of the torch backend with master weights (rltool.loop.colocation)."""
    tokens = getattr(options, "max_tokens_per_microbatch", 0) or DEFAULT_TOKENS
    if options.backend == "megatron":
        fraction = options.optimizer_offload_fraction if options.optimizer_cpu_offload else 0.0
        p = mplan.plan(mplan.ModelShape.of(hf_config),
                       mplan.Layout.of(options, world_size=world_size), dtype=options.dtype,
                       recompute=options.recompute, micro_batch_tokens=tokens,
                       logprob_chunk_tokens=options.logprob_chunk_tokens, offload_fraction=fraction,
                       lora=megatron_lora(options, hf_config))
        resident = {k: v for k, v in p.device.items()
                    if k in ("weights", "grads", "master_weights", "optimizer")}
        return p.device, resident
    shape = memplan.Shape.of(hf_config)
    state = torch_state(shape.params, options, lora=lora_params(shape, options))[0]
    return state | torch_activations(shape, options, recompute=options.recompute,
                                     tokens=tokens), state


def largest_cap(predict: Predict, recompute: str, *, budget: int, floor: int,
                chunk: int | None = None) -> int | None:
    """The largest cap (a multiple of TOKEN_STEP up to AUTO_MAX_TOKENS, or `floor` itself) whose
    plan fits `budget`; None when even `floor` does not."""
    if predict(recompute, floor, chunk) > budget:
        return None
    caps = range(AUTO_MAX_TOKENS // TOKEN_STEP, math.ceil(floor / TOKEN_STEP) - 1, -1)
    return next((k * TOKEN_STEP for k in caps if k * TOKEN_STEP >= floor
                 and predict(recompute, k * TOKEN_STEP, chunk) <= budget), floor)


def choose(predict: Predict, *, recompute: str, max_tokens: int, longest: int, budget: int,
           backend: str, chunks: tuple[int | None, ...] = (None,)
           ) -> tuple[str, int, int | None]:
    """(recompute, cap, logprob chunk) by the module docstring's rule; `chunks`: the logprob
    chunk sizes to try with each recompute, the options' (None) first. ConfigError (one line,
    naming the knobs) when no candidate fits `budget`."""
    order = [r for r in mplan.RECOMPUTES if backend == "megatron" or r != "selective"]
    candidates = [(r, c) for r in (order if recompute == "auto" else [recompute]) for c in chunks]
    last = candidates[-1]
    floor = max(longest, 1)
    if max_tokens:  # an explicit cap (a longer sample is a micro-batch of its own)
        tokens = max(max_tokens, longest)
        for r, c in candidates:
            if predict(r, tokens, c) <= budget:
                return r, max_tokens, c
        raise ConfigError(refusal(predict(last[0], tokens, last[1]), budget, backend=backend,
                                  recompute=last[0], tokens=tokens,
                                  longest=longest > max_tokens))
    fits = [(r, largest_cap(predict, r, budget=budget, floor=floor, chunk=c), c)
            for r, c in candidates]
    for r, cap, c in fits:
        if cap is not None and cap >= max(AUTO_MIN_TOKENS, floor):
            return r, cap, c
    best = max(((r, cap, c) for r, cap, c in fits if cap is not None), key=lambda f: f[1],
               default=None)
    if best is None:
        raise ConfigError(refusal(predict(last[0], floor, last[1]), budget, backend=backend,
                                  recompute=last[0], tokens=floor, longest=floor > 1))
    return best


def refusal(need: int, budget: int, *, backend: str, recompute: str, tokens: int,
            longest: bool = False) -> str:
    knobs = ("--recompute full" if recompute != "full" else None,
             "a smaller --max-tokens-per-microbatch (0: the largest that fits) or "
             "--logprob-chunk-tokens",
             "--optimizer-cpu-offload",
             "--param-dtype bf16" if backend == "torch" else None,
             "more GPUs (--nproc-per-node with --use-distributed-optimizer, tensor or pipeline "
             "parallelism)" if backend == "megatron" else "more GPUs (--parallel fsdp)")
    return (f"the {backend} train step needs {need / GIB:.1f} GiB of {budget / GIB:.1f} GiB "
            f"(recompute {recompute}, micro-batches of {tokens} tokens"
            + (", the longest sample" if longest else "") + "; the device less its reserve, "
            "see --device-memory-gb): use " + ", ".join(k for k in knobs if k))


def check_host(options: Any, hf_config: dict[str, Any], *, world_size: int,
               available: int | None = None) -> int:
    """The host bytes of `--optimizer-cpu-offload` for this host's ranks (each rank's share times
    LOCAL_WORLD_SIZE, else `world_size`); ConfigError when they exceed
    rltool.train.memplan.HOST_SHARE of the host memory `available` (default: what the host and
    this cgroup have available, rltool.train.memplan.host_available)."""
    if options.backend == "megatron":
        fraction = options.optimizer_offload_fraction
        host = mplan.state_bytes(mplan.ModelShape.of(hf_config),
                                 mplan.Layout.of(options, world_size=world_size),
                                 dtype=options.dtype, offload_fraction=fraction,
                                 lora=megatron_lora(options, hf_config))[1]
    else:
        shape = memplan.Shape.of(hf_config)
        host = torch_state(shape.params, options, lora=lora_params(shape, options))[1]
    need = sum(host.values()) * int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    share = int(memplan.HOST_SHARE * (memplan.host_available() if available is None
                                      else available))
    if need > share:
        fewer = ("a smaller --optimizer-offload-fraction (with --recompute auto), "
                 if options.backend == "megatron" else "")
        raise ConfigError(f"--optimizer-cpu-offload needs {need / GIB:.1f} GiB of host memory, "
                          f"{memplan.HOST_SHARE:.0%} of the available is {share / GIB:.1f} GiB: "
                          f"use {fewer}more hosts, or free host memory")
    return need


def read_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{model_dir}: unreadable config.json ({e})") from e


def fit(options: Any, model_dir: str | os.PathLike, *, longest: int = 1,
        world_size: int | None = None) -> dict[str, Any]:
    """The concrete `recompute` and `max_tokens_per_microbatch` for `options` (a BackendConfig or
    TrainConfig) as an update for `model_copy`; checks an explicit setting too. `longest`: the
    longest sample's tokens; `world_size`: the ranks (default: torchrun's WORLD_SIZE)."""
    max_tokens = getattr(options, "max_tokens_per_microbatch", DEFAULT_TOKENS)
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    total = device_bytes(options)
    if total is None:
        return {"recompute": "none" if options.recompute == "auto" else options.recompute,
                "max_tokens_per_microbatch": max_tokens or DEFAULT_TOKENS}
    try:
        predict = predictor(options, read_hf_config(model_dir), world_size=world)
    except ConfigError as e:  # a model the plans do not cover
        if options.recompute == "auto" or not max_tokens:
            raise ConfigError(f"--recompute auto and --max-tokens-per-microbatch 0 need the memory "
                              f"plan: {e}") from e
        log.info("no memory plan (%s); recompute %s and %d tokens a micro-batch as set", e,
                 options.recompute, max_tokens)
        return {"recompute": options.recompute, "max_tokens_per_microbatch": max_tokens}
    if options.optimizer_cpu_offload:
        check_host(options, read_hf_config(model_dir), world_size=world)
    chunk = options.logprob_chunk_tokens
    smaller = tuple(c for c in AUTO_CHUNKS if c < chunk)
    # auto may shrink a logprob chunk left at its default: cheaper than recomputing layers
    chunks = (None, *smaller) if options.recompute == "auto" and \
        "logprob_chunk_tokens" not in options.model_fields_set else (None,)
    recompute, cap, picked = choose(predict, recompute=options.recompute, max_tokens=max_tokens,
                                    longest=longest, budget=room(total),
                                    backend=options.backend, chunks=chunks)
    log.info("memory plan: recompute %s, %d tokens a micro-batch, logprob chunks of %d rows: "
             "%.1f GiB of %.1f GiB (device %.1f GiB less its reserve)", recompute, cap,
             picked or chunk, predict(recompute, max(cap, longest), picked) / GIB,
             room(total) / GIB, total / GIB)
    return {"recompute": recompute, "max_tokens_per_microbatch": cap,
            "logprob_chunk_tokens": picked or chunk}
