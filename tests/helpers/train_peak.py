"""The measured peak of a train step on one GPU, for the tests that check a memory plan
(rltool.train.memfit) against it: tests/train/test_memplan_gpu.py, test_lora_gpu.py and
test_megatron_lora_memplan_gpu.py."""

from __future__ import annotations

from pathlib import Path

import torch

from rltool.train.backend import MicroBatch, build_backend
from rltool.train.config import TrainConfig
from rltool.train.launch import process_group_scope


def measured_step_peak(model_dir: Path, cfg: TrainConfig) -> int:
    """`torch.cuda.max_memory_allocated` over the second of two optimizer steps (the first
    allocates Adam's state) of the backend `cfg` names, each of two micro-batches of
    `cfg.max_tokens_per_microbatch` random tokens in four sequences: the second micro-batch's
    activations meet the gradients the first left, as in every step of more than one (the torch
    backend frees its gradients after each step, so one micro-batch would never hold both)."""
    tokens = cfg.max_tokens_per_microbatch
    gen = torch.Generator().manual_seed(0)
    quarter = tokens // 4
    batch = MicroBatch(list(range(4)), torch.randint(0, 151000, (4, quarter), generator=gen)
                       .tolist(), [1] * 4)

    def loss_fn(out, mb):
        return -sum(lp.sum() for lp in out.logprobs) / tokens, {}

    with process_group_scope():
        backend = build_backend(model_dir, options=cfg)
        backend.train_step([batch, batch], loss_fn, temperature=1.0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        backend.train_step([batch, batch], loss_fn, temperature=1.0)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del backend
    return peak
