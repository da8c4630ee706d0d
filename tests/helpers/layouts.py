"""Comparing the torch backend's micro-batch layouts: one layout's forward outputs against
another's on the same micro-batch."""

from __future__ import annotations

import torch

from rltool.train.backend import ForwardOutput, MicroBatch


def assert_outputs_close(a: ForwardOutput, b: ForwardOutput, batch: MicroBatch, *,
                         atol: float = 1e-5) -> None:
    """`b` has one response's worth of values per sample and equals `a` (logprobs, entropy,
    top-k logprobs within `atol`; top-k ids exactly)."""
    assert [len(x) for x in b.logprobs] == [len(t) - s for t, s in
                                            zip(batch.tokens, batch.response_starts)]
    for name in ("logprobs", "entropy", "topk_logprobs"):
        for x, y in zip(getattr(a, name), getattr(b, name)):
            torch.testing.assert_close(y, x, atol=atol, rtol=0)
    for x, y in zip(a.topk_ids, b.topk_ids):
        assert torch.equal(x, y)
