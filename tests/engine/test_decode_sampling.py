"""Sampling inside the decode step's forward (rltool.engine.decode_sample, the body a CUDA graph
captures, run eagerly here) against the sampler launched after the forward: the same tokens for
seeded requests, logprobs within 1e-6, whatever the batch holds. The sampler is the Triton kernel,
so without CUDA the module runs once more in a child process with TRITON_INTERPRET=1 (as
test_sampling_fused does) and each test checks the child's outcome."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rltool.engine.decode_sample import SEED_MODULUS, sample_rows_of
from rltool.engine.sampling import SamplingParams
from tests.helpers import triton_child
from tests.helpers.graph_sampling import serve_seeded
from tests.helpers.triton_child import ran_in_child

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = "RLTOOL_TRITON_INTERPRET_CHILD"
PROMPTS = {"a": [5, 9, 3, 12], "b": [7, 2, 8], "c": [4, 4, 6, 1, 9, 2], "d": [11]}
TEMPS = {"a": 1.0, "b": 0.7, "c": 0.0, "d": 1.6}
MIXED = {"a": 12345, "b": 2**31 - 2, "c": 7, "d": 99991}  # base seed x 1_000_003 mod 2^31 - 1


@pytest.fixture(scope="module")
def child_report(tmp_path_factory) -> dict[str, str] | None:
    return triton_child.child_report(__file__, CHILD, tmp_path_factory.mktemp("triton-child"), 900)


def _runner(model_dir, *, graph_sampling: bool):
    from rltool.engine.paged_runner import PagedRunner

    runner = PagedRunner(model_dir, device=DEV, dtype="fp32", max_running=4, page_size=4,
                         max_total_tokens=256, disable_cuda_graph=True,
                         graph_sampling=graph_sampling)
    runner.prefill([(r, p, 0) for r, p in PROMPTS.items()], want=[False] * len(PROMPTS))
    return runner


def test_the_step_body_draws_what_the_sampler_draws_after_the_forward(request, tiny_model_dir):
    """Batches of several makeups and sizes, each step decoded by a runner that samples inside
    the forward and by one that returns logits, which the kernel then samples with the seeds
    the overlapped block computes on the host: (mixed seed + token index) mod 2^31 - 1, the
    index counted from the prompt. Same tokens, logprobs within 1e-6; the fused step returns
    no logits."""
    if ran_in_child(request):
        return
    from rltool.engine.sampling_kernel import sample_rows

    fused, plain = _runner(tiny_model_dir, graph_sampling=True), _runner(tiny_model_dir,
                                                                       graph_sampling=False)
    drawn = {r: 0 for r in PROMPTS}  # tokens each request has drawn (its next token index)
    last = {r: 1 for r in PROMPTS}
    for rids in (["a", "b", "c", "d"], ["c", "a"], ["d"], ["b", "d", "a"], ["a", "b", "c", "d"]):
        temps = np.array([TEMPS[r] if TEMPS[r] else 1.0 for r in rids], dtype=np.float32)
        greedy = np.array([TEMPS[r] == 0.0 for r in rids], dtype=np.int32)
        seeds = np.array([MIXED[r] for r in rids], dtype=np.int64)
        prompt_lens = np.array([len(PROMPTS[r]) for r in rids], dtype=np.int64)
        feed = [last[r] for r in rids]
        fused.sample_next(sample_rows_of(temps, greedy, seeds, prompt_lens))
        assert fused.decode(rids, feed) is None
        tokens, logprobs, graphed = fused.sampled()
        want_logits = plain.decode(rids, feed)
        assert plain.sampled() is None and not graphed
        index = np.array([drawn[r] + 1 for r in rids])  # token 0 came from the prefill
        dev = torch.device(DEV)
        want_tokens, want_lps = sample_rows(
            want_logits, torch.from_numpy(temps).to(dev),
            torch.from_numpy(((seeds + index) % SEED_MODULUS).astype(np.int32)).to(dev),
            torch.from_numpy(greedy).to(dev))
        assert tokens.tolist() == want_tokens.tolist(), rids
        assert torch.allclose(logprobs, want_lps, atol=1e-6, rtol=0)
        for r, t in zip(rids, tokens.tolist()):
            drawn[r] += 1
            last[r] = t
    assert len(set(last.values())) > 1


def test_a_block_advances_its_inputs_on_the_device(request, tiny_model_dir):
    """A block of 3 sampling steps: each later step reads the tokens, positions, lengths and KV
    slots the step before wrote, and draws what three single steps fed by the host draw."""
    if ran_in_child(request):
        return
    block, single = _runner(tiny_model_dir, graph_sampling=True), _runner(tiny_model_dir,
                                                                        graph_sampling=True)
    rids = ["a", "b", "c", "d"]
    args = (np.array([TEMPS[r] or 1.0 for r in rids], dtype=np.float32),
            np.array([TEMPS[r] == 0.0 for r in rids], dtype=np.int32),
            np.array([MIXED[r] for r in rids], dtype=np.int64),
            np.array([len(PROMPTS[r]) for r in rids], dtype=np.int64))
    rows = sample_rows_of(*args)
    block.sample_next(rows)
    block.decode(rids, [1] * 4, steps=3)
    got = [block.sampled()]
    for _ in range(2):
        block.decode_next(got[-1][0])
        got.append(block.sampled())
    feed = [1] * 4
    for step in range(3):
        single.sample_next(rows)
        single.decode(rids, feed)
        tokens, logprobs, _ = single.sampled()
        assert tokens.tolist() == got[step][0].tolist(), step
        assert torch.allclose(logprobs, got[step][1], atol=1e-6, rtol=0)
        feed = tokens.tolist()
    assert [block.table.entries[r].length for r in rids] == [
        single.table.entries[r].length for r in rids]


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
          SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)]
DRAWN = [SamplingParams(logit_bias={"3": 2.5, "17": -1.0}), SamplingParams(temperature=0.0),
         SamplingParams(min_new_tokens=4, temperature=0.8, stop_token_ids=[5, 9, 30],
                        logit_bias={"30": 50.0}),
         SamplingParams(logit_bias={"8": 1.5}, min_new_tokens=2)]
FILTERED = PARAMS[:3] + [SamplingParams(top_p=0.8)]


@pytest.mark.parametrize("steps", [1, 3])
def test_seeded_requests_draw_the_same_tokens_sampled_in_the_forward(request, tiny_model_dir,
                                                                    steps):
    """The engine with sampling in the decode forward and without: the same tokens and logprobs
    (within 1e-6) for seeded requests of several temperatures and prompt lengths, greedy
    included, as the batch shrinks, and with logit_bias and stop ids masked before
    min_new_tokens (draw logits in the forward: a stop id biased to win is masked for 4 tokens,
    then ends its request); the counters say which path sampled. A batch with a top-p request
    samples after the forward and still matches."""
    if ran_in_child(request):
        return
    for params in (PARAMS, DRAWN, FILTERED):
        got, sched = serve_seeded(tiny_model_dir, params, device=DEV, graph_sampling=True,
                                  steps=steps)
        want, base = serve_seeded(tiny_model_dir, params, device=DEV, graph_sampling=False,
                                  steps=steps)
        for (toks, lps), (want_toks, want_lps) in zip(got, want):
            assert toks == want_toks
            assert np.allclose(lps, want_lps, atol=1e-6, rtol=0)
        stats, blocks = sched.stats(), sched.batch.blocks
        assert base.batch.blocks.forward_sampled_steps == 0
        assert base.stats()["num_eager_sampled_steps"] > 0
        # no graphs on this device: every overlapped step counts as eager
        assert stats["num_graph_sampled_steps"] == 0 and stats["num_eager_sampled_steps"] > 0
        if params is DRAWN:
            stopped = got[2][0]
            assert len(stopped) == 5 and stopped[-1] == 30 and 30 not in stopped[:4], stopped
        if params is FILTERED:
            assert blocks.forward_sampled_steps < stats["num_eager_sampled_steps"]
        else:
            assert blocks.forward_sampled_steps == stats["num_eager_sampled_steps"]
