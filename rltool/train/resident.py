"""A trainer that stays in memory across the loop's steps: the model, optimizer, schedule and RNG
are built once (from HF weights or a checkpoint) and each loop step trains on that step's sample
set with the same code as `rltool train` (rltool.train.step). Checkpoints are written when the
caller asks (the loop: every `save_interval` steps and at the end), and restoring one gives the
same state bit for bit: `ResidentTrainer.from_checkpoint` then `train` on the sets after it
replays a run deterministically.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rltool.errors import CheckpointError, ConfigError
from rltool.rundir import step_dir_name
from rltool.train.backend import build_backend
from rltool.train.checkpoint import read_trainer_state, resolve_load
from rltool.train.config import TrainConfig
from rltool.train.memfit import fit
from rltool.train.opd import resolve_teachers
from rltool.train.offload import Move, Offloader
from rltool.train.step import (StepPlan, default_metrics_path, load_samples, prepare_set,
                               role_snapshots, save_checkpoint, train_set)

log = logging.getLogger(__name__)


class ResidentTrainer:
    """`load`: HF weights (version 0) or a checkpoint written by `save`."""

    def __init__(self, cfg: TrainConfig):
        target = resolve_load(cfg.load, adapter=True)
        if target.adapter_dir is not None:
            raise CheckpointError(f"--load {cfg.load}: a LoRA adapter directory starts a run of "
                                  "rltool train, not of the loop's resident trainer; pass the "
                                  "trainer checkpoint (step-NNNNNN) or the base")
        # the memory plan's recompute and micro-batch cap, kept for every set (rltool.train.memfit)
        self.fitted = fit(cfg, target.model_dir)
        cfg = cfg.model_copy(update=self.fitted)
        self.model_dir = target.model_dir
        self.version = target.version
        self.loop_step = -1  # the last loop step trained (-1: none)
        self.backend = build_backend(target.model_dir, options=cfg, value_head=cfg.value_head)
        # --ref and in-process distillation teachers: weight snapshots of the one model, read
        # once; "actor" is backed up again before every set (the policy moved).
        self.snapshots = role_snapshots(
            cfg, self.backend, ref_dir=resolve_load(cfg.ref).model_dir
            if cfg.needs_ref and cfg.ref else None, old_actor_dir=None,
            teachers=resolve_teachers(cfg, self.model_dir, []))
        if target.ckpt_dir is not None:
            self.backend.load(target.ckpt_dir)
            self.loop_step = int(read_trainer_state(target.ckpt_dir).get("loop_step", -1))
        self._last: tuple[Any, Any, StepPlan, TrainConfig] | None = None
        # the megatron backend's buffers are megatron's, and master weights are the optimizer's
        # (device offload covers neither)
        self._offloader = (Offloader(self.backend.inner, self.backend.optimizer)
                           if cfg.backend == "torch" and not cfg.master_weights else None)
        # The trainer's own RNG stream: whatever else the loop's process draws between steps
        # leaves it alone, so it continues exactly as a reload from its checkpoint would.
        self._rng = torch.get_rng_state()

    def train(self, cfg: TrainConfig, *, loop_step: int, log_metrics: bool = True
              ) -> list[dict[str, Any]]:
        """Every optimizer step of cfg's sample set; metrics go to cfg's train.jsonl unless
        `log_metrics` is False (a replay writes none: the rows exist from the first time)."""
        from rltool.rundir import MetricsWriter

        torch.set_rng_state(self._rng)
        cfg = cfg.model_copy(update=self.fitted)
        sample_set = load_samples(cfg, self.model_dir, vocab_size=self.backend.vocab_size)
        plan = StepPlan(cfg, len(sample_set.samples))
        resolve_teachers(cfg, self.model_dir, sample_set.samples)  # every route names a teacher
        if self.snapshots is not None:
            self.snapshots.backup("actor")
        data, timings = prepare_set(cfg, self.backend, self.snapshots, sample_set, plan)
        path = default_metrics_path(cfg) if log_metrics else None
        writer = MetricsWriter(path) if path is not None else None
        try:
            self.version, rows, _ = train_set(
                cfg.model_copy(update={"save": None}), self.backend, data, sample_set, plan,
                start_step=0, version=self.version, timings=timings, writer=writer,
                save_every=None)
        finally:
            if writer is not None:
                writer.close()
        self.loop_step = loop_step
        self._last = (data, sample_set, plan, cfg)
        self._rng = torch.get_rng_state()
        return rows

    def checkpoint_dir(self, save: str | Path) -> Path:
        return Path(save) / step_dir_name(self.version)

    def save(self, save: str | Path) -> Path:
        """Write `<save>/step-<version>` (model, optimizer, RNG, the set's position at its end)."""
        assert self._last is not None, "save follows a train call"
        data, sample_set, plan, cfg = self._last
        torch.set_rng_state(self._rng)
        save_checkpoint(cfg.model_copy(update={"save": str(save)}), self.backend, data,
                        sample_set, plan, version=self.version, next_step=plan.num_steps,
                        extra_state={"loop_step": self.loop_step})
        return self.checkpoint_dir(save)

    @property
    def offloaded(self) -> bool:
        """Whether offload moved the state to host memory (and no reload followed)."""
        return self._offloader is not None and self._offloader.offloaded

    def keep_params(self, keep: bool) -> None:
        """Whether offload leaves the parameters on the device (`[loop] offload = "optimizer"`)."""
        offloader = self.check_offloadable()
        if offloader.offloaded:
            raise RuntimeError("change the offload policy while the trainer is loaded")
        offloader.params = not keep

    def offload(self) -> Move:
        """Optimizer state and (unless `keep_params`) parameters to host memory, gradients freed,
        releasing the device for the engine (rltool.train.offload); the reference model and
        distillation teachers are weight snapshots, held in host memory already."""
        return self.check_offloadable().offload()

    def reload(self) -> Move:
        return self.check_offloadable().reload()

    def check_offloadable(self) -> Offloader:
        if self._offloader is None:
            raise ConfigError("device offload of the resident trainer covers the torch backend "
                              "with fp32 parameters and its optimizer on the device only; set "
                              "[loop] offload = \"none\", or drop --param-dtype bf16 / "
                              "--optimizer-cpu-offload")
        return self._offloader

    def named_tensors(self, *, on_device: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The policy's weights under HF names (what an engine serves), in a stable order; host
        copies unless `on_device` and the backend is torch's (its parameters where they live)."""
        if on_device and self._offloader is not None:
            return sorted(self.backend.export_hf_state_dict(on_device=True).items())
        return sorted(self.backend.export_hf_state_dict().items())

