"""The torch backend on the qwen3_5 hybrid (Gated DeltaNet + gated attention), CPU fp32: the
layouts it takes (padded; packed and shared_prompt refused), the trainer's logprobs against the
builtin engine's model on the same tokens, and one optimizer step that moves the GDN tensors."""

from __future__ import annotations

import random

import pytest
import torch

from rltool.engine.paged_runner import PagedRunner
from rltool.errors import ConfigError
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend
from tests.helpers.hybrid import GDN_KEYS, engine_logprobs, make_hybrid


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_hybrid(tmp_path_factory.mktemp("hybrid") / "m")


def _batch(*, seed: int = 0) -> MicroBatch:
    """Six samples of 4 to 80 tokens (past one 64-token GDN chunk), two sharing a prompt."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 60) for _ in range(5)]
    tokens, starts = [], []
    for n_prompt, n_resp in [(5, 3), (5, 9), (3, 1), (7, 73), (12, 20), (2, 2)]:
        p = prompt if n_prompt == 5 else [rng.randrange(3, 60) for _ in range(n_prompt)]
        tokens.append(p + [rng.randrange(3, 60) for _ in range(n_resp)])
        starts.append(n_prompt)
    return MicroBatch(list(range(len(tokens))), tokens, starts)


def _backend(model_dir, **kw) -> TorchBackend:
    return TorchBackend(model_dir, options=BackendConfig(device="cpu", lr=1e-2, **kw))


def test_layouts_padded_only(hybrid_dir):
    assert _backend(hybrid_dir).layout == "padded"  # auto on the CPU (shared_prompt elsewhere)
    assert _backend(hybrid_dir, micro_batch_layout="padded").layout == "padded"
    for layout in ("packed", "shared_prompt"):
        with pytest.raises(ConfigError, match=f"layout {layout}.*linear-attention") as e:
            _backend(hybrid_dir, micro_batch_layout=layout)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("deterministic", [False, True])
def test_trainer_logprobs_equal_the_engines(hybrid_dir, deterministic):
    """The align property: padded micro-batch (or one sample per pass) against the engine's
    model on each sample alone, within 1e-5 in fp32."""
    backend = _backend(hybrid_dir, deterministic=deterministic)
    runner = PagedRunner(hybrid_dir, device="cpu", dtype="fp32", max_running=2, page_size=4,
                         max_total_tokens=512, prefix_cache=False)
    batch = _batch()
    got = backend.forward_logprobs(batch, temperature=0.7).logprobs
    for tokens, start, lp in zip(batch.tokens, batch.response_starts, got):
        want = engine_logprobs(runner, tokens, start, temperature=0.7)
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)


def test_one_train_step_moves_the_gdn_tensors_and_padding_leaks_nothing(hybrid_dir):
    """One step of a loss on every response logprob: the padded micro-batch's gradients equal
    those of one pass per sample (padding after a sample never reaches its recurrent state),
    every GDN tensor gets a gradient and moves, and the loss falls."""
    batch = _batch(seed=1)

    def loss_fn(out, mb):
        loss = -sum(lp.sum() for lp in out.logprobs)
        return loss, {"loss": loss.detach()}

    grads = []
    for deterministic in (False, True):
        backend = _backend(hybrid_dir, deterministic=deterministic)
        backend.inner.train()
        out, anchor = backend._forward(backend.model, batch, temperature=1.0,
                                       with_entropy=False, top_k=0)
        (anchor + loss_fn(out, batch)[0]).backward()
        grads.append({k: p.grad.clone() for k, p in backend.inner.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-5, rtol=1e-4, msg=k)
    for key in GDN_KEYS:
        assert any(key in k and g.abs().sum() > 0 for k, g in grads[0].items()), key

    backend = _backend(hybrid_dir)
    before = {k: v.clone() for k, v in backend.inner.state_dict().items()}
    first = backend.train_step([batch], loss_fn, temperature=1.0)
    after = backend.inner.state_dict()
    for key in GDN_KEYS:
        moved = [k for k in before if key in k and not torch.equal(before[k], after[k])]
        assert moved, key
    second = backend.train_step([batch], loss_fn, temperature=1.0)
    assert second["loss"] < first["loss"] and first["train/grad_norm"] > 0


def test_megatron_backend_refuses_hybrids(hybrid_dir):
    """Refused before megatron's process groups start: megatron-core 0.16.1's GatedDeltaNet
    needs flash-linear-attention and raises on packed sequences, which the backend always uses."""
    from rltool.train.megatron_backend import MegatronBackend

    with pytest.raises(ConfigError, match="does not train linear-attention hybrids.*"
                                          "--backend torch") as e:
        MegatronBackend(hybrid_dir, options=BackendConfig(device="cpu"))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_rl_loop_with_tensor_sync(hybrid_dir, tmp_path):
    """Two loop steps on CPU (rollout on a live engine serving the hybrid, train, publish, tensor
    sync, deterministic; one optimizer step each): step 1's rollouts were sampled by version 1,
    synced in memory, and the trainer's logprobs of them equal the engine's exactly (its
    deterministic recompute runs transformers' GDN), so the engine served what the trainer holds."""
    import tomli_w
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from rltool.cli import main as cli
    from rltool.data.shards import open_shard
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.rundir import RunDir, read_metrics

    write_prompts(make_rows("reverse", num=4, seed=1), tmp_path / "rl.jsonl")
    # a reward that varies inside a group (the random model never earns the task's)
    (tmp_path / "reward.py").write_text("def reward(prompt, response, label, metadata):\n"
                                        "    return sum(map(ord, response)) % 7 / 7\n")
    config = {"model": {"path": str(hybrid_dir)},
              "rollout": {"prompts": str(tmp_path / "rl.jsonl"), "reward": f"{tmp_path / 'reward.py'}:reward",
                          "n_samples_per_prompt": 2, "rollout_batch_size": 2,
                          "max_response_len": 8},
              "train": {"lr": 1e-2, "global_batch_size": 4}, "sync": {"sync": "tensor"},
              "loop": {"num_steps": 2, "deterministic": True, "seed": 3, "align_gate": 1e-6,
                       "engine_args": ["--disable-radix-cache"]}}
    (tmp_path / "run.toml").write_text(tomli_w.dumps(config))
    run = tmp_path / "run"
    result = CliRunner().invoke(cli, ["loop", "-q", "--config", str(tmp_path / "run.toml"),
                                      "--run-dir", str(run), "--json"])
    assert result.exit_code == 0, result.output
    rows = read_metrics(RunDir(run).metrics_file("loop"))
    assert [r["sync/mode"] for r in rows] == ["tensor", "tensor"]
    assert all(r["train/grad_norm"] > 0 for r in read_metrics(RunDir(run).metrics_file("train")))
    assert all(r["train/train_rollout_logprob_abs_diff"] == 0.0 for r in rows)
    table = open_shard(RunDir(run).rollout_step(1)).read()
    versions = {v for vs in table.column("weight_versions").to_pylist() for v in vs if v >= 0}
    assert versions == {1}
    base = load_file(str(hybrid_dir / "model.safetensors"))
    final = load_file(str(RunDir(run).ckpt_step(2) / "model" / "model.safetensors"))
    for key in GDN_KEYS:
        assert any(key in k and not torch.equal(base[k], final[k]) for k in base), key
