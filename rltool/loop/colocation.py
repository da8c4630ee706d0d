"""Who holds the device in a colocated loop, and the peak memory of every phase.

The colocated loop on CUDA (`[loop] device = "cuda"`, a resident trainer, engines the loop
started) alternates the device between the engines and the trainer, so that the trainer's state
and the engines' memory are never on it together:

| phase | on the device | elsewhere |
|---|---|---|
| rollout, eval | engines: weights, KV pool, graphs; the trainer's fp32 parameters with `[loop] offload = "optimizer"` | trainer: optimizer state (and parameters unless kept) in pinned host memory; gradients freed |
| train, publish | trainer | engines released (`/release_memory_occupation`, or the in-process engine's call) |
| sync | first the trainer: its weights are staged in pinned host memory in the engines' dtype; it is offloaded; the engines resume (a KV pool sized without the trainer) and take the staged weights (CUDA IPC buckets, or a copy into the in-process engine) | |

Before the first offload the trainer's policy is planned (rltool.train.memplan: `[loop] offload`,
auto choosing from the device's and host's memory) and logged with each phase's predicted peak; a
plan that does not fit stops the loop with a one-line error naming the knob.

Elsewhere (CPU, disaggregated) only the disk-sync release/resume the colocated loop always made
remains: engines release before training and resume before loading a version from disk.

On CUDA (`[loop] device`), `PhaseMemory` resets the loop process's CUDA peak before each phase
and records `memory/<phase>_peak_gib` after it (the trainer's and the in-process engine's
allocations), with `memory/<phase>_device_used_gib`: what the whole device has in use at the end
of the phase, served engines included.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rltool.loop.config import LoopSettings
from rltool.train.memfit import lora_params, read_hf_config, trainer_bytes
from rltool.train.memplan import DENSE, Plan, Shape, choose, host_available

log = logging.getLogger(__name__)
GIB = float(1 << 30)


class Residency:
    """The device's holder in one loop process; `alternate` is the CUDA colocated mode."""

    def __init__(self, settings: LoopSettings, engines: Any, *, resident: bool, disk_sync: bool):
        loop = settings.loop
        self.engines = engines
        self.colocated = loop.placement == "colocated" and loop.mode == "sync"
        shared = (resident and self.colocated and not loop.external
                  and loop.launcher == "local" and settings.device == "cuda"
                  and getattr(engines, "device", None) == "cuda")
        # offload none: trainer and engines share the device the whole run, nothing alternates
        self.alternate = shared and loop.offload != "none"
        self.together = shared and loop.offload == "none"
        self.disk_sync = disk_sync
        self.offload = loop.offload
        self.min_kv_tokens = loop.min_kv_tokens
        self.policy: str | None = None  # the trainer's offload policy, set at its first offload
        self.plan: Plan | None = None  # and the memory plan behind it
        self.engines_released = False
        self.seconds: dict[str, float] = {}  # offload/reload seconds of the current step
        self._stage: dict[str, torch.Tensor] = {}  # pinned host buffers of the staged weights

    def _add(self, key: str, t0: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def release_engines(self) -> None:
        if not self.engines_released:
            t0 = time.perf_counter()
            self.engines.release_memory()
            self.engines_released = True
            self._add("engine_release", t0)

    def resume_engines(self) -> None:
        if self.engines_released:
            t0 = time.perf_counter()
            self.engines.resume_memory()
            self.engines_released = False
            self._add("engine_resume", t0)

    def plan_offload(self, trainer: Any) -> str:
        """The trainer's offload policy for this device and host (`[loop] offload`; `none` is
        only checked to fit), set on it;
        `plan` holds the memory plan (none for a model it does not cover, offloaded as set)."""
        if self.offload != "none":
            trainer.check_offloadable()
        opts = trainer.backend.options
        config = trainer.backend.config
        if opts.backend == "megatron" or opts.master_weights:
            # its own plan (rltool.train.memfit), beside the engines: nothing alternates
            return self._plan_together(trainer)
        if self.offload != "auto" and getattr(config, "model_type", None) not in DENSE:
            log.info("no memory plan for a %s model; offload %s as set", config.model_type,
                     self.offload)
            policy = self.offload
        else:
            self._choose(trainer, config, self.offload)
            policy = self.plan.offload
        trainer.keep_params(policy == "optimizer")
        return policy

    def _plan_together(self, trainer: Any) -> str:
        """`none` for a trainer the device offload does not cover (the megatron backend, torch
        with master weights): its train step and resident state from its own memory plan
        (rltool.train.memfit.trainer_bytes), checked against the device with the engines'."""
        hf_config = read_hf_config(trainer.model_dir)
        if hf_config.get("model_type") not in DENSE:
            log.info("no memory plan for a %s model; offload none", hf_config.get("model_type"))
            return "none"
        self._choose(trainer, hf_config, "none",
                     trainer=trainer_bytes(trainer.backend.options, hf_config))
        return "none"

    def _choose(self, trainer: Any, config: Any, offload: str, **extra: Any) -> None:
        """self.plan: the memory plan for the model `config` beside the engines, logged."""
        opts = trainer.backend.options
        dtype = getattr(self.engines, "dtype", torch.bfloat16)
        self.plan = choose(Shape.of(config), offload=offload,
                           device_bytes=torch.cuda.mem_get_info()[1],
                           host_bytes=host_available(), compute_dtype=opts.dtype,
                           engine_dtype="fp32" if dtype == torch.float32 else "bf16",
                           micro_batch_tokens=opts.max_tokens_per_microbatch,
                           recompute=opts.recompute == "full",
                           logprob_chunk_tokens=opts.logprob_chunk_tokens,
                           kv_tokens=self.min_kv_tokens,
                           lora_params=lora_params(Shape.of(config), opts), **extra)
        log.info("memory plan (predicted peaks): %s", self.plan.summary())

    def offload_trainer(self, trainer: Any) -> None:
        if trainer is not None and self.alternate and not trainer.offloaded:
            if self.policy is None:
                self.policy = self.plan_offload(trainer)
            move = trainer.offload()
            self.seconds["trainer_offload"] = self.seconds.get("trainer_offload", 0.0) + \
                move.seconds
            log.info("trainer offloaded (%s): %s to host, gradients %.2f GiB freed, in %.2fs",
                     self.policy, ", ".join(f"{k} {v / GIB:.2f} GiB"
                                                  for k, v in move.moved.items()) or "nothing",
                     move.grads_freed / GIB, move.seconds)

    def reload_trainer(self, trainer: Any) -> None:
        if self.alternate and trainer.offloaded:
            move = trainer.reload()
            self.seconds["trainer_reload"] = self.seconds.get("trainer_reload", 0.0) + \
                move.seconds

    # ----- the phases' calls -------------------------------------------------------------------

    def for_engines(self, trainer: Any) -> None:
        """Rollout and eval: the trainer off the device, the engines back on it."""
        self.offload_trainer(trainer)
        if self.alternate or self.disk_sync:
            self.resume_engines()

    def before_trainer(self, *, training: bool) -> None:
        """Before the resident trainer is built, reloaded or trains: the engines release their
        memory (CUDA colocated always; a colocated disk sync when it trains)."""
        if self.alternate or (self.colocated and self.disk_sync and training):
            self.release_engines()

    def engine_weights(self, trainer: Any, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        """The trainer's weights as the engines take them. Alternating: staged in pinned host
        memory in `dtype`, then the trainer is offloaded and the engines resume; otherwise the
        trainer's own tensors (the transport casts them): on the device with `offload = "none"`
        (planned at the first sync, refused there when trainer and engines do not fit together),
        else host copies."""
        if self.together:
            if self.plan is None:
                self.policy = self.plan_offload(trainer)
            return trainer.named_tensors(on_device=True)
        if not self.alternate:
            return trainer.named_tensors()
        if trainer.offloaded:
            self.release_engines()
            self.reload_trainer(trainer)
        t0 = time.perf_counter()
        staged = []
        for name, t in trainer.named_tensors(on_device=True):  # cast where they live
            buf = self._stage.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != dtype:
                buf = torch.empty(t.shape, dtype=dtype, pin_memory=torch.cuda.is_available())
                self._stage[name] = buf
            buf.copy_(t.detach().to(dtype), non_blocking=True)
            staged.append((name, buf))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._add("stage_weights", t0)
        self.offload_trainer(trainer)
        self.resume_engines()
        return staged


class PhaseMemory:
    """Per-phase peak of the loop process's CUDA allocations (`active`: a loop on CUDA)."""

    def __init__(self, *, active: bool) -> None:
        self.active = active
        self.row: dict[str, float] = {}

    def start(self) -> None:
        if self.active:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def stop(self, phase: str) -> None:
        if not self.active:
            return
        torch.cuda.synchronize()
        self.row[f"memory/{phase}_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        free, total = torch.cuda.mem_get_info()
        self.row[f"memory/{phase}_device_used_gib"] = (total - free) / GIB
