"""The train stage's loss functions: glue from backend outputs to the pure functions of `algo/`.

Per-sample tensors (old/ref logprobs, advantages, aggregation weights, masks) are computed once
per global batch and looked up by sample index, so a micro-batch's loss is its exact share of the
global loss wherever it runs. Metrics are weighted sums with the same weights (slime's names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltool.train.algo.kl import approx_kl
from rltool.train.algo.losses import gspo_log_ratio, policy_loss, sft_loss, weighted_sum
from rltool.train.backend import ForwardOutput, LossFn, MicroBatch
from rltool.train.config import TrainConfig


@dataclass
class SampleTensors:
    """Per-sample tensors of the sample set, indexed by sample index (response tokens each)."""

    masks: list[torch.Tensor]
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None


def _cat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(values) if values else torch.zeros(0)


def make_loss_fn(cfg: TrainConfig, data: SampleTensors, weights: dict[int, torch.Tensor]) -> LossFn:
    """The loss of `cfg.loss` for one global batch; `weights` maps sample index -> token weights."""

    def sft(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        w = _cat([weights[i] for i in mb.indices])
        loss = weighted_sum(sft_loss(_cat(out.logprobs)), w)
        metrics = {"train/loss": loss, "train/sft_loss": loss}
        if out.entropy is not None:
            metrics["train/entropy_loss"] = weighted_sum(_cat(out.entropy), w)
        return loss, metrics

    def policy(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert data.old_logprobs is not None and data.advantages is not None
        idx = mb.indices
        old = [data.old_logprobs[i] for i in idx]
        if cfg.advantage_estimator == "gspo":
            log_ratio = gspo_log_ratio(out.logprobs, old, [data.masks[i] for i in idx])
        else:
            log_ratio = [lp - o for lp, o in zip(out.logprobs, old)]
        w = _cat([weights[i] for i in idx])
        pl = policy_loss(_cat(log_ratio), _cat([data.advantages[i] for i in idx]),
                         eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
                         eps_clip_c=cfg.eps_clip_c)
        pg_loss = weighted_sum(pl.loss, w)
        loss = pg_loss
        metrics = {"train/pg_loss": pg_loss, "train/pg_clipfrac": weighted_sum(pl.clipped, w),
                   "train/ppo_kl": weighted_sum(pl.ppo_kl, w)}
        if out.entropy is not None:
            entropy = weighted_sum(_cat(out.entropy), w)
            metrics["train/entropy_loss"] = entropy
            loss = loss - cfg.entropy_coef * entropy
        if data.ref_logprobs is not None:
            kl = approx_kl(_cat(out.logprobs), _cat([data.ref_logprobs[i] for i in idx]),
                           kl_type=cfg.kl_loss_type)
            kl_loss = weighted_sum(kl, w)
            metrics["train/kl_loss"] = kl_loss
            loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["train/loss"] = loss
        return loss, metrics

    return sft if cfg.loss == "sft" else policy


def logprob_abs_diff(old: list[torch.Tensor], rollout: list[torch.Tensor],
                     masks: list[torch.Tensor]) -> float:
    """train/train_rollout_logprob_abs_diff of ragged per-sample tensors (padded for
    rltool.train.algo.mismatch, which defines the metric)."""
    from torch.nn.utils.rnn import pad_sequence

    from rltool.train.algo.mismatch import train_rollout_logprob_abs_diff

    if not old:
        return 0.0
    pad = [pad_sequence(list(x), batch_first=True) for x in (old, rollout, masks)]
    return float(train_rollout_logprob_abs_diff(*pad))
