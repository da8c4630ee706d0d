"""The KV-cache layout of the builtin engine: a left-padded shared batch cache that rows join (one
by one or as a batched prefill) and leave must give each row what it would get alone."""

from __future__ import annotations

import pytest
import torch

from rltool.engine.model_runner import DecodeBatch, ModelRunner

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


def test_free_rows_are_reused_in_place_and_idle_ones_dropped(runner):
    """A finished row stays as a free slot: a newcomer is written into it (no whole-cache copy)
    and decodes exactly as alone; a slot left free for max_idle_steps is dropped."""
    steps = 4
    ref = {rid: alone(runner, p, steps + 4) for rid, p in PROMPTS.items()}
    batch = DecodeBatch()
    pending: dict[str, tuple[int, torch.Tensor]] = {}
    got: dict[str, list] = {rid: [] for rid in PROMPTS}

    def enter(rid: str) -> None:
        lg, cache = runner.prefill(PROMPTS[rid], None)
        pending[rid] = (int(lg.argmax()), lg)
        got[rid] = []
        ModelRunner.join(batch, ModelRunner.single(rid, cache))

    def step() -> None:
        for rid in batch.live:
            got[rid].append(pending[rid])
        lg = runner.decode(batch, [pending[r][0] if r is not None else 0 for r in batch.rids])
        for i, rid in enumerate(batch.rids):
            if rid is not None:
                pending[rid] = (int(lg[i].argmax()), lg[i])

    def check(rid: str, n: int) -> None:
        assert len(got[rid]) == n, rid
        assert [t for t, _ in got[rid]] == [t for t, _ in ref[rid][:n]], rid
        for (_, lg), (_, want) in zip(got[rid], ref[rid]):
            assert torch.allclose(lg, want, atol=1e-5), rid

    enter("a")
    enter("b")
    step()
    ModelRunner.free(batch, {"b"})  # "a" finished: its row is a free slot, nothing is copied
    assert batch.rids == [None, "b"]
    step()
    enter("c")  # longer than the batch: widened once, then written into a's slot
    assert batch.rids == ["c", "b"]
    for _ in range(steps):
        step()
    check("b", steps + 2)
    check("c", steps)
    ModelRunner.free(batch, {"c"})
    storage = [layer.keys.data_ptr() for layer in batch.cache.layers]
    enter("a")  # fits the batch's width: written in place into b's slot
    assert batch.rids == ["c", "a"]
    assert [layer.keys.data_ptr() for layer in batch.cache.layers] == storage
    for _ in range(2):
        step()
    check("a", 2)
    check("c", steps + 2)
    # A slot that nobody takes is dropped once it has been free for max_idle_steps steps.
    ModelRunner.free(batch, {"c"})
    step()
    ModelRunner.drop_idle(batch, max_idle_steps=2)
    assert batch.rids == ["c", None]
    step()
    ModelRunner.drop_idle(batch, max_idle_steps=2)
    assert batch.rids == ["c"] and batch.mask.shape[0] == 1
    check("c", steps + 4)


def test_cache_keyword_follows_the_installed_transformers():
    """transformers renamed forward's `past_key_values` to `cache` (5.2x); an unknown keyword is
    swallowed by **kwargs, so the wrong one would silently decode without the KV cache."""
    from rltool.engine.model_runner import _cache_kwarg

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            pass

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs):
            pass

    assert _cache_kwarg(Old()) == "past_key_values"
    assert _cache_kwarg(New()) == "cache"
