"""One sample set's training, shared by the two drivers: `rltool train` (rltool.train.stage, one
set per process) and the loop's resident trainer (rltool.train.resident, one set per loop step on
a trainer that stays in memory).

- `load_samples`: read and verify a set's samples before any model is built;
- `StepPlan`: which samples each optimizer step of the set uses (global batches per epoch);
- `role_snapshots`: the ref / old-actor / teacher weights switched into the one model;
- `prepare_set`: old and ref logprobs, then advantages, for a new set;
- `train_set`: the optimizer steps of a set, with metrics and checkpoints;
- `save_checkpoint`: a trainer checkpoint that records the set's position.

Both drivers call the same functions, so a set trained by either gives the same weights bit for
bit.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from rltool import trace
from rltool.errors import CheckpointError
from rltool.progress import Progress
from rltool.rundir import MetricsWriter, RunDir, step_dir_name
from rltool.train import opd
from rltool.train.algo.advantages import compute_advantages, gae, masked_whiten
from rltool.train.algo.multiturn import has_turns, turn_gae, turn_grpo, turns_of
from rltool.train.algo.kl import approx_kl
from rltool.train.algo.opd import shape_advantages
from rltool.train.backend import MicroBatch, TrainerBackend
from rltool.train.backuper import (WeightBackuper, dtensor_sharder, fsdp_resharder,
                                   module_tensors)
from rltool.train.config import TrainConfig
from rltool.train.dp_schedule import schedule
from rltool.train.objective import (BatchLoss, SampleTensors, base_tensors, old_from_forward,
                                    pack_data)
from rltool.train.samples import Sample, SampleSet, load_rollouts, load_sft_prompts
from rltool.train.torch_backend import VALUE_HEAD, TorchBackend


def rank_micro_batches(backend: TrainerBackend, samples: list[Sample], batch: list[int], *,
                       max_tokens_per_microbatch: int, replay: bool = False) -> list[MicroBatch]:
    """This rank's micro-batches of one global batch, from the DP schedule (the same plan for
    logprob recompute and training, so both see identical micro-batches)."""
    plan = schedule([samples[i].num_tokens for i in batch], dp_size=backend.dp_size,
                    max_tokens_per_microbatch=max_tokens_per_microbatch)
    micro = [[batch[j] for j in mb] for mb in plan[backend.dp_rank]]
    return [MicroBatch(indices=idx, tokens=[samples[i].tokens for i in idx],
                       response_starts=[samples[i].response_start for i in idx],
                       routed_experts=[samples[i].routed_experts for i in idx] if replay else None)
            for idx in micro]


def compute_logprobs(backend: TrainerBackend, samples: list[Sample], batches: list[list[int]], *,
                     temperature: float, max_tokens_per_microbatch: int,
                     with_values: bool = False, top_k: int = 0,
                     rows_fn: Any = None, replay: bool = False) -> dict[str, list[torch.Tensor]]:
    """Logprobs (and with_values, the value head's values; top_k, "topk_ids"; rows_fn, "rows":
    rows_fn(index, logits [L, V])) of every sample in `batches`, computed with the training
    schedule of each batch and shared with every rank: {"logprobs": [...], ...}, lists indexed
    like `samples` (empty tensors for samples not in any); replay: the rollout's routing (R3)."""
    keys = ["logprobs"] + ["values"] * with_values + ["topk_ids"] * bool(top_k) + ["rows"] * bool(
        rows_fn)
    own: dict[str, dict[int, torch.Tensor]] = {k: {} for k in keys}
    for batch in batches:
        for mb in rank_micro_batches(backend, samples, batch, replay=replay,
                                     max_tokens_per_microbatch=max_tokens_per_microbatch):
            with trace.span("logprob_recompute", cat="train", samples=len(mb.indices)):
                # with_logits only when asked: a backend without it (megatron) never gets it
                out = backend.forward_logprobs(mb, temperature=temperature, top_k=top_k,
                                               **({"with_logits": True} if rows_fn else {}))
            per_key = {"logprobs": out.logprobs, "values": out.extras.get("values", []),
                       "topk_ids": out.topk_ids or [],
                       "rows": [rows_fn(i, r) for i, r in zip(mb.indices,
                                                               out.extras.get("logits", []))]}
            for key in keys:
                own[key].update((i, t.detach().cpu()) for i, t in zip(mb.indices, per_key[key]))
    merged: dict[str, dict[int, torch.Tensor]] = {k: {} for k in keys}
    for part in backend.all_gather_object(own):
        for key in keys:
            merged[key].update(part[key])
    return {key: [merged[key].get(i, torch.zeros(0)) for i in range(len(samples))]
            for key in keys}


def global_batches(num_samples: int, *, global_batch_size: int, epoch: int, shuffle: bool,
                   seed: int) -> list[list[int]]:
    """The sample indices of each global batch of `epoch`, in order; shuffled with a seed of its
    own per epoch, so any step's batch can be rebuilt without replaying the steps before it."""
    order = list(range(num_samples))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return [order[i:i + global_batch_size] for i in range(0, num_samples, global_batch_size)]


class StepPlan:
    """Which samples each optimizer step of this sample set uses: `num_steps` steps over global
    batches of `gbs` samples, `steps_per_epoch` per pass over the set; `batch(step)` gives one."""

    def __init__(self, cfg: TrainConfig, num_samples: int):
        self.cfg = cfg
        self.gbs = min(cfg.global_batch_size or num_samples, num_samples)
        self.steps_per_epoch = math.ceil(num_samples / self.gbs)
        self.num_steps = cfg.num_steps or cfg.num_epochs * self.steps_per_epoch
        self.num_samples = num_samples

    def batch(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        return global_batches(self.num_samples, global_batch_size=self.gbs, epoch=epoch,
                              shuffle=self.cfg.shuffle, seed=self.cfg.seed)[k]


def optimizer_steps(cfg: TrainConfig, num_samples: int) -> int:
    """The optimizer steps one training call makes on a set of `num_samples` samples."""
    return StepPlan(cfg, num_samples).num_steps


def load_samples(cfg: TrainConfig, model_dir: Path, *, vocab_size: int | None = None
                 ) -> SampleSet:
    """Read and verify the samples before any model is built (bad input fails fast);
    `vocab_size`: the model's, when a built one gives it (else read from model_dir)."""
    from transformers import AutoConfig

    from rltool.data.tokenizer import tokenizer_hash

    if cfg.prompts:
        from transformers import AutoTokenizer

        return load_sft_prompts(cfg.prompts, tokenizer=AutoTokenizer.from_pretrained(str(model_dir)))
    if vocab_size is None:
        try:
            vocab_size = int(AutoConfig.from_pretrained(str(model_dir)).vocab_size)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{model_dir}: unreadable config.json ({e})") from e
    return load_rollouts(cfg.rollouts, tokenizer_hash=tokenizer_hash(model_dir),
                         vocab_size=vocab_size, routed_experts=cfg.use_rollout_routing_replay)


def role_snapshots(cfg: TrainConfig, backend: TorchBackend, *, ref_dir: Path | None,
                   old_actor_dir: Path | None, teachers: list | None = None
                   ) -> WeightBackuper | None:
    """The policy's weights as tag "actor", plus "ref" / "old_actor" / in-process OPD teachers
    read from their weights directories, switched into the one model (no second model on the
    device). None when the set needs none of them."""
    if ref_dir is None and old_actor_dir is None and not teachers:
        return None
    budget = cfg.backuper_host_budget_gb
    snapshots = WeightBackuper(
        module_tensors(backend.inner, exclude_prefixes=(VALUE_HEAD + ".",)),
        host_budget_bytes=None if budget is None else int(budget * 1e9),
        ssd_dir=cfg.backuper_dir, shard_full=dtensor_sharder(backend.inner),
        before_restore=fsdp_resharder(backend.inner))
    try:
        snapshots.backup("actor")
        for tag, directory in (("old_actor", old_actor_dir), ("ref", ref_dir)):
            if directory is not None:
                snapshots.load_dir(tag, directory)
        opd.load_teachers(snapshots, teachers or [])
    except BaseException:
        snapshots.close()
        raise
    return snapshots


def prepare_set(cfg: TrainConfig, backend: TrainerBackend, snapshots: WeightBackuper | None,
                sample_set: SampleSet, plan: StepPlan) -> tuple[SampleTensors, dict[str, float]]:
    """Old/ref logprobs and advantages for a new sample set (first epoch's schedule). Old
    logprobs come from tag "old_actor" when `snapshots` has it, else from the live weights; ref
    logprobs from tag "ref"; the next tag is prefetched while the current one computes."""
    samples = sample_set.samples
    data = base_tensors(samples)
    masks = data.masks
    timings: dict[str, float] = {}
    if cfg.loss == "sft":
        return data, timings
    batches = [plan.batch(k) for k in range(plan.steps_per_epoch)]
    kwargs = dict(temperature=sample_set.temperature,
                  max_tokens_per_microbatch=cfg.max_tokens_per_microbatch)
    tags = snapshots.tags if snapshots is not None else []
    switch_s = 0.0

    def switch(tag: str) -> None:
        nonlocal switch_s
        start = time.perf_counter()
        snapshots.restore(tag)
        switch_s += time.perf_counter() - start

    if "ref" in tags:
        snapshots.prefetch("ref")  # staged while the old logprobs compute
    if cfg.bypass:  # slime's --use-rollout-logprobs: the engine's logprobs are the old ones
        data.old_logprobs = list(data.rollout_logprobs)
    else:
        t0 = time.perf_counter()
        if "old_actor" in tags:
            switch("old_actor")
        # The first batch's may come from the first step's forward (objective.BatchLoss).
        first = set(batches[0]) if old_from_forward(cfg, backend, tags) and len(
            rank_micro_batches(backend, samples, batches[0], max_tokens_per_microbatch=cfg.
                               max_tokens_per_microbatch)) == 1 else set()
        # Values always come from the current weights (its value head trains with them).
        old = compute_logprobs(backend, samples, batches[1:] if first else batches,
                               replay=cfg.use_rollout_routing_replay,
                               with_values=cfg.value_head and "old_actor" not in tags, **kwargs)
        data.old_logprobs = [None if i in first else t for i, t in enumerate(old["logprobs"])]
        data.old_values = old.get("values")
        timings["perf/log_probs_time"] = time.perf_counter() - t0
    kl = None
    lora_ref = cfg.needs_ref and cfg.lora_rank > 0  # the base: the adapters off
    if "ref" in tags or lora_ref:
        t0 = time.perf_counter()
        with backend.adapters_off() if lora_ref else contextlib.nullcontext():
            if not lora_ref:
                switch("ref")
            data.ref_logprobs = compute_logprobs(backend, samples, batches, **kwargs)["logprobs"]
        timings["perf/ref_log_probs_time"] = time.perf_counter() - t0
        if cfg.kl_coef:
            kl = [approx_kl(o, r, kl_type=cfg.kl_loss_type)
                  for o, r in zip(data.old_logprobs, data.ref_logprobs)]
    if tags:
        switch("actor")
    timings.update(opd.prepare(
        cfg, data, samples, switch=switch, temperature=sample_set.temperature,
        vocab_size=backend.vocab_size,
        batches=batches, forward=lambda some, **kw: compute_logprobs(backend, samples, some,
                                                                    **kwargs, **kw)))
    if tags:
        timings["perf/weight_switch_time"] = switch_s
    rewards = torch.tensor([s.reward for s in samples])
    if cfg.value_head:
        if data.old_values is None:  # bypass or --old-actor: no values from the current weights
            data.old_values = compute_logprobs(backend, samples, batches, with_values=True,
                                               replay=cfg.use_rollout_routing_replay,
                                               **kwargs)["values"]
        if has_turns(samples):  # agentic episodes: each turn's reward on its last token
            advantages, data.returns = turn_gae(
                rewards=rewards, values=data.old_values, masks=masks, **turns_of(samples),
                gamma=cfg.gamma, lambd=cfg.lambd, kl=kl, kl_coef=cfg.kl_coef)
        else:
            advantages, data.returns = gae(rewards, data.old_values, masks, gamma=cfg.gamma,
                                           lambd=cfg.lambd, kl=kl, kl_coef=cfg.kl_coef)
        data.advantages = masked_whiten(advantages, masks)
    elif cfg.advantage_estimator == "turn_grpo":
        data.advantages = turn_grpo(
            rewards=rewards, groups=torch.tensor([s.group for s in samples], dtype=torch.long),
            masks=masks, **turns_of(samples), gamma=cfg.gamma,
            std_normalization=cfg.grpo_std_normalization)
    else:
        data.advantages = compute_advantages(
            cfg.advantage_estimator, rewards=rewards,
            groups=torch.tensor([s.group for s in samples], dtype=torch.long), masks=masks,
            kl=kl, kl_coef=cfg.kl_coef, gamma=cfg.gamma,
            std_normalization=cfg.grpo_std_normalization)
    if cfg.opd_type != "off" and cfg.opd_mode == "sampled":
        data.advantages = shape_advantages(data.advantages, data.old_logprobs,
                                           data.teacher_logprobs, kl_coef=cfg.opd_kl_coef)
    return data, timings


def default_metrics_path(cfg: TrainConfig) -> Path | None:
    """Where train.jsonl goes: --metrics, else the run directory's when --save is its
    train/ckpt, else next to --save; None without either."""
    if cfg.metrics:
        return Path(cfg.metrics)
    if cfg.save is None:
        return None
    save = Path(cfg.save)
    if save.parts[-2:] == ("train", "ckpt"):
        return RunDir(save.parent.parent).metrics_file("train")
    return save.parent / "train.jsonl"


def train_set(cfg: TrainConfig, backend: TrainerBackend, data: SampleTensors,
              sample_set: SampleSet, plan: StepPlan, *, start_step: int, version: int,
              timings: dict[str, float],
              writer: MetricsWriter | None, save_every: int | None
              ) -> tuple[int, list[dict[str, Any]], str | None]:
    """The optimizer steps of one sample set from `start_step`; with cfg.save, a checkpoint every
    `save_every` steps and after the last. Returns (policy version, metrics rows, last checkpoint).
    """
    samples = sample_set.samples
    # SFT fits the model's own distribution; the policy loss uses the sampling temperature.
    temperature = 1.0 if cfg.loss == "sft" else sample_set.temperature
    rows: list[dict[str, Any]] = []
    checkpoint = None
    progress = Progress("train", total=plan.num_steps - start_step, unit="steps")
    for step in progress.track(range(start_step, plan.num_steps)):
        t0 = time.perf_counter()
        batch = plan.batch(step)
        loss_fn = BatchLoss(cfg, data, batch, torch.tensor([samples[i].group for i in batch]),
                            temperature=temperature)
        micro = rank_micro_batches(backend, samples, batch,
                                   max_tokens_per_microbatch=cfg.max_tokens_per_microbatch,
                                   replay=cfg.use_rollout_routing_replay)
        with trace.span("train_step", cat="train", micro_batches=len(micro)), \
                trace.torch_profile(step=sample_set.rollout_step, name="train"):
            metrics = backend.train_step(micro, loss_fn, temperature=temperature, with_entropy=True,
                                         **({"with_logits": True} if cfg.opd_type != "off"
                                            and cfg.opd_mode != "sampled" else {}))
        version += 1
        metrics.update(loss_fn.metrics)
        metrics["perf/train_time"] = time.perf_counter() - t0
        metrics["train/num_samples"] = len(batch)
        metrics["train/failed_groups_left_out"] = sample_set.failed_groups
        metrics["train/failed_group_samples_left_out"] = sample_set.failed_group_samples
        metrics["rollout_step"] = sample_set.rollout_step
        if step == start_step:
            metrics.update(timings)
        if writer is not None:
            rows.append(writer.log(metrics, step=backend.optimizer_steps, policy_version=version))
        else:
            rows.append({"step": backend.optimizer_steps, "policy_version": version,
                         "time": time.time(), **metrics})
        progress.note(f"policy version {version}, loss {metrics.get('train/loss', 0.0):.4g}, "
                      f"grad norm {metrics['train/grad_norm']:.3g}")
        last = step == plan.num_steps - 1
        if cfg.save and (last or (save_every and (step + 1) % save_every == 0)):
            checkpoint = save_checkpoint(cfg, backend, data, sample_set, plan,
                                         version=version, next_step=step + 1)
    return version, rows, checkpoint


def save_checkpoint(cfg: TrainConfig, backend: TrainerBackend, data: SampleTensors,
                    sample_set: SampleSet, plan: StepPlan, *, version: int, next_step: int,
                    extra_state: dict[str, Any] | None = None) -> str:
    """Write `<cfg.save>/step-<version>` (collective; rank 0 writes): the backend's state, the
    set's tensors and its position (`next_step` of `plan`), so a `--load` of it on the same set
    continues where it stopped; `extra_state` joins the trainer state. Returns the directory."""
    import tomli_w

    assert cfg.save is not None
    ckpt_dir = Path(cfg.save) / step_dir_name(version)
    position = {"set_id": sample_set.set_id, "sources": sample_set.sources,
                "next_step": next_step, "num_steps": plan.num_steps,
                "global_batch_size": plan.gbs, "num_samples": plan.num_samples,
                "shuffle": cfg.shuffle, "seed": cfg.seed}
    backend.save(ckpt_dir, trainer_state={"policy_version": version, "data": position,
                                          **(extra_state or {})},
                 data_tensors=pack_data(data),
                 config_toml=tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True)))
    return str(ckpt_dir)
