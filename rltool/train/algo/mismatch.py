"""Train/rollout mismatch correction, as pure functions of tensors.

The rollout engine samples with pi_rollout (its logprobs are in the shard); the trainer
recomputes pi_old on the same tokens at the start of the step; pi_theta is the policy being
trained. They differ by kernels, precision, and (async) by policy version. See
docs/train-mismatch.md for the options and their slime / verl names.

Shapes: every tensor argument is padded [B, T] (B samples, T response positions), aligned token for
token; `loss_mask` is [B, T] (bool, int or float, nonzero = trained token). Logprob values at
positions outside the mask are ignored (they may be anything, even inf), never read into a sum.
Element-wise helpers (`tis_weights` at token level, `icepop_weights`) accept any shape.

Weights and masks returned here are detached: the correction scales the policy-gradient term, it is
not differentiated. Weights are 0 outside the loss mask.

Log-ratios are clamped to +-20 before `exp` (exp(20) ~ 4.9e8), as verl does, so a sequence-level
product over thousands of tokens cannot overflow to inf (and then to NaN through 0 * inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltool.train.algo.kl import approx_kl

LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("none", "truncate", "clip", "icepop")
_LOG_RATIO_BOUND = 20.0


def _prepare(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
             loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi_old - log pi_rollout with 0 outside the mask, bool mask); float32 or float64."""
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != loss_mask.shape:
        raise ValueError(f"shape mismatch: old {tuple(old_logprobs.shape)}, rollout "
                         f"{tuple(rollout_logprobs.shape)}, loss_mask {tuple(loss_mask.shape)}")
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    mask = loss_mask != 0
    diff = old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype)
    return torch.where(mask, diff, torch.zeros((), dtype=dtype)), mask


def level_log_ratio(log_ratio: torch.Tensor, loss_mask: torch.Tensor, *,
                    level: str) -> torch.Tensor:
    """Per-token log-ratio [B, T] (0 outside the mask) -> the log-ratio at `level`, per token:

    token:     log r_t
    sequence:  sum_t log r_t over the sample's masked tokens (log of the product), broadcast
    geometric: mean_t log r_t over the sample's masked tokens (log of the geometric mean), broadcast
    A sample with no masked token gets 0 (ratio 1) at sequence and geometric level.
    """
    mask = loss_mask != 0
    if level == "token":
        return log_ratio
    total = torch.where(mask, log_ratio, torch.zeros((), dtype=log_ratio.dtype)).sum(-1,
                                                                                    keepdim=True)
    if level == "sequence":
        return total.expand_as(log_ratio)
    if level == "geometric":
        count = mask.sum(-1, keepdim=True).clamp_min(1).to(log_ratio.dtype)
        return (total / count).expand_as(log_ratio)
    raise ValueError(f"unknown level {level!r}; choose one of {', '.join(LEVELS)}")


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()


def importance_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     loss_mask: torch.Tensor, *, level: str = "token") -> torch.Tensor:
    """pi_old / pi_rollout at `level` (see `level_log_ratio`), [B, T], 0 outside the mask."""
    log_ratio, mask = _prepare(old_logprobs, rollout_logprobs, loss_mask)
    ratio = _ratio(level_log_ratio(log_ratio, mask, level=level))
    return torch.where(mask, ratio, torch.zeros((), dtype=ratio.dtype))


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                loss_mask: torch.Tensor, *, mode: str = "truncate", level: str = "token",
                clip_low: float = 0.0, clip_high: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling weights [B, T] (0 outside the mask).

    truncate: min(ratio, clip_high)              (slime --use-tis, --tis-clip-low 0; verl TIS)
    clip:     clamp(ratio, clip_low, clip_high)  (slime --tis-clip-low / --tis-clip; "CIS")
    """
    if mode not in ("truncate", "clip"):
        raise ValueError(f"unknown TIS mode {mode!r}; choose truncate or clip")
    _check_band(clip_low if mode == "clip" else 0.0, clip_high, what="TIS clip")
    ratio = importance_ratio(old_logprobs, rollout_logprobs, loss_mask, level=level)
    low = clip_low if mode == "clip" else 0.0
    return ratio.clamp(low, clip_high) * (loss_mask != 0)


def icepop_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                   loss_mask: torch.Tensor, *, low: float = 0.5,
                   high: float = 2.0) -> torch.Tensor:
    """ICEPOP: the token ratio where low <= ratio <= high, 0 outside the band (and the mask).

    Popped tokens still count in the loss denominator (the loss mask is unchanged), as in slime's
    `icepop_function`; use `rejection_mask` to drop tokens from the denominator instead.
    """
    _check_band(low, high, what="ICEPOP band")
    ratio = importance_ratio(old_logprobs, rollout_logprobs, loss_mask, level="token")
    inside = (ratio >= low) & (ratio <= high) & (loss_mask != 0)
    return torch.where(inside, ratio, torch.zeros((), dtype=ratio.dtype))


def rejection_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                   loss_mask: torch.Tensor, *, level: str, low: float | None = None,
                   high: float = 2.0, veto_threshold: float | None = None) -> torch.Tensor:
    """Rejection sampling: the loss mask [B, T] (float, 0/1) with rejected tokens removed.

    token:     keep a token when low <= pi_old/pi_rollout <= high
    sequence:  keep a whole sample when its product ratio is in [low, high]
    geometric: keep a whole sample when its geometric-mean ratio is in [low, high]
    veto:      also reject a whole sample when any of its tokens has ratio < veto_threshold
               (catastrophic mismatch; slime's mis_veto_threshold, verl's
               rollout_token_veto_threshold)
    `low` defaults to 1 / high. Rejected tokens leave the loss denominator (unlike ICEPOP), so
    compute loss aggregation weights from the returned mask.
    """
    low = 1.0 / high if low is None else low
    _check_band(low, high, what="rejection-sampling band")
    log_ratio, mask = _prepare(old_logprobs, rollout_logprobs, loss_mask)
    ratio = _ratio(level_log_ratio(log_ratio, mask, level=level))
    keep = mask & (ratio >= low) & (ratio <= high)
    if veto_threshold is not None:
        vetoed = (mask & (_ratio(log_ratio) < veto_threshold)).any(-1, keepdim=True)
        keep = keep & ~vetoed
    return keep.to(log_ratio.dtype)


def train_rollout_logprob_abs_diff(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                                   loss_mask: torch.Tensor) -> torch.Tensor:
    """Per sample, mean |old - rollout| over its masked tokens; then the mean over the samples
    that have at least one masked token (0 if none). Scalar tensor."""
    log_ratio, mask = _prepare(old_logprobs, rollout_logprobs, loss_mask)
    count = mask.sum(-1)
    per_sample = log_ratio.abs().sum(-1) / count.clamp_min(1).to(log_ratio.dtype)
    has_tokens = count > 0
    if not bool(has_tokens.any()):
        return torch.zeros((), dtype=log_ratio.dtype)
    return per_sample[has_tokens].mean()


def mismatch_kl(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                loss_mask: torch.Tensor, *, estimator: str = "k3") -> torch.Tensor:
    """KL(pi_rollout || pi_old) estimated on the rollout's own samples, masked token mean.

    k1 = log pi_rollout - log pi_old (slime's mismatch_kl); k3 = exp(old - rollout) - 1 -
    (old - rollout) (slime's mismatch_k3_kl, non-negative). Also k2 and low_var_kl (rltool's
    `approx_kl`). Scalar tensor, 0 when no token is masked.
    """
    _, mask = _prepare(old_logprobs, rollout_logprobs, loss_mask)
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype)
    rollout = torch.where(mask, rollout_logprobs.detach().to(dtype), zero)
    old = torch.where(mask, old_logprobs.detach().to(dtype), zero)
    per_token = approx_kl(rollout, old, kl_type=estimator)
    return torch.where(mask, per_token, zero).sum() / mask.sum().clamp_min(1)


@dataclass(frozen=True)
class Correction:
    """What the policy loss needs: PPO ratio = exp(logprobs - proximal_logprobs); per-token loss
    multiplied by `weights`; aggregation weights computed from `loss_mask`."""

    proximal_logprobs: torch.Tensor  # [B, T] the "old" policy the PPO clip is anchored to
    weights: torch.Tensor  # [B, T] behaviour importance weights (detached), 0 outside loss_mask
    loss_mask: torch.Tensor  # [B, T] float 0/1: the input mask after rejection sampling
    metrics: dict[str, torch.Tensor]  # slime names, scalar tensors (masked means over this batch)


def rollout_correction(rollout_logprobs: torch.Tensor, *, loss_mask: torch.Tensor,
                       old_logprobs: torch.Tensor | None = None, bypass: bool = False,
                       tis_mode: str = "none", tis_level: str = "token",
                       tis_clip_low: float = 0.0, tis_clip_high: float = 2.0,
                       rs_level: str = "none", rs_low: float | None = None,
                       rs_high: float = 2.0,
                       rs_veto_threshold: float | None = None) -> Correction:
    """Choose the policies and corrections for one batch ([B, T] tensors, module docstring).

    bypass=False (default): proximal = recomputed old logprobs. With tis_mode or rs_level set this
      is decoupled PPO: three policies, the PPO clip anchored at pi_old, the behaviour correction
      pi_old/pi_rollout applied as weights (tis_mode truncate | clip | icepop, icepop using the band
      [tis_clip_low, tis_clip_high]) and/or as a rejection mask (rs_level token | sequence |
      geometric). With both off it is standard two-policy PPO; mismatch metrics are still reported.
    bypass=True: proximal = rollout logprobs (no recompute needed); weights are 1. TIS and RS need
      pi_old and are refused. `old_logprobs`, when given anyway, only feeds the metrics.

    Metrics (masked means over this batch; combine micro-batches weighted by masked tokens, or by
    samples for the abs diff): train/tis (mean pi_old/pi_rollout before truncation, slime's
    meaning), train/tis_weight (mean applied weight), train/tis_clipfrac (tokens whose weight was
    truncated or popped), train/rs_reject_frac (masked tokens removed by rejection sampling),
    train/train_rollout_logprob_abs_diff, train/mismatch_kl (k1) and train/mismatch_k3_kl (k3).
    """
    if tis_mode not in TIS_MODES:
        raise ValueError(f"unknown TIS mode {tis_mode!r}; choose one of {', '.join(TIS_MODES)}")
    if rs_level != "none" and rs_level not in LEVELS:
        raise ValueError(f"unknown rejection-sampling level {rs_level!r}; choose none or one of "
                         f"{', '.join(LEVELS)}")
    corrected = tis_mode != "none" or rs_level != "none"
    if bypass and corrected:
        raise ValueError("TIS/ICEPOP/rejection sampling compare recomputed old logprobs with "
                         "rollout logprobs; bypass mode skips the recompute: drop bypass or the "
                         "correction")
    if old_logprobs is None and not bypass:
        raise ValueError("old_logprobs are required unless bypass=True")

    mask = (loss_mask != 0)
    dtype = torch.promote_types(rollout_logprobs.dtype, torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    if old_logprobs is not None:
        metrics["train/train_rollout_logprob_abs_diff"] = train_rollout_logprob_abs_diff(
            old_logprobs, rollout_logprobs, loss_mask)
        metrics["train/mismatch_kl"] = mismatch_kl(old_logprobs, rollout_logprobs, loss_mask,
                                                   estimator="k1")
        metrics["train/mismatch_k3_kl"] = mismatch_kl(old_logprobs, rollout_logprobs, loss_mask,
                                                      estimator="k3")
    if bypass:
        return Correction(proximal_logprobs=rollout_logprobs.detach(),
                          weights=mask.to(dtype), loss_mask=mask.to(dtype), metrics=metrics)

    assert old_logprobs is not None
    new_mask = mask.to(dtype)
    if rs_level != "none":
        new_mask = rejection_mask(old_logprobs, rollout_logprobs, loss_mask, level=rs_level,
                                  low=rs_low, high=rs_high, veto_threshold=rs_veto_threshold)
        metrics["train/rs_reject_frac"] = _masked_mean(1.0 - new_mask, mask)
    if tis_mode == "none":
        weights = new_mask.clone()
    else:
        level = "token" if tis_mode == "icepop" else tis_level
        raw = importance_ratio(old_logprobs, rollout_logprobs, loss_mask, level=level)
        if tis_mode == "icepop":
            weights = icepop_weights(old_logprobs, rollout_logprobs, loss_mask, low=tis_clip_low,
                                     high=tis_clip_high)
        else:
            weights = tis_weights(old_logprobs, rollout_logprobs, loss_mask, mode=tis_mode,
                                  level=tis_level, clip_low=tis_clip_low, clip_high=tis_clip_high)
        weights = weights * new_mask
        kept = new_mask != 0
        metrics["train/tis"] = _masked_mean(raw, kept)
        metrics["train/tis_weight"] = _masked_mean(weights, kept)
        metrics["train/tis_clipfrac"] = _masked_mean((weights != raw).to(dtype), kept)
    return Correction(proximal_logprobs=old_logprobs.detach(), weights=weights,
                      loss_mask=new_mask, metrics=metrics)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=values.dtype)
    return torch.where(mask, values, zero).sum() / mask.sum().clamp_min(1)


def _check_band(low: float, high: float, *, what: str) -> None:
    if not 0.0 <= low < high:
        raise ValueError(f"{what} needs 0 <= low < high, got low={low}, high={high}")
