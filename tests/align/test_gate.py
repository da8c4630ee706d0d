"""The align gate as a library: numbers vs float64 loop references, inputs, exact alignment."""

from __future__ import annotations

import json
import math
import random

import pytest

from rltool.align.config import AlignGateConfig
from rltool.align.gate import (HISTOGRAM_EDGES, SampleRef, check, compare, declared_version,
                               histogram, load_inputs, recompute_precision, run)
from rltool.errors import BadInputError, CheckpointError, ShardSchemaError, TokenizerMismatchError
from tests.helpers.weights import PERTURBED_TENSOR, copy_weights


def _samples(seed: int = 0) -> tuple[list[SampleRef], list[list[float]]]:
    rng = random.Random(seed)
    samples, train = [], []
    for i in range(6):
        n = rng.randint(1, 9)
        rollout = [-rng.random() * 3 for _ in range(n)]
        mask = [int(rng.random() > 0.3) for _ in range(n)]
        if i == 2:
            mask = [0] * n  # no masked token: excluded from the mean
        samples.append(SampleRef(uid=f"u{i}", shard="s", row=i, token_ids=list(range(3 + n)),
                                 response_start=3, rollout_logprobs=rollout, loss_mask=mask))
        train.append([r + rng.choice([0.0, 0.0, rng.random() * 10 ** -rng.randint(1, 9)])
                      for r in rollout])
    return samples, train


def test_compare_matches_float64_loop_reference():
    samples, train = _samples()
    got = compare(samples, train, tol=1e-3, num_worst=3)
    per_sample, tokens = {}, []
    for s, lp in zip(samples, train):
        diffs = [abs(a - b) for a, b, m in zip(lp, s.rollout_logprobs, s.loss_mask) if m]
        tokens += diffs
        if diffs:
            per_sample[s.uid] = sum(diffs) / len(diffs)
    want = sum(per_sample.values()) / len(per_sample)
    assert got["metric"] == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got["max_abs_diff"] == pytest.approx(max(tokens), rel=1e-12)
    assert got["num_masked_tokens"] == len(tokens)
    assert got["passed"] == (want <= 1e-3)
    ranked = sorted(per_sample.items(), key=lambda kv: -kv[1])
    assert [w["uid"] for w in got["worst_samples"]] == [u for u, _ in ranked[:3]]
    assert got["worst_positions"][0]["abs_diff"] == pytest.approx(max(tokens), rel=1e-12)
    top = got["worst_positions"][0]
    s = samples[top["sample"]]
    assert s.loss_mask[top["position"]] == 1
    assert top["rollout_logprob"] == pytest.approx(s.rollout_logprobs[top["position"]])


def test_compare_all_unmasked_is_zero_and_passes_tol_zero():
    s = SampleRef(uid="a", shard="s", row=0, token_ids=[1, 2, 3], response_start=1,
                  rollout_logprobs=[-1.0, -2.0], loss_mask=[0, 0])
    got = compare([s], [[-5.0, -9.0]], tol=0.0)
    assert got["metric"] == 0.0 and got["passed"] and got["num_masked_tokens"] == 0


def test_compare_nan_fails_the_gate():
    s = SampleRef(uid="a", shard="s", row=0, token_ids=[1, 2, 3], response_start=1,
                  rollout_logprobs=[-1.0, -2.0], loss_mask=[1, 1])
    got = compare([s], [[float("nan"), -2.0]], tol=1.0)
    assert math.isnan(got["metric"]) and not got["passed"]


def test_histogram_bins_by_decade():
    values = [0.0, 0.0, 5e-10, 1e-9, 3e-7, 0.5, 2.0]
    bins = histogram(values)
    assert len(bins) == len(HISTOGRAM_EDGES)
    counts = {(b["low"], b["high"]): b["count"] for b in bins if b["count"]}
    assert counts == {(0.0, 0.0): 2, (0.0, 1e-9): 1, (1e-9, 1e-8): 1, (1e-7, 1e-6): 1,
                      (0.1, 1.0): 1, (1.0, math.inf): 1}


def test_declared_version(tmp_path):
    (tmp_path / "weight_v000012").mkdir()
    assert declared_version(tmp_path / "weight_v000012") == 12
    (tmp_path / "plain").mkdir()
    assert declared_version(tmp_path / "plain") is None
    (tmp_path / "weight_v000012" / "rltool_version.json").write_text(json.dumps({"version": 3}))
    assert declared_version(tmp_path / "weight_v000012") == 3


def test_exact_alignment_deterministic_fp32(aligned_shard, tiny_model_dir):
    """Deterministic engine (fp32) vs deterministic torch trainer (fp32): exactly 0."""
    result = check([aligned_shard], tiny_model_dir, tol=0.0, deterministic=True)
    assert result.passed and result.metric == 0.0 and result.max_abs_diff == 0.0
    assert result.num_samples == 8 and result.num_masked_tokens > 0
    assert result.histogram[0]["count"] == result.num_masked_tokens
    assert result.weights_version == 0 and result.shard_versions == [0]


def test_device_auto_follows_the_engines_recorded_in_the_shard(aligned_shard, tiny_model_dir):
    """The CPU engine records cpu/fp32 in the shard; --device auto recomputes there, exactly."""
    assert load_inputs([aligned_shard], tiny_model_dir).engine_precisions == [("cpu", "fp32")]
    result = run(AlignGateConfig(rollouts=[str(aligned_shard)], weights=str(tiny_model_dir),
                                 tol=0.0, deterministic=True, device="auto", dtype="bf16"))
    # An explicit --dtype wins over the record: bf16 recompute against fp32 rollouts is not 0.
    assert result.config["device"] == "cpu" and result.config["dtype"] == "bf16"
    assert result.metric > 0.0
    result = run(AlignGateConfig(rollouts=[str(aligned_shard)], weights=str(tiny_model_dir),
                                 tol=0.0, deterministic=True, device="auto"))
    assert result.config["device"] == "cpu" and result.config["dtype"] == "fp32"
    assert result.passed and result.max_abs_diff == 0.0


def test_recompute_precision_rules():
    import torch

    auto = AlignGateConfig(rollouts=["s"], weights="w", device="auto")
    assert recompute_precision(auto, [("cpu", "bf16")]) == ("cpu", "bf16")
    assert recompute_precision(auto, []) == ("auto", "fp32")
    explicit = AlignGateConfig(rollouts=["s"], weights="w", device="auto", dtype="fp32")
    assert recompute_precision(explicit, [("cpu", "bf16")]) == ("cpu", "fp32")
    fixed = AlignGateConfig(rollouts=["s"], weights="w", device="cpu")
    assert recompute_precision(fixed, [("cuda", "bf16")]) == ("cpu", "fp32")
    with pytest.raises(BadInputError, match="different precisions"):
        recompute_precision(auto, [("cpu", "fp32"), ("cuda", "bf16")])
    if torch.cuda.is_available():
        assert recompute_precision(auto, [("cuda", "bf16")]) == ("cuda", "bf16")
    else:
        with pytest.raises(BadInputError, match="no GPU"):
            recompute_precision(auto, [("cuda", "bf16")])


def test_perturbed_weights_fail(aligned_shard, perturbed_weights):
    result = check([aligned_shard], perturbed_weights, tol=1e-6, deterministic=True)
    assert not result.passed and result.metric > 1e-6
    assert result.exit_code == 1


def test_layerwise_names_the_perturbed_layer(aligned_shard, perturbed_weights, tiny_model_dir,
                                             align_engine):
    from rltool.align.layerwise import compare_layers

    inputs = load_inputs([aligned_shard], perturbed_weights)
    out = compare_layers(inputs.samples[:1], model_dir=perturbed_weights,
                         engine_url=align_engine.url, tol=1e-6)
    names = [layer["name"] for layer in out["layers"]]
    assert names == ["embed_tokens", "layers.0", "layers.1", "lm_head"]
    assert PERTURBED_TENSOR.startswith("model.layers.1.")
    assert out["first_layer_above_tol"] == "layers.1"
    assert out["layers"][0]["max_abs_diff"] == 0.0 and out["layers"][1]["max_abs_diff"] == 0.0
    same = compare_layers(inputs.samples[:1], model_dir=tiny_model_dir,
                          engine_url=align_engine.url, tol=0.0)
    assert same["first_layer_above_tol"] is None
    assert all(layer["max_abs_diff"] == 0.0 for layer in same["layers"])


def test_lm_head_perturbation_is_named_lm_head(aligned_shard, tiny_model_dir, align_engine,
                                               tmp_path):
    from safetensors.torch import load_file, save_file

    from rltool.align.layerwise import compare_layers

    dst = copy_weights(tiny_model_dir, tmp_path / "w")
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 1.1
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    inputs = load_inputs([aligned_shard], dst)
    out = compare_layers(inputs.samples[:1], model_dir=dst, engine_url=align_engine.url, tol=1e-6)
    assert out["first_layer_above_tol"] == "lm_head"


def test_bad_inputs(aligned_shard, tiny_model_dir, tmp_path):
    with pytest.raises(ShardSchemaError):
        load_inputs([tmp_path / "missing"], tiny_model_dir)
    with pytest.raises(CheckpointError):
        load_inputs([aligned_shard], tmp_path / "no-weights")
    other_tok = copy_weights(tiny_model_dir, tmp_path / "tok")
    (other_tok / "chat_template.jinja").write_text(
        (other_tok / "chat_template.jinja").read_text() + "\n")
    with pytest.raises(TokenizerMismatchError):
        load_inputs([aligned_shard], other_tok)
    v3 = copy_weights(tiny_model_dir, tmp_path / "weight_v000003", version=3)
    with pytest.raises(BadInputError, match="--allow-version-mismatch"):
        load_inputs([aligned_shard], v3)
    inputs = load_inputs([aligned_shard], v3, allow_version_mismatch=True)
    assert inputs.weights_version == 3 and inputs.shard_versions == [0]


def test_exact_alignment_with_temperature_and_filters(align_engine, tiny_model_dir, tmp_path):
    """Temperature scaling and top-p/top-k filtering keep exactness (logprobs are of the scaled,
    unfiltered distribution on both sides)."""
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.rollout.stage import RolloutConfig, run

    prompts = write_prompts(make_rows("reverse", num=2, seed=4), tmp_path / "prompts.jsonl")
    out = tmp_path / "shard"
    run(RolloutConfig(engines=[align_engine.url], prompts=str(prompts), out=str(out),
                      n_samples_per_prompt=2, max_response_len=10, reward="reverse",
                      rollout_batch_size=2, seed=2, temperature=0.7, top_p=0.9, top_k=5,
                      quiet=True))
    result = check([out], tiny_model_dir, tol=0.0, deterministic=True)
    assert result.metric == 0.0 and result.max_abs_diff == 0.0 and result.num_masked_tokens > 0


@pytest.mark.slow
def test_megatron_trainer_aligns_with_the_engine_fp32(aligned_shard, tiny_model_dir):
    """The megatron trainer (TP1, packed micro-batches, SDPA core attention) recomputes the
    deterministic engine's fp32 logprobs within 1e-6 (not bit-exact: another model
    implementation sums in another order)."""
    result = check([aligned_shard], tiny_model_dir, tol=1e-6, backend="megatron")
    assert result.passed and result.metric < 1e-6, result.metric
    assert result.num_samples == 8 and result.num_masked_tokens > 0
