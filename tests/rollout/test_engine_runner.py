"""The KV-cache layout of the builtin engine: a left-padded shared batch cache that rows join (one
by one or as a batched prefill) and leave must give each row what it would get alone."""

from __future__ import annotations

import pytest
import torch

from rltool.rollout.engine.model_runner import DecodeBatch, ModelRunner

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [10, 11], "c": [12, 13, 14, 15, 16, 17, 18, 19, 20]}


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir)


def alone(runner: ModelRunner, prompt: list[int], steps: int) -> list[tuple[int, torch.Tensor]]:
    """Greedy decode of one sequence on its own batch-of-one cache."""
    logits, cache = runner.prefill(prompt, None)
    out = []
    for _ in range(steps):
        tok = int(logits.argmax())
        out.append((tok, logits))
        logits = runner.decode_one(tok, cache)
    return out


def test_rows_joining_and_leaving_match_decoding_alone(runner):
    steps = 6
    ref = {rid: alone(runner, p, steps) for rid, p in PROMPTS.items()}
    batch = DecodeBatch()
    pending, got = {}, {rid: [] for rid in PROMPTS}
    # a and b prefilled together (left-padded); c joins later, prefilled in two chunks.
    logits, block = runner.prefill_batch(["a", "b"], [PROMPTS["a"], PROMPTS["b"]])
    for i, rid in enumerate(["a", "b"]):
        pending[rid] = (int(logits[i].argmax()), logits[i])
    ModelRunner.join(batch, block)
    for step in range(steps):
        if step == 2:
            lg, cache = runner.prefill(PROMPTS["c"][:4], None)
            lg, cache = runner.prefill(PROMPTS["c"][4:], cache)
            ModelRunner.join(batch, ModelRunner.single("c", cache))
            pending["c"] = (int(lg.argmax()), lg)
        for rid in batch.rids:
            got[rid].append(pending[rid])
        if step == 3:  # "a" leaves; columns that only it used are trimmed
            ModelRunner.keep(batch, ["c", "b"])
        logits = runner.decode(batch, [pending[rid][0] for rid in batch.rids])
        for i, rid in enumerate(batch.rids):
            pending[rid] = (int(logits[i].argmax()), logits[i])
    for rid, rows in got.items():
        assert [t for t, _ in rows] == [t for t, _ in ref[rid][:len(rows)]], rid
        for (_, lg), (_, want) in zip(rows, ref[rid]):
            assert torch.allclose(lg, want, atol=1e-5), rid
    assert len(got["a"]) == 4 and len(got["b"]) == steps and len(got["c"]) == steps - 2
    assert batch.mask.shape[1] == len(PROMPTS["c"]) + steps - 2  # "a"'s extra columns are gone
