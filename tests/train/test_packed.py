"""The packed micro-batch layout of the torch backend against the padded one (CPU, fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from rltool.errors import ConfigError
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig
from rltool.train.torch_backend import TorchBackend
from tests.helpers.layouts import assert_outputs_close


def _batch(vocab: int, *, seed: int = 0, n: int = 5) -> MicroBatch:
    rng = random.Random(seed)
    tokens, starts = [], []
    for _ in range(n):
        prompt, response = rng.randint(2, 9), rng.randint(1, 14)
        tokens.append([rng.randrange(3, vocab) for _ in range(prompt + response)])
        starts.append(prompt)
    return MicroBatch(list(range(n)), tokens, starts)


def _backend(model_dir, layout: str, **kw) -> TorchBackend:
    return TorchBackend(model_dir, options=BackendConfig(micro_batch_layout=layout, lr=1e-3,
                                                         device="cpu", **kw))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_packed_logprobs_entropy_topk_equal_padded(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    padded = _backend(model_dir, "padded")
    packed = _backend(model_dir, "packed", logprob_chunk_tokens=3)  # several chunks per sample
    batch = _batch(int(padded.config.vocab_size))
    a = padded.forward_logprobs(batch, temperature=0.7, with_entropy=True, top_k=4)
    b = packed.forward_logprobs(batch, temperature=0.7, with_entropy=True, top_k=4)
    assert_outputs_close(a, b, batch)


def _grads(backend: TorchBackend, batch: MicroBatch) -> dict[str, torch.Tensor]:
    backend.inner.zero_grad(set_to_none=True)
    out, anchor = backend._forward(backend.model, batch, temperature=1.0, with_entropy=True,
                                   top_k=0)
    loss = anchor + sum((lp * (i + 1)).sum() + 0.1 * ent.sum()
                        for i, (lp, ent) in enumerate(zip(out.logprobs, out.entropy)))
    if "values" in out.extras:
        loss = loss + sum(v.square().sum() for v in out.extras["values"])
    loss.backward()
    return {k: p.grad.clone() for k, p in backend.inner.named_parameters() if p.grad is not None}


def test_packed_gradients_equal_padded(tiny_model_dir):
    padded = _backend(tiny_model_dir, "padded")
    batch = _batch(int(padded.config.vocab_size), seed=1)
    want = _grads(padded, batch)
    for chunk in (2, 4096):  # chunked rows are checkpointed: same gradients as one chunk
        got = _grads(_backend(tiny_model_dir, "packed", logprob_chunk_tokens=chunk), batch)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4, msg=k)


def test_packed_value_head_equals_padded(tiny_model_dir):
    padded = TorchBackend(tiny_model_dir, options=BackendConfig(micro_batch_layout="padded",
                                                                device="cpu"), value_head=True)
    packed = TorchBackend(tiny_model_dir, options=BackendConfig(micro_batch_layout="packed",
                                                                device="cpu"), value_head=True)
    with torch.no_grad():  # a non-zero head, the same in both
        for b in (padded, packed):
            torch.manual_seed(3)
            b.inner.value_head.weight.normal_()
    batch = _batch(int(padded.config.vocab_size), seed=2)
    a = padded.forward_logprobs(batch, temperature=1.0)
    b = packed.forward_logprobs(batch, temperature=1.0)
    for x, y in zip(a.extras["values"], b.extras["values"]):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=0)
    want, got = _grads(padded, batch), _grads(packed, batch)
    torch.testing.assert_close(got["value_head.weight"], want["value_head.weight"],
                               atol=1e-4, rtol=1e-4)


def test_packed_train_step_matches_padded(tiny_model_dir):
    def loss_fn(out, mb):
        loss = sum(-(lp - lp.detach()).exp().mean() for lp in out.logprobs) / 8
        return loss, {"train/loss": loss.detach()}

    results = {}
    for layout in ("padded", "packed"):
        backend = _backend(tiny_model_dir, layout, recompute="full" if layout == "packed" else "none")
        batch = _batch(int(backend.config.vocab_size), seed=4, n=8)
        halves = [MicroBatch(batch.indices[:4], batch.tokens[:4], batch.response_starts[:4]),
                  MicroBatch(batch.indices[4:], batch.tokens[4:], batch.response_starts[4:])]
        metrics = backend.train_step(halves, loss_fn, temperature=1.0)
        results[layout] = metrics
    assert results["packed"]["train/loss"] == pytest.approx(results["padded"]["train/loss"],
                                                            abs=1e-6)
    assert results["packed"]["train/grad_norm"] == pytest.approx(
        results["padded"]["train/grad_norm"], rel=1e-4)


def test_recompute_full_checkpoints_every_decoder_layer_and_none_none(tiny_model_dir):
    from transformers.modeling_layers import GradientCheckpointingLayer

    for recompute, want in (("none", False), ("full", True)):
        inner = _backend(tiny_model_dir, "padded", recompute=recompute).inner
        layers = [m for m in inner.modules() if isinstance(m, GradientCheckpointingLayer)]
        assert len(layers) == inner.config.num_hidden_layers
        assert [layer.gradient_checkpointing for layer in layers] == [want] * len(layers)
    with pytest.raises(ConfigError, match="torch backend recomputes whole layers"):
        _backend(tiny_model_dir, "padded", recompute="selective")


def test_layout_choice_and_refusals(tiny_model_dir):
    assert not _backend(tiny_model_dir, "auto").packed  # auto: packed only on CUDA
    assert _backend(tiny_model_dir, "packed").packed
    with pytest.raises(ConfigError, match="deterministic"):
        _backend(tiny_model_dir, "packed", deterministic=True)


def test_pack_builds_the_row_sample_by_sample():
    from rltool.train import packed

    tokens = [[5, 6, 7, 8], [9, 10, 11], [0, 0]]     # the last: a padding sample, no response
    p = packed.pack(tokens, [2, 1, 2], torch.device("cpu"))
    assert p.ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    assert p.cu_seqlens.tolist() == p.cu_seqlens_host.tolist() == [0, 4, 7, 9]
    assert p.cu_seqlens.dtype == p.cu_seqlens_host.dtype == torch.int32
    assert p.rows.tolist() == [1, 2, 4, 5] and p.targets.tolist() == [7, 8, 10, 11]
    assert p.response_lengths == [2, 2, 0] and p.max_len == 4
