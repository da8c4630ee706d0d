"""The train stage's loss functions: glue from backend outputs to the pure functions of `algo/`.

Per-sample tensors (old/ref logprobs, advantages, aggregation weights, masks) are computed once
per global batch and looked up by sample index, so a micro-batch's loss is its exact share of the
global loss wherever it runs. Metrics are weighted sums with the same weights (slime's names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rltool.logprobs import effective_temperature
from rltool.train.algo.kl import approx_kl
from rltool.train.algo.opd import full_kl, topk_kl
from rltool.train.algo.losses import (aggregation_weights, gspo_log_ratio, policy_loss, sft_loss,
                                      value_loss, weighted_sum)
from rltool.train.backend import ForwardOutput, LossFn, MicroBatch
from rltool.train.config import TrainConfig


@dataclass
class SampleTensors:
    """Per-sample tensors of the sample set, indexed by sample index (response tokens each)."""

    masks: list[torch.Tensor]
    rollout_logprobs: list[torch.Tensor]
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None
    old_values: list[torch.Tensor] | None = None   # ppo: the value head at recompute time
    returns: list[torch.Tensor] | None = None      # ppo: GAE value targets
    # on-policy distillation (rltool.train.opd): teacher logprobs of the sampled tokens [L];
    # topk: the token set [L, k] and the teachers' logprobs at it; full: theirs [L, V]
    teacher_logprobs: list[torch.Tensor] | None = None
    opd_ids: list[torch.Tensor] | None = None
    opd_teacher: list[torch.Tensor] | None = None


_DATA_KEYS = ("old_logprobs", "ref_logprobs", "advantages", "old_values", "returns",
              "teacher_logprobs", "opd_ids", "opd_teacher")


def pack_data(data: SampleTensors) -> dict[str, torch.Tensor]:
    """Ragged per-sample tensors -> flat safetensors entries (lengths are the responses')."""
    out = {}
    for key in _DATA_KEYS:
        values = getattr(data, key)
        if values is not None:
            out[key] = torch.cat(values).float() if values else torch.zeros(0)
    return out


def base_tensors(samples: list[Any]) -> SampleTensors:
    """Masks and rollout logprobs, each built as one tensor and split per sample (views)."""
    def ragged(key: str) -> list[torch.Tensor]:
        rows = [getattr(s, key) for s in samples]
        flat = torch.tensor([x for row in rows for x in row], dtype=torch.float32)
        return list(flat.split([len(row) for row in rows]))

    return SampleTensors(masks=ragged("loss_mask"), rollout_logprobs=ragged("rollout_logprobs"))


def unpack_data(tensors: dict[str, torch.Tensor], samples: list[Any]) -> SampleTensors:
    data = base_tensors(samples)
    sizes = [m.numel() for m in data.masks]
    for key in _DATA_KEYS:
        if key in tensors:
            setattr(data, key, list(torch.split(tensors[key], sizes)))
    return data


def _cat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(values) if values else torch.zeros(0)


def to_device(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`parts` on `device`, in order: those elsewhere move in one non-blocking copy per source
    device and dtype, of their concatenation (into pinned memory when the copy goes from the CPU
    to a GPU), and come back as views of it. One blocking copy per tensor would wait on the host
    for each; parts already on `device` are returned as they are."""
    out = list(parts)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, part in enumerate(parts):
        if part.device != device:
            groups.setdefault((part.device, part.dtype), []).append(k)
    for (source, dtype), idx in groups.items():
        sizes = [parts[k].numel() for k in idx]
        pin = source.type == "cpu" and device.type == "cuda"
        flat = torch.empty(sum(sizes), dtype=dtype, device=source, pin_memory=pin)
        torch.cat([parts[k].reshape(-1) for k in idx], out=flat)
        for k, piece in zip(idx, flat.to(device, non_blocking=True).split(sizes)):
            out[k] = piece.view(parts[k].shape)
    return out


@dataclass
class BatchTerms:
    """What one global batch's loss needs beyond the per-sample tensors, by sample index."""

    weights: dict[int, torch.Tensor]     # aggregation weights (rltool.train.algo.losses)
    scales: dict[int, torch.Tensor]      # per-token multipliers of the policy loss (TIS weights)
    metrics: dict[str, float]            # batch-level metrics (mismatch), not summed over ranks


def batch_terms(cfg: TrainConfig, data: SampleTensors, batch: list[int],
                groups: torch.Tensor) -> BatchTerms:
    """Mismatch correction (rltool.train.algo.mismatch) and aggregation weights of one batch.

    Both depend on old and rollout logprobs only, never on the policy being trained, so they are
    fixed for the whole optimizer step; rejection sampling shrinks the masks the weights use.
    """
    from rltool.train.algo.mismatch import rollout_correction

    masks = [data.masks[i] for i in batch]
    scales = masks
    metrics: dict[str, float] = {}
    if cfg.loss == "policy" and not cfg.bypass and data.old_logprobs is not None and batch:
        lengths = [m.numel() for m in masks]
        # [B, longest]: row k holds sample k's tokens, then zeros (pad_sequence's layout)
        real = torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)

        def pad(parts: list[torch.Tensor]) -> torch.Tensor:
            out = torch.zeros(real.shape, dtype=parts[0].dtype)
            out[real] = torch.cat(parts)
            return out

        corr = rollout_correction(
            pad([data.rollout_logprobs[i] for i in batch]), loss_mask=pad(masks),
            old_logprobs=pad([data.old_logprobs[i] for i in batch]), tis_mode=cfg.tis_mode,
            tis_level=cfg.tis_level, tis_clip_low=cfg.tis_clip_low,
            tis_clip_high=cfg.tis_clip_high, rs_level=cfg.rs_level, rs_low=cfg.rs_low,
            rs_high=cfg.rs_high, rs_veto_threshold=cfg.rs_veto_threshold)
        masks = list(corr.loss_mask.float()[real].split(lengths))
        scales = list(corr.weights.float()[real].split(lengths))
        metrics = {name: float(value) for name, value in corr.metrics.items()}
    weights = aggregation_weights(masks, groups, mode=cfg.loss_aggregation)
    return BatchTerms(weights=dict(zip(batch, weights)), scales=dict(zip(batch, scales)),
                      metrics=metrics)


def old_from_forward(cfg: TrainConfig, backend: Any, tags: list[str]) -> bool:
    """Whether the first optimizer step's forward can give its batch's old logprobs instead of
    a no-grad pass before it (BatchLoss), provided the batch runs as one micro-batch (the
    caller checks that last, it schedules the batch). Its weights are the ones that pass would
    use, and the torch backend's forward with grad on the CPU computes the same bits; it needs
    one process, the old logprobs must not be needed before the step (no snapshots, value head,
    distillation or routing replay), nor may train mode change the model's output (dropout)."""
    if (cfg.loss != "policy" or cfg.bypass or cfg.backend != "torch"
            or tags or cfg.needs_ref or cfg.value_head or cfg.opd_type not in (None, "off") or cfg.deterministic
            or cfg.use_rollout_routing_replay or backend.dp_size != 1
            or backend.device.type != "cpu"):
        return False
    inner = backend.inner
    return not float(getattr(inner.config, "attention_dropout", 0.0) or 0.0) and not any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in inner.modules())


class BatchLoss:
    """The loss of one global batch: make_loss_fn with the batch's terms (kept in `terms`).
    Where its old logprobs are None (old_from_forward), the forward of its one micro-batch
    gives them: recorded in `data` first, then the terms and the loss as with them known."""

    def __init__(self, cfg: TrainConfig, data: SampleTensors, batch: list[int],
                 groups: torch.Tensor, *, temperature: float):
        self.cfg, self.data, self.batch, self.groups = cfg, data, batch, groups
        self.temperature = temperature
        self.terms: BatchTerms | None = None
        self._loss: LossFn | None = None
        if data.old_logprobs is None or all(data.old_logprobs[i] is not None for i in batch):
            self._set_terms()

    def _set_terms(self) -> None:
        self.terms = batch_terms(self.cfg, self.data, self.batch, self.groups)
        self._loss = make_loss_fn(self.cfg, self.data, self.terms, temperature=self.temperature)

    @property
    def metrics(self) -> dict[str, float]:
        """The batch-level metrics of its terms (known once its old logprobs are)."""
        assert self.terms is not None
        return self.terms.metrics

    def __call__(self, out: ForwardOutput, mb: MicroBatch
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self._loss is None:
            assert self.data.old_logprobs is not None and sorted(mb.indices) == sorted(self.batch)
            for i, lp in zip(mb.indices, out.logprobs):
                self.data.old_logprobs[i] = lp.detach().cpu().clone()
            self._set_terms()
        assert self._loss is not None
        return self._loss(out, mb)


def make_loss_fn(cfg: TrainConfig, data: SampleTensors, terms: BatchTerms, *,
                 temperature: float = 1.0) -> LossFn:
    """The loss of `cfg.loss` for one global batch (see BatchTerms); `temperature`: the
    sampling temperature, for the topk/full distillation terms."""

    def stage(out: ForwardOutput, mb: MicroBatch,
              sources: dict[str, dict[int, torch.Tensor] | list[torch.Tensor]]
              ) -> dict[str, list[torch.Tensor]]:
        """Each source's tensors of the micro-batch's samples, on the forward's device (the
        per-sample tensors live on the CPU: they go into checkpoints)."""
        parts = [values[i] for values in sources.values() for i in mb.indices]
        moved = iter(to_device(parts, out.logprobs[0].device))
        return {name: [next(moved) for _ in mb.indices] for name in sources}

    def sft(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        w = _cat(stage(out, mb, {"weights": terms.weights})["weights"])
        loss = weighted_sum(sft_loss(_cat(out.logprobs)), w)
        metrics = {"train/loss": loss, "train/sft_loss": loss}
        if out.entropy is not None:
            metrics["train/entropy_loss"] = weighted_sum(_cat(out.entropy), w)
        return loss, metrics

    def policy(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert data.old_logprobs is not None and data.advantages is not None
        sources = {"weights": terms.weights, "scales": terms.scales, "old": data.old_logprobs,
                   "advantages": data.advantages}
        if cfg.advantage_estimator == "gspo":
            sources["masks"] = data.masks
        if data.ref_logprobs is not None:
            sources["ref"] = data.ref_logprobs
        if data.opd_teacher is not None:
            sources["teacher"] = data.opd_teacher
            if data.opd_ids is not None:
                sources["opd_ids"] = data.opd_ids
        if data.returns is not None:
            assert data.old_values is not None
            sources["old_values"], sources["returns"] = data.old_values, data.returns
        t = stage(out, mb, sources)
        old = t["old"]
        if cfg.advantage_estimator == "gspo":
            log_ratio = gspo_log_ratio(out.logprobs, old, t["masks"])
        else:
            log_ratio = [lp - o for lp, o in zip(out.logprobs, old)]
        w = _cat(t["weights"])
        pl = policy_loss(_cat(log_ratio), _cat(t["advantages"]),
                         eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
                         eps_clip_c=cfg.eps_clip_c)
        pg_loss = weighted_sum(pl.loss * _cat(t["scales"]), w)
        loss = pg_loss
        metrics = {"train/pg_loss": pg_loss, "train/pg_clipfrac": weighted_sum(pl.clipped, w),
                   "train/ppo_kl": weighted_sum(pl.ppo_kl, w)}
        if out.entropy is not None:
            entropy = weighted_sum(_cat(out.entropy), w)
            metrics["train/entropy_loss"] = entropy
            loss = loss - cfg.entropy_coef * entropy
        if data.ref_logprobs is not None:
            kl = approx_kl(_cat(out.logprobs), _cat(t["ref"]), kl_type=cfg.kl_loss_type)
            kl_loss = weighted_sum(kl, w)
            metrics["train/kl_loss"] = kl_loss
            loss = loss + cfg.kl_loss_coef * kl_loss
        if data.opd_teacher is not None:
            loss = loss + cfg.opd_kl_coef * _opd_term(out, t, w, metrics)
        if data.returns is not None:
            vl = value_loss(_cat(out.extras["values"]), _cat(t["old_values"]),
                            _cat(t["returns"]), value_clip=cfg.value_clip)
            v_loss = weighted_sum(vl.loss, w)
            metrics["train/value_loss"] = v_loss
            metrics["train/value_clipfrac"] = weighted_sum(vl.clipped, w)
            loss = loss + cfg.value_loss_coef * v_loss
        metrics["train/loss"] = loss
        return loss, metrics

    def _opd_term(out: ForwardOutput, t: dict[str, list[torch.Tensor]], w: torch.Tensor,
                  metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        """The topk / full reverse KL to the teacher under the live student (a loss term)."""
        temp = effective_temperature(temperature)
        teacher = t["teacher"]
        if "opd_ids" in t:
            kl = [topk_kl(lg, ids, tt, temperature=temp) for lg, ids, tt in
                  zip(out.extras["logits"], t["opd_ids"], teacher)]
        else:
            kl = [full_kl(lg, tt, temperature=temp)
                  for lg, tt in zip(out.extras["logits"], teacher)]
        metrics["train/opd_kl"] = weighted_sum(_cat(kl), w)
        return metrics["train/opd_kl"]

    return sft if cfg.loss == "sft" else policy
