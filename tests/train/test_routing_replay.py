"""Rollout routing replay (R3) end to end on the tiny qwen3_moe: the builtin engine (fp32,
deterministic) returns the experts it routed every token to, `rltool rollout
--use-rollout-routing-replay` stores them in the shard, and the trainer replays them.

- Unperturbed, in deterministic fp32, the trainer's recomputed logprobs equal the engine's
  exactly with replay.
- With the trainer's router perturbed (its gate in bf16: weights and input rounded to bf16, the
  engine's in fp32), some tokens go to other experts in the trainer: replay brings them back, and
  what is left (routing weights from a slightly different gate) is at least 10x smaller than the
  difference without replay. The model's router weights are scaled down 10x, so its routing
  weights are near-uniform and a perturbation mostly shows as flipped experts (what R3 removes)
  rather than as reweighting (what it keeps).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rltool.data.shards import open_shard
from rltool.data.tasks import make_rows, write_prompts
from rltool.engine.config import ServeConfig
from rltool.engine.inprocess import InProcessEngine
from rltool.errors import BadInputError
from rltool.rollout.stage import RolloutConfig, run as run_rollout
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.samples import load_rollouts
from rltool.train.torch_backend import TorchBackend

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def moe_rollout(tiny_model_factory, tmp_path_factory):
    """(model dir, shard with routed experts, shard without, tokenizer hash): 16 samples of up
    to 24 response tokens each."""
    from rltool.data.tokenizer import tokenizer_hash

    tmp = tmp_path_factory.mktemp("r3")
    model_dir = tmp / "model"
    rewrite_gates(tiny_model_factory("qwen3_moe", 0), model_dir, lambda w: w * 0.1)
    prompts = write_prompts(make_rows("reverse", num=8, seed=3), tmp / "prompts.jsonl")
    engine = InProcessEngine(ServeConfig(model=model_dir, device="cpu", deterministic=True,
                                         weight_version="0"))
    try:
        shards = {}
        for name, replay in (("r3", True), ("plain", False)):
            run_rollout(RolloutConfig(
                engines=[engine.url], prompts=str(prompts), out=str(tmp / name),
                n_samples_per_prompt=4, rollout_batch_size=4, max_response_len=24,
                reward="reverse", seed=7, quiet=True, use_rollout_routing_replay=replay),
                clients={engine.url: engine})
            shards[name] = tmp / name
    finally:
        engine.stop()
    return model_dir, shards["r3"], shards["plain"], tokenizer_hash(model_dir)


def rewrite_gates(src, dst, fn):
    """A copy of the checkpoint `src` with fn applied to every router (mlp.gate) weight."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("mlp.gate.weight"):
                tensors[name] = fn(t)
        save_file(tensors, f, metadata={"format": "pt"})


def logprob_diffs(backend, samples, *, replay):
    """|trainer - engine| logprob of every response token."""
    out = []
    for i, s in enumerate(samples):
        mb = MicroBatch([i], [s.tokens], [s.response_start],
                        [s.routed_experts] if replay else None)
        got = backend.forward_logprobs(mb, temperature=1.0).logprobs[0]
        out.append((got - torch.tensor(s.rollout_logprobs)).abs())
    return torch.cat(out)


def test_shard_holds_the_engines_routes(moe_rollout):
    model_dir, r3, plain, tok = moe_rollout
    rows = open_shard(r3).rows()
    assert all(r["rollout_routed_experts"] is not None for r in rows)
    assert all(r["rollout_routed_experts"] is None for r in open_shard(plain).rows())
    samples = load_rollouts([r3], tokenizer_hash=tok, vocab_size=10**6,
                            routed_experts=True).samples
    for s in samples:  # tiny qwen3_moe: 2 MoE layers, top-2 of 4 experts
        assert s.routed_experts.shape == (s.num_tokens - 1, 4)
        assert s.routed_experts.min() >= 0 and s.routed_experts.max() < 4
    with pytest.raises(BadInputError, match="has no rollout_routed_experts; re-run the rollout"):
        load_rollouts([plain], tokenizer_hash=tok, vocab_size=10**6, routed_experts=True)


def test_replay_is_exact_in_deterministic_fp32(moe_rollout):
    model_dir, r3, _, tok = moe_rollout
    samples = load_rollouts([r3], tokenizer_hash=tok, vocab_size=10**6).samples
    backend = TorchBackend(model_dir, trainable=False, options=BackendConfig(
        device="cpu", deterministic=True, use_rollout_routing_replay=True))
    assert logprob_diffs(backend, samples, replay=True).max().item() == 0.0


def test_replay_removes_most_of_a_perturbed_routers_mismatch(moe_rollout, tmp_path):
    model_dir, r3, _, tok = moe_rollout
    perturbed = tmp_path / "bf16-gate"
    rewrite_gates(model_dir, perturbed, lambda w: w.to(torch.bfloat16).float())
    samples = load_rollouts([r3], tokenizer_hash=tok, vocab_size=10**6).samples
    backend = TorchBackend(perturbed, trainable=False, options=BackendConfig(
        device="cpu", deterministic=True, use_rollout_routing_replay=True))
    for layer in backend.inner.model.layers:  # the gate's input in bf16 as well
        layer.mlp.gate.register_forward_pre_hook(lambda m, a: (a[0].to(torch.bfloat16).float(),))
    without = logprob_diffs(backend, samples, replay=False)
    with_r3 = logprob_diffs(backend, samples, replay=True)
    print(json.dumps({"tokens": len(without), "flipped": int((without > 1e-4).sum()),
                      "mean": [without.mean().item(), with_r3.mean().item()],
                      "max": [without.max().item(), with_r3.max().item()]}))
    assert (without > 1e-4).sum() >= 5  # the perturbation did flip experts
    assert with_r3.mean() * 10 <= without.mean()
    assert with_r3.max() * 10 <= without.max()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_replay_in_batched_layouts_and_training(moe_rollout, tmp_path, layout):
    """Several samples in one micro-batch (right-padded, or packed into one row) replay the
    routes of the right tokens: the perturbed trainer's logprobs equal those of each sample
    replayed alone; a training step runs its backward under the same replay and gives the
    router a gradient (the weights stay the router's own)."""
    model_dir, r3, _, tok = moe_rollout
    perturbed = tmp_path / "bf16-gate"
    rewrite_gates(model_dir, perturbed, lambda w: w.to(torch.bfloat16).float())
    samples = load_rollouts([r3], tokenizer_hash=tok, vocab_size=10**6).samples[:4]
    backend = TorchBackend(perturbed, options=BackendConfig(
        device="cpu", micro_batch_layout=layout, use_rollout_routing_replay=True))
    mb = MicroBatch(list(range(4)), [s.tokens for s in samples],
                    [s.response_start for s in samples], [s.routed_experts for s in samples])
    together = backend.forward_logprobs(mb, temperature=1.0).logprobs
    for i, part in enumerate(mb.split()):
        alone = backend.forward_logprobs(part, temperature=1.0).logprobs[0]
        assert torch.allclose(together[i], alone, atol=1e-5, rtol=0)
        assert torch.allclose(alone, torch.tensor(samples[i].rollout_logprobs), atol=1e-4)

    def loss_fn(out, unit):
        return -sum(lp.sum() for lp in out.logprobs), {}

    backend.train_step([mb], loss_fn, temperature=1.0)
    gate = backend.inner.model.layers[0].mlp.gate.weight
    assert backend.optimizer.state[gate]["exp_avg"].abs().sum() > 0


@pytest.mark.slow
def test_megatron_ep2_replays_as_the_torch_backend(moe_rollout, tmp_path):
    """One GRPO step with replay on a trainer whose router differs from the engine's (10% noise
    on its gate weights): megatron at EP2 (2 gloo ranks) recomputes the old logprobs the torch
    backend computes with replay (within 1e-5; both within 1e-4 of the engine's, where without
    replay some tokens differ by more than 1e-3), then trains under the same replay."""
    from safetensors.torch import load_file as load_tensors

    from tests.helpers.torchrun import train_cli

    model_dir, r3, _, tok = moe_rollout
    noisy = tmp_path / "noisy-gate"
    gen = torch.Generator().manual_seed(0)
    rewrite_gates(model_dir, noisy, lambda w: w + 0.1 * w.std() * torch.randn(
        w.shape, generator=gen))
    samples = load_rollouts([r3], tokenizer_hash=tok, vocab_size=10**6).samples
    backend = TorchBackend(noisy, trainable=False, options=BackendConfig(
        device="cpu", use_rollout_routing_replay=True))
    assert logprob_diffs(backend, samples, replay=False).max() > 1e-3
    engine = torch.cat([torch.tensor(s.rollout_logprobs) for s in samples])
    want = torch.cat([backend.forward_logprobs(MicroBatch(  # the torch backend's, replayed
        [0], [s.tokens], [s.response_start], [s.routed_experts]), temperature=1.0).logprobs[0]
        for s in samples])
    assert (want - engine).abs().max() < 1e-4
    proc = train_cli(["--rollouts", str(r3), "--load", str(noisy), "--save",
                      str(tmp_path / "ckpt"), "--backend", "megatron", "--nproc-per-node", "2",
                      "--expert-model-parallel-size", "2", "--use-rollout-routing-replay",
                      "--lr", "3e-3", "--max-tokens-per-microbatch", "64",
                      "--global-batch-size", "16", "--num-steps", "1", "--json"], timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_tensors(tmp_path / "ckpt" / "step-000001" / "data.safetensors")["old_logprobs"]
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    metrics = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-4
