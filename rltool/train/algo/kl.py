"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3).

With r = log pi(y) - log pi_ref(y) for a token y sampled from pi:
  k1 = r                      (unbiased, high variance, can be negative)
  k2 = r**2 / 2               (biased, low variance)
  k3 = exp(-r) - 1 + r        (unbiased, non-negative)
  low_var_kl = clamp(k3, -10, 10)   (slime's and verl's clipped k3)
Same names and formulas as slime's `compute_approx_kl`.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def approx_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of `kl_type`; any shape, computed in float32 (or the input's float64)."""
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.square() / 2.0
    if kl_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
        return kl.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else kl
    raise ValueError(f"unknown kl type {kl_type!r}; choose one of {', '.join(KL_TYPES)}")
