"""The train stage in one process: learning direction, resume, logprob layout, publish, SFT, KL."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rltool.data.shards import open_shard
from rltool.errors import ConfigError
from rltool.logprobs import sequence_logprobs
from rltool.train import run
from rltool.train.config import TrainConfig
from rltool.train.stage import recompute_logprobs
from tests.helpers.shards import REWARDS, make_shard, shard_rows

COMMON = dict(lr=3e-3, max_tokens_per_microbatch=40, global_batch_size=6)


def _rows(shard):
    return open_shard(shard).rows()


def test_policy_gradient_raises_positive_and_lowers_negative(tiny_model_dir, train_shard,
                                                             tmp_path):
    before = recompute_logprobs(tiny_model_dir, [train_shard], max_tokens_per_microbatch=40,
                                deterministic=True)
    result = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir),
                             publish=str(tmp_path / "weights"), num_epochs=2, **COMMON))
    assert result.policy_version == 4 and result.optimizer_steps == 4
    after = recompute_logprobs(result.published, [train_shard], max_tokens_per_microbatch=40,
                               deterministic=True)
    rows = _rows(train_shard)
    rewards = [r for group in REWARDS for r in group]
    moved = 0
    for row, reward, b, a in zip(rows, rewards, before, after):
        group = [x for g in REWARDS for x in g if g == REWARDS[row["group_id"]]]
        advantage = reward - sum(group) / len(group)
        delta = sum((y - x) * m for x, y, m in zip(b, a, row["loss_mask"]))
        if advantage != 0:
            moved += (delta > 0) == (advantage > 0)
    assert moved == sum(1 for g in REWARDS for r in g if r != sum(g) / len(g))


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_resume_is_bit_identical(tiny_model_dir, train_shard, tmp_path, estimator):
    cfg = dict(rollouts=[str(train_shard)], num_epochs=2, save_interval=1, entropy_coef=0.01,
               lr_warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=4, shuffle=True,
               advantage_estimator=estimator, **COMMON)
    full = run(TrainConfig(load=str(tiny_model_dir), save=str(tmp_path / "a"), **cfg))
    assert full.metrics[0]["train/ppo_kl"] == 0.0  # old logprobs use the training schedule
    assert full.metrics[0]["train/pg_clipfrac"] == 0.0
    resumed = run(TrainConfig(load=str(tmp_path / "a" / "step-000002"), save=str(tmp_path / "b"),
                              **cfg))
    assert resumed.optimizer_steps == 2 and resumed.policy_version == 4
    files = ["model/model.safetensors", "optimizer.safetensors", "data.safetensors"]
    if estimator == "ppo":
        files.append("value_head.safetensors")
    for name in files:
        a = load_file(tmp_path / "a" / "step-000004" / name)
        b = load_file(tmp_path / "b" / "step-000004" / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    for x, y in zip(full.metrics[2:], resumed.metrics):
        assert {k: v for k, v in x.items() if not k.startswith(("perf/", "time"))} == \
               {k: v for k, v in y.items() if not k.startswith(("perf/", "time"))}
    state = json.loads((tmp_path / "b" / "step-000004" / "trainer_state.json").read_text())
    assert state["policy_version"] == 4 and state["data"]["next_step"] == 4
    assert state["backend"]["optimizer_steps"] == 4
    # another batch order mid-epoch would train some samples twice and others never
    with pytest.raises(ConfigError, match="with --seed 0; resume with the same --seed"):
        run(TrainConfig(load=str(tmp_path / "a" / "step-000002"), save=str(tmp_path / "c"),
                        **{**cfg, "seed": 1}))


def test_deterministic_recompute_equals_sequence_logprobs(tiny_model_dir, train_shard):
    from transformers import AutoModelForCausalLM

    # The trainer runs on the GPU when there is one; compare with the reference on that device.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = model.to(device).eval()
    rows = _rows(train_shard)
    exact = recompute_logprobs(tiny_model_dir, [train_shard], max_tokens_per_microbatch=40,
                               deterministic=True)
    padded = recompute_logprobs(tiny_model_dir, [train_shard], max_tokens_per_microbatch=40,
                                deterministic=False)
    for row, got, pad in zip(rows, exact, padded):
        ids = row["prompt_token_ids"] + row["response_token_ids"]
        want = sequence_logprobs(model, ids, response_start=len(row["prompt_token_ids"]),
                                 temperature=0.8)
        assert torch.equal(torch.tensor(got), want.cpu())  # bit for bit
        assert pad == pytest.approx(want.tolist(), abs=1e-5)


def test_published_version_is_a_hf_checkpoint(tiny_model_dir, train_shard, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir),
                             save=str(tmp_path / "ckpt"), publish=str(tmp_path / "weights"),
                             num_steps=1, **COMMON))
    published = tmp_path / "weights" / "weight_v000001"
    assert result.published == str(published)
    assert json.loads((published / "rltool_version.json").read_text()) == {"version": 1,
                                                                           "precision": "fp32"}
    model = AutoModelForCausalLM.from_pretrained(str(published))
    AutoTokenizer.from_pretrained(str(published))
    saved = load_file(tmp_path / "ckpt" / "step-000001" / "model" / "model.safetensors")
    assert all(torch.equal(p, saved[n]) for n, p in model.state_dict().items())
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert not torch.equal(saved["lm_head.weight"], initial["lm_head.weight"])
    # --load of a --save directory continues from its newest checkpoint: version 1 -> 2.
    again = run(TrainConfig(rollouts=[str(train_shard)], load=str(tmp_path / "ckpt"),
                            publish=str(tmp_path / "weights"), num_steps=1, **COMMON))
    assert again.policy_version == 2 and (tmp_path / "weights" / "weight_v000002").is_dir()


def test_reference_kl_is_zero_against_itself(tiny_model_dir, train_shard, tmp_path):
    result = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir),
                             ref=str(tiny_model_dir), kl_loss_coef=0.1, kl_coef=0.05,
                             advantage_estimator="reinforce_plus_plus_baseline",
                             loss_aggregation="sequence", metrics=str(tmp_path / "train.jsonl"),
                             num_steps=2, **COMMON))
    first, second = result.metrics
    assert first["train/kl_loss"] == 0.0 and second["train/kl_loss"] > 0.0
    lines = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [x["policy_version"] for x in lines] == [1, 2]
    for name in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/pg_clipfrac",
                 "train/ppo_kl", "train/kl_loss", "train/grad_norm", "train/lr",
                 "train/train_rollout_logprob_abs_diff", "perf/train_time",
                 "perf/ref_log_probs_time"):
        assert name in lines[0], name


def test_reinforce_plus_plus_trains(tiny_model_dir, train_shard):
    result = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir), num_steps=2,
                             advantage_estimator="reinforce_plus_plus", eps_clip_c=3.0,
                             eps_clip_high=0.28, loss_aggregation="group", **COMMON))
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in result.metrics)


# Per-sample policy ratio pi_theta / pi_old the rollout logprobs are built to give, chosen so every
# branch of the loss is taken (advantage signs follow REWARDS): s0 1.25 with A > 0 is inside the
# high clip 1.28 but outside a symmetric 1.2; s3 and s9 are clipped high; s1 and s10 (A < 0, ratio
# > c = 3) are capped by the dual clip; s4 (A < 0, ratio 2) is not; s2 and s11 are clipped low.
E2E_RATIOS = [1.25, 4.5, 0.5, 1.6, 2.0, 0.9, 0.5, 1.1, 1.0, 3.5, 6.0, 0.3]


def _float64_logprobs(model_dir, rows, *, temperature: float) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).double().eval()
    out = []
    with torch.no_grad():
        for row in rows:
            ids = row["prompt_token_ids"] + row["response_token_ids"]
            logits = model(input_ids=torch.tensor([ids])).logits[0].tolist()
            start = len(row["prompt_token_ids"])
            lps = []
            for pos, token in enumerate(row["response_token_ids"]):
                scaled = [x / temperature for x in logits[start + pos - 1]]
                top = max(scaled)
                log_z = top + math.log(sum(math.exp(x - top) for x in scaled))
                lps.append(scaled[token] - log_z)
            out.append(lps)
    return out


def test_gspo_dual_clip_clip_high_group_aggregation_end_to_end(tiny_model_dir, tmp_path):
    """One train step (GSPO, eps_clip 0.2 / high 0.28, dual clip c = 3, group aggregation, the
    rollout logprobs as old ones) reports the loss, clip fraction and KL that a float64 reference
    written here with plain loops computes from the model's logprobs."""
    temperature, eps, high, c = 0.8, 0.2, 0.28, 3.0
    rows = shard_rows(REWARDS, seed=11)
    new = _float64_logprobs(tiny_model_dir, rows, temperature=temperature)
    for row, lps, ratio in zip(rows, new, E2E_RATIOS):
        row["rollout_logprobs"] = [lp - math.log(ratio) if m else 0.0
                                   for lp, m in zip(lps, row["loss_mask"])]
    shard = make_shard(tmp_path / "rollouts" / "step-000001", tiny_model_dir, rows,
                       temperature=temperature)

    # Reference: GRPO advantages (unbiased group std), GSPO sequence ratio, clipped surrogate.
    groups = [row["group_id"] for row in rows]
    rewards = [row["reward"] for row in rows]
    adv = []
    for g, r in zip(groups, rewards):
        members = [x for h, x in zip(groups, rewards) if h == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        adv.append((r - mean) / (std + 1e-6))
    group_tokens = {g: sum(sum(row["loss_mask"]) for row in rows if row["group_id"] == g)
                    for g in set(groups)}
    want = {"train/pg_loss": 0.0, "train/pg_clipfrac": 0.0, "train/ppo_kl": 0.0}
    capped = 0
    for row, lps, a in zip(rows, new, adv):
        mask = row["loss_mask"]
        diffs = [lp - o for lp, o, m in zip(lps, row["rollout_logprobs"], mask) if m]
        log_ratio = sum(diffs) / len(diffs)
        ratio = math.exp(log_ratio)
        unclipped = -ratio * a
        clipped = -min(max(ratio, 1 - eps), 1 + high) * a
        loss = max(unclipped, clipped)
        if a < 0 and -c * a < loss:
            loss, capped = -c * a, capped + 1
        weight = sum(mask) / group_tokens[row["group_id"]] / len(group_tokens)
        want["train/pg_loss"] += weight * loss
        want["train/pg_clipfrac"] += weight * (1.0 if clipped > unclipped else 0.0)
        want["train/ppo_kl"] += weight * -log_ratio
    assert capped == 2  # the dual clip really is exercised

    result = run(TrainConfig(rollouts=[str(shard)], load=str(tiny_model_dir), num_steps=1,
                             global_batch_size=len(rows), max_tokens_per_microbatch=40,
                             advantage_estimator="gspo", eps_clip=eps, eps_clip_high=high,
                             eps_clip_c=c, loss_aggregation="group", bypass=True, lr=1e-3))
    got = result.metrics[0]
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert got["train/loss"] == pytest.approx(want["train/pg_loss"], rel=1e-5)


def test_bf16_trains_and_publishes_bf16(tiny_model_dir, train_shard, tmp_path):
    result = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir), dtype="bf16",
                             publish=str(tmp_path / "w"), save=str(tmp_path / "c"), num_steps=1,
                             **COMMON))
    published = load_file(tmp_path / "w" / "weight_v000001" / "model.safetensors")
    master = load_file(tmp_path / "c" / "step-000001" / "model" / "model.safetensors")
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert {t.dtype for t in master.values()} == {torch.float32}  # fp32 master weights
    assert torch.isfinite(torch.tensor(result.metrics[0]["train/loss"]))


def test_sft_on_prompts_lowers_the_loss(tiny_model_dir, tmp_path):
    from rltool.data.tasks import make_rows, write_prompts

    prompts = write_prompts(make_rows("reverse", num=8, seed=0), tmp_path / "prompts.jsonl")
    result = run(TrainConfig(loss="sft", prompts=str(prompts), load=str(tiny_model_dir),
                             lr=1e-2, num_epochs=6, max_tokens_per_microbatch=256,
                             publish=str(tmp_path / "weights")))
    losses = [r for r in (m.get("train/loss") for m in result.metrics)]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0]


def test_sft_on_shard_responses(tiny_model_dir, train_shard):
    """SFT on rollout responses (e.g. rejection-sampled data): masked tokens, temperature 1."""
    result = run(TrainConfig(loss="sft", rollouts=[str(train_shard)], load=str(tiny_model_dir),
                             lr=1e-2, num_epochs=4, max_tokens_per_microbatch=256))
    losses = [m["train/sft_loss"] for m in result.metrics]
    assert losses[-1] < losses[0] and "train/pg_loss" not in result.metrics[0]


def test_mismatch_correction_is_wired(tiny_model_dir, train_shard):
    """The shard's rollout logprobs (-1..0) are far above the model's (~ -4): a tight
    sequence-level rejection band drops every sample, clipped IS lifts the tiny ratios to the
    band's floor, bypass trains on them directly."""
    base = dict(rollouts=[str(train_shard)], load=str(tiny_model_dir), num_steps=1, **COMMON)
    rejected = run(TrainConfig(rs_level="sequence", rs_high=1.01, **base)).metrics[0]
    assert rejected["train/rs_reject_frac"] == 1.0
    assert rejected["train/pg_loss"] == 0.0 and rejected["train/grad_norm"] == 0.0
    clipped = run(TrainConfig(tis_mode="clip", tis_clip_low=0.5, **base)).metrics[0]
    assert clipped["train/tis_clipfrac"] > 0.5 and clipped["train/tis"] < 0.5
    assert clipped["train/train_rollout_logprob_abs_diff"] > 1.0
    bypass = run(TrainConfig(bypass=True, **base)).metrics[0]
    assert "perf/log_probs_time" not in bypass and bypass["train/ppo_kl"] != 0.0


def test_ppo_value_head_learns_and_stays_out_of_published_weights(tiny_model_dir, train_shard,
                                                                  tmp_path):
    cfg = dict(rollouts=[str(train_shard)], advantage_estimator="ppo", gamma=0.99, lambd=0.95,
               num_epochs=4, **COMMON)
    result = run(TrainConfig(load=str(tiny_model_dir), save=str(tmp_path / "ckpt"),
                             publish=str(tmp_path / "weights"), **cfg))
    losses = [m["train/value_loss"] for m in result.metrics]
    assert losses[-1] < losses[0] and "train/value_clipfrac" in result.metrics[0]
    head = load_file(tmp_path / "ckpt" / "step-000008" / "value_head.safetensors")
    assert set(head) == {"value_head.weight", "value_head.bias"} and head["value_head.weight"].any()
    published = load_file(tmp_path / "weights" / "weight_v000008" / "model.safetensors")
    assert not any(k.startswith("value_head") for k in published)
    # A PPO checkpoint cannot silently continue as GRPO (its optimizer holds the head's moments).
    from rltool.errors import CheckpointError

    with pytest.raises(CheckpointError, match="value head"):
        run(TrainConfig(rollouts=[str(train_shard)], load=str(tmp_path / "ckpt"), num_steps=1,
                        **COMMON))


def test_forward_logprobs_entropy_and_top_k(tiny_model_dir, train_shard):
    """Backend forward outputs against a plain float64 computation from the model's logits."""
    from transformers import AutoModelForCausalLM

    from rltool.train.backend import MicroBatch
    from rltool.train.config import BackendConfig
    from rltool.train.torch_backend import TorchBackend

    backend = TorchBackend(tiny_model_dir, options=BackendConfig(), trainable=False)
    rows = _rows(train_shard)[:3]
    mb = MicroBatch(indices=[0, 1, 2],
                    tokens=[r["prompt_token_ids"] + r["response_token_ids"] for r in rows],
                    response_starts=[len(r["prompt_token_ids"]) for r in rows])
    out = backend.forward_logprobs(mb, temperature=0.5, with_entropy=True, top_k=3)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64)
    for k, (ids, start) in enumerate(zip(mb.tokens, mb.response_starts)):
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1:-1] / 0.5
        for t, target in enumerate(ids[start:]):
            row = logits[t].tolist()
            z = max(row)
            lse = z + math.log(sum(math.exp(x - z) for x in row))
            logp = [x - lse for x in row]
            assert float(out.logprobs[k][t]) == pytest.approx(logp[target], abs=1e-4)
            assert float(out.entropy[k][t]) == pytest.approx(
                -sum(math.exp(x) * x for x in logp), abs=1e-4)
            best = sorted(range(len(logp)), key=lambda v: -logp[v])[:3]
            assert out.topk_ids[k][t].tolist() == best
            assert out.topk_logprobs[k][t].tolist() == pytest.approx([logp[v] for v in best],
                                                                     abs=1e-4)


def test_sync_delta_publishes_a_delta_that_pulls_to_the_trained_weights(tiny_model_dir,
                                                                        train_shard, tmp_path):
    from rltool.io.checkpoint import is_delta_dir
    from rltool.delta.pull import pull_weights

    weights, ckpt = tmp_path / "weights", tmp_path / "ckpt"
    first = run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir), save=str(ckpt),
                            publish=str(weights), sync="delta", num_steps=1, **COMMON))
    assert not is_delta_dir(first.published)  # nothing published before it: no base
    second = run(TrainConfig(rollouts=[str(train_shard)], load=str(ckpt), save=str(ckpt),
                             publish=str(weights), sync="delta", num_steps=1, **COMMON))
    assert second.published == str(weights / "weight_v000002") and is_delta_dir(second.published)
    pull_weights(local_checkpoint_dir=tmp_path / "local", source_dir=weights, target_version=2)
    pulled = load_file(tmp_path / "local" / "model.safetensors")
    trained = load_file(ckpt / "step-000002" / "model" / "model.safetensors")
    assert pulled.keys() == trained.keys()
    assert all(torch.equal(pulled[n], trained[n]) for n in trained)
    lines = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    synced = [x for x in lines if "sync/mode" in x]
    assert [x["sync/mode"] for x in synced] == ["full", "delta"]
    assert [x["policy_version"] for x in synced] == [1, 2]
    assert 0.0 < synced[1]["perf/update_weights_density"] <= 1.0
    assert synced[1]["perf/update_weights_wire_bytes"] > 0


def test_device_option(tiny_model_dir, train_shard):
    from rltool.train.config import BackendConfig
    from rltool.train.torch_backend import TorchBackend

    backend = TorchBackend(tiny_model_dir, options=BackendConfig(device="cpu"), trainable=False)
    assert backend.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in backend.inner.parameters())
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda"):
            recompute_logprobs(tiny_model_dir, [train_shard], max_tokens_per_microbatch=40,
                               deterministic=True, device="cuda")
