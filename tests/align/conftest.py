"""Fixtures for the align-gate tests: a deterministic engine with debug endpoints, a real rollout
shard it produced, and weight directories derived from the served ones (perturbed, re-versioned,
other tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.weights import PERTURBED_TENSOR, copy_weights


@pytest.fixture(scope="session")
def align_engine(tiny_model_dir, tmp_path_factory):
    """`rltool serve --deterministic --enable-debug-endpoints` over tiny_model_dir (version 0)."""
    from rltool.rollout.launch import start_engine

    log_path = tmp_path_factory.mktemp("engine-logs") / "align.log"
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir), "--deterministic",
                         "--enable-debug-endpoints", "--num-threads", "1"],
                        log_path=log_path, ready_timeout_s=120.0)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def aligned_shard(align_engine, tmp_path_factory) -> Path:
    """A shard written by the real rollout stage through the deterministic engine."""
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.rollout.stage import RolloutConfig, run

    root = tmp_path_factory.mktemp("align-run")
    prompts = write_prompts(make_rows("reverse", num=4, seed=3), root / "prompts.jsonl")
    out = root / "rollouts" / "step-000000"
    run(RolloutConfig(engines=[align_engine.url], prompts=str(prompts), out=str(out),
                      n_samples_per_prompt=2, max_response_len=12, reward="reverse",
                      rollout_batch_size=4, seed=7, temperature=1.0, quiet=True))
    return out


@pytest.fixture(scope="session")
def perturbed_weights(tiny_model_dir, tmp_path_factory) -> Path:
    """tiny_model_dir with one tensor (PERTURBED_TENSOR) changed, same version and tokenizer."""
    from safetensors.torch import load_file, save_file

    dst = copy_weights(tiny_model_dir, tmp_path_factory.mktemp("perturbed") / "weights")
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    tensors[PERTURBED_TENSOR] = tensors[PERTURBED_TENSOR] + 0.05
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dst
