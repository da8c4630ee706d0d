"""LoRA on `--backend megatron` on CUDA: the CPU checks of tests/train/test_megatron_lora.py for
fp32 on one GPU (the forward against PeftModel on the CPU within 1e-4: CUDA's SDPA and GEMMs
round differently from the CPU's), with full recompute against without, TP2 against TP1 on two
GPUs, and bf16 with the distributed optimizer (adapters and their masters fp32, only they train,
resume bit-identical).

Every test skips only when too few CUDA GPUs are visible (the CI machines have none).
"""

from __future__ import annotations

import pytest
import torch

from tests.train.test_megatron_lora import (assert_checkpoint_round_trip,
                                            assert_forward_equals_peft,
                                            assert_only_adapters_train, assert_same_training,
                                            run_ranks)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="module")
def tp1(model, tmp_path_factory):
    return run_ranks(model, tmp_path_factory.mktemp("tp1-cuda"), {"device": "cuda"}, nproc=1)


def test_fp32_on_one_gpu(tp1, model, tmp_path):
    assert_only_adapters_train(tp1)
    assert_checkpoint_round_trip(tp1)
    assert_forward_equals_peft(tp1, model, tmp_path, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_equals_tp1_on_two_gpus(tp1, model, tmp_path):
    tp2 = run_ranks(model, tmp_path, {"device": "cuda", "tensor_model_parallel_size": 2},
                    nproc=2)
    assert_same_training(tp1, tp2, atol=1e-4)
    assert_checkpoint_round_trip(tp2)


def test_bf16_with_the_distributed_optimizer(model, tmp_path):
    run = run_ranks(model, tmp_path, {"device": "cuda", "dtype": "bf16",
                                      "use_distributed_optimizer": True}, nproc=1)
    assert_only_adapters_train(run)
    assert_checkpoint_round_trip(run)
    record = run[0]
    on, off = (torch.tensor(sum(record[f"logprobs_{k}"], [])) for k in ("on", "off"))
    assert torch.isfinite(on).all() and (on - off).abs().max() > 1e-3


def test_full_recompute_trains_the_same_adapters(tp1, model, tmp_path):
    """Megatron's full-layer recompute reruns the adapters' forward in backward (on the CPU it
    cannot run: megatron's checkpointing reads the CUDA RNG state)."""
    run = run_ranks(model, tmp_path, {"device": "cuda", "recompute": "full"}, nproc=1)
    assert_same_training(tp1, run, atol=1e-5)
    assert_only_adapters_train(run)
