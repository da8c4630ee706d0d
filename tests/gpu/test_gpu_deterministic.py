"""Deterministic mode of the paged engine on a CUDA GPU: repeatable run to run and batch-invariant
(a seeded request alone or among 15 others gives the same tokens and logprobs, CUDA graphs on),
and the align gate against the torch trainer on the same GPU at exactly 0 in fp32 and bf16.

Every test skips only when `torch.cuda.is_available()` is false (the CI machines have none)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engines import generate_deterministic

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TARGET = [5, 9, 3, 17, 22, 8, 30, 11, 4, 2, 19, 7, 13, 40, 41, 12, 6, 28, 33, 21]
OTHERS = [[(7 * i + j) % 50 + 3 for j in range(3 + 5 * i)] for i in range(15)]


def generate(model_dir, dtype: str, prompts: list[list[int]]) -> tuple[list[int], list[float]]:
    """The first prompt's sampled tokens and logprobs, all prompts submitted together."""
    first, runner, sched = generate_deterministic(
        model_dir, prompts, device="cuda", dtype=dtype, max_new_tokens=48,
        max_total_tokens=8192, max_prefill_tokens=64, chunked_prefill_size=16, timeout_s=300)
    assert runner.graphs and sched.max_decode_batch == len(prompts)
    return first


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_batch_invariant_and_repeatable(arch, dtype, tiny_model_factory):
    model_dir = tiny_model_factory(arch, 0)
    alone = generate(model_dir, dtype, [TARGET])
    assert generate(model_dir, dtype, [TARGET]) == alone  # run to run
    assert generate(model_dir, dtype, [TARGET] + OTHERS) == alone  # among 15 others
    assert len(alone[0]) == 48


def served_rollout_gate(model_dir, dtype: str, tmp_path, *, max_response_len: int,
                        disable_radix_cache: bool = False, served: bool = True):
    """`rltool serve --device cuda --deterministic` on `model_dir` (served=False: the same engine
    in this process, rltool.engine.inprocess, without the HTTP hop) samples a shard of 4 x 4
    `reverse` prompts through the rollout stage; `align-gate --deterministic --device auto --tol
    0` recomputes it with the torch trainer on the same GPU: its result."""
    from rltool.align.config import AlignGateConfig
    from rltool.align.gate import run as gate
    from rltool.data.shards import open_shard
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.engine.config import ServeConfig
    from rltool.engine.inprocess import InProcessEngine
    from rltool.rollout.launch import start_engine
    from rltool.rollout.stage import RolloutConfig, run as rollout

    log_path = tmp_path / "engine.log"
    if served:
        engine = start_engine(["--engine", "builtin", "--model", str(model_dir), "--device",
                               "cuda", "--dtype", dtype, "--deterministic",
                               *(["--disable-radix-cache"] if disable_radix_cache else [])],
                              log_path=log_path, ready_timeout_s=300.0)
        clients = None
    else:
        engine = InProcessEngine(ServeConfig(model=model_dir, device="cuda", dtype=dtype,
                                             deterministic=True,
                                             disable_radix_cache=disable_radix_cache))
        clients = {engine.url: engine}
    try:
        prompts = write_prompts(make_rows("reverse", num=4, seed=3), tmp_path / "prompts.jsonl")
        out = tmp_path / "rollouts" / "step-000000"
        rollout(RolloutConfig(engines=[engine.url], prompts=str(prompts), out=str(out),
                              n_samples_per_prompt=4, max_response_len=max_response_len,
                              reward="reverse", rollout_batch_size=4, seed=7, temperature=1.0,
                              quiet=True), clients=clients)
    finally:
        engine.stop()
    failed = [(row["finish_reason"], row["metadata"]) for batch in open_shard(out).iter_batches(
        columns=["status", "finish_reason", "metadata"]) for row in batch.to_pylist()
        if row["status"] == "failed"]
    log_tail = log_path.read_text(errors="replace")[-3000:] if served else ""
    assert not failed, f"{len(failed)} failed samples, first {failed[0]}; engine log:\n{log_tail}"
    return gate(AlignGateConfig(rollouts=[str(out)], weights=str(model_dir), tol=0.0,
                                deterministic=True, device="auto"))


@pytest.mark.parametrize(("arch", "dtype", "served"),
                         [("qwen2", "fp32", True), ("qwen3", "bf16", False)],
                         ids=["qwen2-fp32-served", "qwen3-bf16-inprocess"])
def test_align_gate_is_exactly_zero_on_the_gpu(arch, dtype, served, tiny_model_factory,
                                               tmp_path):
    """`rltool serve --device cuda --deterministic` samples a shard through the rollout stage;
    `align-gate --device auto --deterministic` recomputes with the torch trainer on the same GPU
    in the recorded dtype: every token's logprob equal. The second case drives the same engine in
    this process (the served path is the first's; a served start costs ~20 s of the suite)."""
    result = served_rollout_gate(tiny_model_factory(arch, 0), dtype, tmp_path,
                                 max_response_len=24, served=served)
    assert result.config["device"] == "cuda" and result.config["dtype"] == dtype
    assert result.num_masked_tokens > 0
    assert result.max_abs_diff == 0.0 and result.passed, result.worst_positions
