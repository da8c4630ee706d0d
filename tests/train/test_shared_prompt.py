"""The shared-prompt micro-batch layout of the torch backend against the padded one (CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from rltool.errors import ConfigError
from rltool.train import shared_prompt
from rltool.train.backend import MicroBatch
from rltool.train.config import BackendConfig, TrainConfig
from rltool.train.torch_backend import TorchBackend
from tests.helpers.layouts import assert_outputs_close


def _groups(vocab: int, *, seed: int = 0) -> MicroBatch:
    """Groups of samples under one prompt (of several lengths), a lone prompt, and responses of
    1 to 9 tokens, interleaved so that a group's samples are not adjacent."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (7, 3, 5)]
    tokens, starts = [], []
    for k in range(10):
        prompt = prompts[k % 3] if k < 9 else [rng.randrange(3, vocab) for _ in range(4)]
        tokens.append(prompt + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))])
        starts.append(len(prompt))
    return MicroBatch(list(range(len(tokens))), tokens, starts)


def _backend(model_dir, layout: str, **kw) -> TorchBackend:
    return TorchBackend(model_dir, options=BackendConfig(micro_batch_layout=layout, lr=1e-3,
                                                         device="cpu", **kw))


def test_layout_rows_and_mask():
    tokens = [[5, 6, 7, 8], [9, 7], [5, 6, 4, 3, 2], [9, 1]]
    got = shared_prompt.build(tokens, [2, 1, 2, 1], pad=0, device=torch.device("cpu"))
    assert got is not None
    assert got.ids.tolist() == [[5, 6, 7, 8, 4, 3, 2], [9, 7, 1, 0, 0, 0, 0]]
    assert got.positions.tolist() == [[0, 1, 2, 3, 2, 3, 4], [0, 1, 1, 0, 0, 0, 0]]
    assert got.sizes == [2, 1, 3, 1]
    assert got.targets.tolist() == [7, 8, 7, 4, 3, 2, 1]
    assert got.rows.tolist() == [1, 2, 7, 1, 4, 5, 7]  # prompt ends at columns 1 and 7 + 0
    m = got.mask[0, 0].int().tolist()
    assert m[4] == [1, 1, 0, 0, 1, 0, 0]  # the second sample's first response token
    assert m[3] == [1, 1, 1, 1, 0, 0, 0]
    assert got.mask[1, 0, 2].tolist() == [True, False, True, False, False, False, False]
    assert got.mask[1, 0, 5].tolist() == [False] * 5 + [True, False]  # padding: itself only
    assert shared_prompt.build([[1, 2], [1, 3]], [1, 2], pad=0,
                               device=torch.device("cpu")) is None  # no prompt repeats


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_shared_prompt_outputs_and_gradients_equal_padded(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    padded, shared = _backend(model_dir, "padded"), _backend(model_dir, "shared_prompt")
    batch = _groups(int(padded.config.vocab_size))
    a = padded.forward_logprobs(batch, temperature=0.7, with_entropy=True, top_k=4)
    b = shared.forward_logprobs(batch, temperature=0.7, with_entropy=True, top_k=4)
    assert_outputs_close(a, b, batch)
    grads = []
    for backend in (padded, shared):
        backend.inner.train()
        out, anchor = backend._forward(backend.model, batch, temperature=1.0,
                                       with_entropy=True, top_k=0)
        loss = anchor + sum((lp * (i + 1)).sum() + 0.1 * ent.sum()
                            for i, (lp, ent) in enumerate(zip(out.logprobs, out.entropy)))
        loss.backward()
        grads.append({k: p.grad for k, p in backend.inner.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=2e-5, rtol=1e-4, msg=k)


def test_auto_is_shared_prompt_on_cpu_and_deterministic_refused(tiny_model_dir):
    assert _backend(tiny_model_dir, "auto").shared_prompts
    assert not _backend(tiny_model_dir, "auto", deterministic=True).shared_prompts
    assert not _backend(tiny_model_dir, "padded").shared_prompts
    sft = TrainConfig(loss="sft", prompts="p.jsonl", load=str(tiny_model_dir), save="ckpt",
                      device="cpu")
    assert not TorchBackend(tiny_model_dir, options=sft).shared_prompts  # SFT: padded
    assert TorchBackend(tiny_model_dir, options=sft.model_copy(
        update={"micro_batch_layout": "shared_prompt"})).shared_prompts
    with pytest.raises(ConfigError, match="shared_prompt and --deterministic"):
        _backend(tiny_model_dir, "shared_prompt", deterministic=True)


def test_layout_built_once_per_micro_batch_and_bounded(tiny_model_dir, monkeypatch):
    """The old-logprob pass and the optimizer step of one micro-batch build its layout once
    (the same outputs as a fresh build); the kept layouts stay within their byte budget."""
    import rltool.train.torch_backend as tb

    backend = _backend(tiny_model_dir, "shared_prompt")
    batch = _groups(int(backend.config.vocab_size))
    fresh = backend.forward_logprobs(batch, temperature=1.0)
    built = []
    real = shared_prompt.build
    monkeypatch.setattr(shared_prompt, "build", lambda *a, **k: built.append(1) or real(*a, **k))
    again = backend.forward_logprobs(batch, temperature=1.0)
    backend.train_step([batch], lambda out, mb: (sum(lp.sum() for lp in out.logprobs), {}),
                       temperature=1.0)
    assert built == []  # both passes reused the layout of the first
    for a, b in zip(fresh.logprobs, again.logprobs):
        assert torch.equal(a, b)
    vocab = int(backend.config.vocab_size)
    batches = [batch, _groups(vocab, seed=1), _groups(vocab, seed=2)]
    sizes = [shared_prompt.nbytes(real(b.tokens, b.response_starts, pad=0,
                                       device=torch.device("cpu"))) for b in batches]
    monkeypatch.setattr(tb, "SHARED_LAYOUT_BYTES", max(sizes[0] + sizes[1], sizes[1] + sizes[2]))
    for b in batches[1:]:
        backend.forward_logprobs(b, temperature=1.0)
    assert len(backend._shared) == 2 and len(built) == 2  # the oldest went
    backend._shared_layout(batch)
    assert len(built) == 3


def test_cpu_foreach_optimizer_and_clip_equal_the_per_tensor_loops(tiny_model_dir):
    """On the CPU AdamW and the gradient clip run as foreach ops: the bits of the per-tensor
    loops (weights and optimizer state after three clipped steps)."""
    states = []
    for foreach in (True, None):
        torch.manual_seed(0)
        backend = _backend(tiny_model_dir, "shared_prompt", clip_grad=0.05, weight_decay=0.1)
        assert backend.foreach is True
        backend.foreach = foreach
        batch = _groups(int(backend.config.vocab_size))
        for _ in range(3):
            backend.train_step([batch], lambda out, mb: (sum((lp * (i % 3 - 1)).sum() for i, lp
                                                             in enumerate(out.logprobs)), {}),
                               temperature=1.0)
        opt = backend.optimizer.state_dict()["state"]
        states.append([p.detach().clone() for p in backend.inner.parameters()]
                      + [opt[i][key] for i in opt for key in ("exp_avg", "exp_avg_sq")])
    assert all(torch.equal(a, b) for a, b in zip(*states))
