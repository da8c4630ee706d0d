"""The train stage: `rltool train` as a library call, `run(cfg) -> TrainResult`.

1. resolve --load (HF weights, a checkpoint, or a --save dir), build the backend; --ref and
   --old-actor are weight snapshots (rltool.train.backuper) switched into the same model;
2. read and verify the samples (shards with the model's tokenizer hash, or an SFT prompts file);
3. for a new sample set: recompute old (and ref) logprobs with the training micro-batch schedule,
   then advantages; when --load is a checkpoint of this same set, continue where it stopped with
   the tensors it saved (bit-identical to an uninterrupted run);
4. optimizer steps over global batches; train.jsonl after each; checkpoints every
   --save-interval steps and at the end (step-NNNNNN, NNNNNN = policy version);
5. publish the final policy as weight_vNNNNNN.
Runs as one process or under torchrun (every rank calls `run`; rank 0 writes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltool import atomic, trace
from rltool.errors import CheckpointError, ConfigError
from rltool.rundir import MetricsWriter, step_dir_name, weight_dir_name
from rltool.train import memfit, opd
from rltool.train.backend import build_backend
from rltool.train.checkpoint import LoadTarget, read_trainer_state, resolve_load
from rltool.train.config import TrainConfig
from rltool.train.launch import is_rank_zero, process_group_scope
from rltool.train.objective import unpack_data
from rltool.train.samples import SampleSet
from rltool.train.step import (StepPlan, compute_logprobs, default_metrics_path, load_samples,
                               prepare_set, role_snapshots, train_set)

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    policy_version: int
    optimizer_steps: int            # applied by this call
    checkpoint: str | None
    published: str | None
    metrics: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        last = self.metrics[-1] if self.metrics else {}
        return {"policy_version": self.policy_version, "optimizer_steps": self.optimizer_steps,
                "checkpoint": self.checkpoint, "published": self.published, "last_metrics": last}


def run(cfg: TrainConfig) -> TrainResult:
    """Train on cfg's samples; see the module docstring. Collective under torchrun."""
    _check_output_paths(cfg)  # before the trace directory beside --save is set up
    trace_dir = Path(cfg.save).parent / "trace" if cfg.save else None
    with process_group_scope(), trace.scope(trace_dir, role="train"):
        return _run(cfg)


def _resume_step(cfg: TrainConfig, ckpt_dir: Path | None, sample_set: SampleSet,
                 plan: StepPlan) -> int:
    """The step to start at: where --load's checkpoint stopped on this same sample set, else 0."""
    if ckpt_dir is None:
        return 0
    position = read_trainer_state(ckpt_dir).get("data", {})
    if (position.get("set_id") != sample_set.set_id
            or position.get("next_step", 0) >= position.get("num_steps", 0)):
        return 0
    if position["num_steps"] != plan.num_steps or position["global_batch_size"] != plan.gbs:
        raise ConfigError(
            f"--load {ckpt_dir} stopped at step {position['next_step']} of "
            f"{position['num_steps']} (global batch {position['global_batch_size']}) on these "
            "samples; resume with the same --num-steps/--num-epochs and --global-batch-size")
    # the batches' order: another would train some samples of the epoch twice and others never
    for flag, key, value in (("--shuffle", "shuffle", cfg.shuffle), ("--seed", "seed", cfg.seed)):
        if key in position and position[key] != value:
            raise ConfigError(f"--load {ckpt_dir} stopped at step {position['next_step']} on "
                              f"these samples with {flag} {position[key]}; resume with the same "
                              f"{flag} (this run has {value})")
    return int(position["next_step"])


def _check_weights(flag: str, model_dir: Path) -> None:
    """CheckpointError naming `flag` when the weights' safetensors headers are unreadable or a
    file is truncated."""
    from rltool.io.checkpoint import checkpoint_tensors

    try:
        checkpoint_tensors(model_dir)
    except CheckpointError as e:
        raise CheckpointError(f"{flag}: {e}; pass a complete HF weights directory") from e


def _check_output_paths(cfg: TrainConfig) -> None:
    """BadInputError for an output path at or under a file (or a directory where a file goes)."""
    for flag, path, directory in (("--publish", cfg.publish, True), ("--save", cfg.save, True),
                                  ("--metrics", default_metrics_path(cfg), False)):
        if path:
            atomic.check_output_path(path, flag=flag, directory=directory)


def _check_outputs_free(cfg: TrainConfig, *, first_version: int, final_version: int) -> None:
    """Refuse up front (before any work) what would collide with existing outputs."""
    _check_output_paths(cfg)
    if cfg.publish:
        final = Path(cfg.publish) / weight_dir_name(final_version)
        if final.exists():
            raise CheckpointError(f"{final} already exists; a published version is never "
                                  "replaced (resume from the checkpoint that produced it, or "
                                  "publish elsewhere)")
    if cfg.save:
        for version in range(first_version + 1, final_version + 1):
            if (Path(cfg.save) / step_dir_name(version)).exists():
                raise CheckpointError(f"{Path(cfg.save) / step_dir_name(version)} already exists;"
                                      " checkpoints are never replaced (--load it to resume, or "
                                      "--save elsewhere)")


@dataclass
class Preflight:
    """Everything checked before a model is built: inputs resolved and valid, outputs free."""

    target: LoadTarget
    ref_target: LoadTarget | None
    old_actor_target: LoadTarget | None
    teachers: list[tuple[Any, Path]]   # in-process OPD teachers (spec, weights directory)
    sample_set: SampleSet
    plan: StepPlan
    start_step: int
    cfg: TrainConfig  # with the memory plan's recompute and micro-batch cap (rltool.train.memfit)


def preflight(cfg: TrainConfig, *, world_size: int | None = None) -> Preflight:
    """Resolve and verify every input, refuse output collisions (BadInputError, exit 2) and a
    setting the device's memory cannot hold (ConfigError, exit 2), so a bad call fails fast,
    changes nothing on disk, and fails before torchrun starts any rank. `world_size`: the ranks
    that will train (default: torchrun's WORLD_SIZE)."""
    target = resolve_load(cfg.load, adapter=True)
    if target.adapter_dir is not None and not cfg.lora_rank:
        raise ConfigError(f"--load {cfg.load} is a LoRA adapter: train it with --lora-rank R "
                          "(and the --lora-alpha and --lora-target-modules it was trained with)")
    ref_target = resolve_load(cfg.ref) if cfg.needs_ref and cfg.ref else None
    old_actor_target = resolve_load(cfg.old_actor) if cfg.old_actor else None
    if cfg.backuper_dir and Path(cfg.backuper_dir).exists() and not Path(cfg.backuper_dir).is_dir():
        raise ConfigError(f"--backuper-dir {cfg.backuper_dir} is not a directory; pass a "
                          "directory on local SSD (created if missing)")
    sample_set = load_samples(cfg, target.model_dir)
    longest = max((len(s.tokens) for s in sample_set.samples), default=1)
    cfg = cfg.model_copy(update=memfit.fit(cfg, target.model_dir, longest=longest,
                                           world_size=world_size))
    for flag, loaded in (("--load", target), ("--ref", ref_target),
                         ("--old-actor", old_actor_target)):
        if loaded is not None:  # the headers (as the --ref snapshot reads them): a corrupt file
            _check_weights(flag, loaded.model_dir)
    teachers = opd.resolve_teachers(cfg, target.model_dir, sample_set.samples)
    plan = StepPlan(cfg, len(sample_set.samples))
    start_step = _resume_step(cfg, target.ckpt_dir, sample_set, plan)
    _check_outputs_free(cfg, first_version=target.version,
                        final_version=target.version + plan.num_steps - start_step)
    return Preflight(target=target, ref_target=ref_target, old_actor_target=old_actor_target,
                     teachers=teachers, sample_set=sample_set, plan=plan, start_step=start_step,
                     cfg=cfg)


def _run(cfg: TrainConfig) -> TrainResult:
    checked = preflight(cfg)
    cfg = checked.cfg
    target, sample_set, plan, start_step = (checked.target, checked.sample_set, checked.plan,
                                            checked.start_step)
    samples = sample_set.samples
    version = target.version
    backend = build_backend(target.model_dir, options=cfg, value_head=cfg.value_head)
    if target.adapter_dir is not None:
        backend.load_adapter(target.adapter_dir)
    data, timings = None, {}
    if target.ckpt_dir is not None:
        _, tensors = backend.load(target.ckpt_dir)
        if start_step:
            data = unpack_data(tensors, samples)
            log.info("resuming sample set %s at step %d/%d", sample_set.set_id, start_step,
                     plan.num_steps)
    if data is None:
        snapshots = role_snapshots(
            cfg, backend, ref_dir=checked.ref_target and checked.ref_target.model_dir,
            old_actor_dir=checked.old_actor_target and checked.old_actor_target.model_dir,
            teachers=checked.teachers)
        try:
            data, timings = prepare_set(cfg, backend, snapshots, sample_set, plan)
        finally:
            if snapshots is not None:
                snapshots.close()
    writer_path = default_metrics_path(cfg)
    writer = MetricsWriter(writer_path) if writer_path and is_rank_zero() else None
    try:
        version, rows, checkpoint = train_set(
            cfg, backend, data, sample_set, plan, start_step=start_step, version=version,
            timings=timings, writer=writer, save_every=cfg.save_interval)
    finally:
        if writer is not None:
            writer.close()
    published = None
    if cfg.publish:
        adapter = cfg.lora_rank > 0 and not cfg.lora_merge_on_publish
        state = backend.export_adapter() if adapter else backend.export_hf_state_dict()
        if is_rank_zero():
            sync_metrics = (_publish_adapter(cfg, backend, state, version=version) if adapter else
                            _publish(cfg, state, source_model_dir=target.model_dir,
                                     version=version))
            published = sync_metrics["sync/path"]
            if writer_path:
                with MetricsWriter(writer_path) as sync_writer:
                    sync_writer.log({k: v for k, v in sync_metrics.items()
                                     if k.startswith("perf/") or k == "sync/mode"},
                                    step=backend.optimizer_steps, policy_version=version)
    return TrainResult(policy_version=version, optimizer_steps=plan.num_steps - start_step,
                       checkpoint=checkpoint, published=published, metrics=rows)


def _publish(cfg: TrainConfig, state: dict[str, Any], *, source_model_dir: Path,
             version: int) -> dict[str, Any]:
    """Publish `version` under --publish by --sync (rltool.delta.publish, as the loop does)."""
    from rltool.delta.publish import publish_version

    return publish_version(state, cfg, publish_dir=cfg.publish, version=version,
                           source_model_dir=source_model_dir, dtype=cfg.dtype)


def _publish_adapter(cfg: TrainConfig, backend: Any, state: dict[str, Any], *,
                     version: int) -> dict[str, Any]:
    """Publish `version` as a LoRA adapter (rltool.train.lora): the whole adapter every time, in
    the published dtype (--dtype bf16: bf16, else fp32)."""
    import torch

    from rltool.train.lora import publish_adapter

    t0 = time.perf_counter()
    out = publish_adapter(Path(cfg.publish) / weight_dir_name(version), tensors=state,
                          config=backend.lora.peft_config(backend.model_dir),
                          dtype=torch.bfloat16 if cfg.dtype == "bf16" else torch.float32)
    return {"sync/mode": "lora", "sync/path": str(out), "sync/version": version,
            "perf/update_weights_wire_bytes": sum(f.stat().st_size for f in out.iterdir()),
            "perf/update_weights_time": time.perf_counter() - t0}


def recompute_logprobs(weights_dir: str | Path, shard_dirs: list[str | Path], *,
                       max_tokens_per_microbatch: int, deterministic: bool, dtype: str = "fp32",
                       global_batch_size: int | None = None, device: str = "auto",
                       backend: str = "torch") -> list[list[float]]:
    """Logprobs of every shard row's response tokens (shard order) under `weights_dir`, computed
    exactly as training computes old logprobs: same reader checks, same DP micro-batch schedule per
    global batch, same temperature convention. Collective under torchrun (every rank returns all).
    With deterministic=True each sample is one unpadded forward (rltool.logprobs layout).
    `backend`: the trainer backend that recomputes (torch or megatron, default layout)."""
    cfg = TrainConfig(rollouts=[str(d) for d in shard_dirs], load=str(weights_dir),
                      max_tokens_per_microbatch=max_tokens_per_microbatch,
                      deterministic=deterministic, dtype=dtype,
                      global_batch_size=global_batch_size, device=device, backend=backend)
    with process_group_scope():  # the backend is gone (out of scope) when the group ends
        return _recompute_logprobs(cfg)


def _recompute_logprobs(cfg: TrainConfig) -> list[list[float]]:
    target = resolve_load(cfg.load)
    sample_set = load_samples(cfg, target.model_dir)
    trainer = build_backend(target.model_dir, options=cfg, trainable=False)
    plan = StepPlan(cfg, len(sample_set.samples))
    logprobs = compute_logprobs(trainer, sample_set.samples,
                                [plan.batch(k) for k in range(plan.steps_per_epoch)],
                                temperature=sample_set.temperature,
                                max_tokens_per_microbatch=cfg.max_tokens_per_microbatch)
    return [lp.tolist() for lp in logprobs["logprobs"]]
