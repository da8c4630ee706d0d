"""The qwen3_5 hybrid (Gated DeltaNet + gated attention) between a live CPU engine and the torch
trainer, fp32: after a trained step reaches the engine by a full publish, a delta (pulled) and a
shared-memory tensor sync, the engine's logprobs equal the trainer's; the align gate on a shard
the engine sampled in deterministic mode, and where the two forward passes first differ."""

from __future__ import annotations

import random

import pytest
import torch

from rltool.align.config import AlignGateConfig
from rltool.align.gate import check, run
from rltool.align.layerwise import engine_hidden_states
from rltool.delta import tensor_sync
from rltool.delta.config import SyncConfig
from rltool.delta.publish import publish_version
from rltool.engine import api
from rltool.io.checkpoint import is_delta_dir
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend
from tests.helpers.engines import engine_call
from tests.helpers.hybrid import GDN_KEYS, make_hybrid

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(model dir, the engine: `rltool serve --deterministic --enable-debug-endpoints` over it,
    with a local checkpoint directory for /pull_weights)."""
    from rltool.rollout.launch import start_engine

    root = tmp_path_factory.mktemp("hybrid-align")
    model = make_hybrid(root / "m")
    proc = start_engine(["--engine", "builtin", "--model", str(model), "--device", "cpu",
                         "--deterministic", "--enable-debug-endpoints", "--disable-radix-cache",
                         "--num-threads", "1", "--local-checkpoint-dir", str(root / "local")],
                        log_path=root / "engine.log", ready_timeout_s=120.0)
    yield model, proc
    proc.stop()


SEQS = [[random.Random(i).randrange(3, 60) for _ in range(n)] for i, n in enumerate((9, 70, 23))]


def engine_lps(url: str) -> list[torch.Tensor]:
    return [torch.tensor(engine_hidden_states(url, s)["token_logprobs"]) for s in SEQS]


def trainer_lps(backend: TorchBackend) -> list[torch.Tensor]:
    batch = MicroBatch(list(range(len(SEQS))), SEQS, [1] * len(SEQS))
    return backend.forward_logprobs(batch, temperature=1.0).logprobs


def test_full_delta_and_tensor_sync_carry_the_gdn_tensors(hybrid, tmp_path):
    model, engine = hybrid
    engine_call(engine.url, "update_weights_from_disk", str(model), weight_version="0")
    backend = TorchBackend(model, options=BackendConfig(device="cpu", lr=5e-2))
    batch = MicroBatch([0, 1], SEQS[:2], [3, 5])

    def loss_fn(out, mb):
        return -sum(lp.sum() for lp in out.logprobs), {}

    before = engine_lps(engine.url)
    for a, b in zip(before, trainer_lps(backend)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    pub = model.parent / "weights"
    for version, how in ((1, "full"), (2, "delta"), (3, "tensor")):
        backend.train_step([batch], loss_fn, temperature=1.0)
        state = backend.export_hf_state_dict()
        assert all(any(key in k for k in state) for key in GDN_KEYS)
        if how == "tensor":
            named = list(state.items())
            groups = tensor_sync.buckets(named, bucket_bytes=16384)
            assert len(groups) > 2
            size = tensor_sync.segment_bytes(named, bucket_bytes=16384)
            with tensor_sync.ShmSegment(size) as seg:
                for i, bucket in enumerate(groups):
                    message = seg.write(bucket, dtype=torch.float32)
                    engine_call(engine.url, "update_weights_from_tensor",
                                [api.TensorMessage.model_validate(message).model_dump_json()],
                                load_format=api.SHM_FORMAT,
                                weight_version=str(version) if i == len(groups) - 1 else None)
        else:
            sync = SyncConfig(sync=how, full_every=10)
            metrics = publish_version(state, sync, publish_dir=pub, version=version,
                                      source_model_dir=model, dtype="fp32", workers=1)
            path = pub / f"weight_v{version:06d}"
            assert metrics["sync/mode"] == how and is_delta_dir(path) == (how == "delta")
            if how == "delta":
                engine_call(engine.url, "pull_weights",
                            local_checkpoint_dir=str(model.parent / "local"),
                            source_dir=str(pub), target_version=version)
                path = model.parent / "local"
            engine_call(engine.url, "update_weights_from_disk", str(path),
                        weight_version=str(version))
        got, want = engine_lps(engine.url), trainer_lps(backend)
        for a, b, old in zip(got, want, before):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=how)
            assert (a - old).abs().max() > 1e-3, how  # the engine really moved
        before = got
    info = engine_call(engine.url, "get_json", "/get_weight_version")
    assert info["weight_version"] == "3"


def test_align_gate_on_a_shard_the_engine_sampled(hybrid, tmp_path):
    """Deterministic fp32 on the CPU: exactly 0, as for the dense models (the deterministic
    engine recomputes each finished request's logprobs in one pass whose GDN layers run
    transformers' own ops, HybridLM._gdn_as_trainer); every layer of `--layerwise` equal. The
    padded trainer (several samples per pass) stays within 1e-6."""
    from rltool.data.tasks import make_rows, write_prompts
    from rltool.rollout.stage import RolloutConfig
    from rltool.rollout.stage import run as rollout

    model, engine = hybrid
    engine_call(engine.url, "update_weights_from_disk", str(model), weight_version="0")
    prompts = write_prompts(make_rows("reverse", num=4, seed=3), tmp_path / "prompts.jsonl")
    shard = tmp_path / "rollouts" / "step-000000"
    rollout(RolloutConfig(engines=[engine.url], prompts=str(prompts), out=str(shard),
                          n_samples_per_prompt=2, max_response_len=40, reward="reverse",
                          rollout_batch_size=4, seed=7, temperature=1.0, quiet=True))
    det = check([shard], model, tol=0.0, deterministic=True)
    padded = check([shard], model, tol=1e-6, deterministic=False)
    assert det.num_samples == 8 and det.metric == 0.0 and det.max_abs_diff == 0.0, det.metric
    assert padded.passed and padded.max_abs_diff < 5e-6, padded.metric
    result = run(AlignGateConfig(rollouts=[str(shard)], weights=str(model), deterministic=True,
                                 tol=0.0, layerwise=True, engine=engine.url, layer_tol=0.0,
                                 layerwise_samples=2))
    assert result.passed
    layers = {entry["name"]: entry["max_abs_diff"] for entry in result.layerwise["layers"]}
    assert set(layers.values()) == {0.0} and "layers.0" in layers, layers
    assert result.layerwise["first_layer_above_tol"] is None
