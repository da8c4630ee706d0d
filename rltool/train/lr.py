"""The learning-rate schedule: linear warmup, then constant or cosine decay to `min_lr`.

A pure function of the optimizer step, so the schedule's whole state is that step (saved in the
trainer checkpoint) and resuming reproduces it exactly.
"""

from __future__ import annotations

import math
from typing import Any


def lr_at(step: int, *, lr: float, min_lr: float = 0.0, warmup_steps: int = 0,
          decay_style: str = "constant", decay_steps: int | None = None) -> float:
    """LR for optimizer step `step` (0-based: the first step uses lr_at(0))."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay_style == "constant":
        return lr
    if decay_style == "cosine":
        span = max(decay_steps or 1, 1)
        progress = min(max(step - warmup_steps, 0) / span, 1.0)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr decay style {decay_style!r}; choose constant or cosine")


def lr_of(options: Any, step: int) -> float:
    """`lr_at` with the schedule of a BackendConfig (lr, min_lr, lr_warmup_steps, ...)."""
    return lr_at(step, lr=options.lr, min_lr=options.min_lr, warmup_steps=options.lr_warmup_steps,
                 decay_style=options.lr_decay_style, decay_steps=options.lr_decay_steps)
