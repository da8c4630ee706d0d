"""The fused sampler (`batch_sampling.sample_batch` with the Triton kernel) against an independent
numpy reference of its draw: the exponential race in log space, argmax of logit / T plus Gumbel
noise -log(-log U), U from the counter-based hash of (seed, token id). Without CUDA the module
runs once more in a child process with TRITON_INTERPRET=1 (rltool/engine/sampling_kernel.py runs
on numpy there, so the reference's float32 arithmetic is the kernel's, bit for bit); on CUDA the
compiled kernel's log may round differently, so a token may differ only at a near tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rltool.engine.sampling import SamplingParams
from rltool.logprobs import effective_temperature
from tests.helpers import triton_child
from tests.helpers.fused_sampling import (STOP, decode_filtered, fmix32, ref_keys, ref_removed,
                                          ref_token)
from tests.helpers.triton_child import ran_in_child

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CHILD = "RLTOOL_TRITON_INTERPRET_CHILD"
M32 = 0xFFFF_FFFF


@pytest.fixture(scope="module")
def child_report(tmp_path_factory) -> dict[str, str] | None:
    """Without CUDA: this module run again with TRITON_INTERPRET=1 (see test_triton_kernels)."""
    return triton_child.child_report(__file__, CHILD, tmp_path_factory.mktemp("triton-child"), 900)


def assert_tokens_match(got: list[int], logits: torch.Tensor, params: list[SamplingParams],
                        seeds: list[int], suppressed: list[list[int]]) -> None:
    """Equal to the reference, row by row (on CUDA: or a near tie of the reference's keys)."""
    rows = logits.float().cpu().numpy()
    for i, (tok, p) in enumerate(zip(got, params)):
        want = ref_token(rows[i], p, seed=seeds[i], suppressed=suppressed[i])
        if tok != want and CUDA:
            keys = ref_keys(rows[i], temp=effective_temperature(p.temperature), seed=seeds[i],
                            greedy=p.greedy)
            assert abs(float(keys[tok]) - float(keys[want])) < 1e-4, (i, tok, want)
            continue
        assert tok == want, (i, tok, want, p)


def run_sampler(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], *,
                suppressed: list[list[int]] | None = None, top_n: list[int] | None = None):
    from rltool.engine.batch_sampling import sample_batch

    B = len(params)
    return sample_batch(logits.to(DEV), params, generators=[None] * B,
                        suppressed=suppressed or [[]] * B, top_n=top_n or [0] * B,
                        token_ids=[None] * B, seeds=seeds, use_kernel=True)


def test_seeded_plain_rows_are_the_race_over_their_hash_noise(request):
    """The equality the fused path keeps: a seeded plain row's token is the race over its own
    hash noise, whatever the rest of the batch holds."""
    if ran_in_child(request):
        return
    torch.manual_seed(0)
    B, V = 6, 700
    logits = torch.randn(B, V) * 3
    params = [SamplingParams(temperature=t) for t in (1.0, 0.7, 1.3, 0.0, 1.0, 2.0)]
    seeds = [5, 6, 7, 8, 2**31 - 2, 123456789]
    drawn = run_sampler(logits, params, seeds, top_n=[0, 3, 0, 0, 0, 0])
    assert_tokens_match(drawn.tokens, logits, params, seeds, [[]] * B)
    temps = torch.tensor([effective_temperature(p.temperature) for p in params])
    ref_lp = torch.log_softmax(logits / temps[:, None], dim=-1)
    want = ref_lp.gather(1, torch.tensor(drawn.tokens)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(drawn.logprobs, dtype=torch.float32), want, atol=1e-5)
    assert [t for _, t in drawn.top[1]] == ref_lp[1].topk(3).indices.tolist()


def test_each_parameter_alone_and_combined_is_the_race_over_the_allowed_tokens(request):
    """Every row of a mixed batch draws the reference's token: the race keys of a plain row,
    with logit_bias added and the tokens masked (stop ids before min_new_tokens) or filtered
    (top-k / top-p / min-p of the biased distribution) out; logprobs stay unbiased."""
    if ran_in_child(request):
        return
    torch.manual_seed(1)
    V = 300
    cases = [  # (params, suppressed ids)
        (SamplingParams(top_k=5), []),
        (SamplingParams(top_p=0.5), []),
        (SamplingParams(min_p=0.2, temperature=0.8), []),
        (SamplingParams(logit_bias={"3": 6.0, "10": -100.0, "999": 5.0}), []),
        (SamplingParams(), [0, 7, 299]),
        (SamplingParams(top_k=20, top_p=0.8, min_p=0.05, temperature=0.7,
                        logit_bias={"4": 3.0}), [1, 2]),
        (SamplingParams(temperature=0.0, logit_bias={"8": 50.0}), []),
        (SamplingParams(temperature=0.0, top_k=3), [5]),
        (SamplingParams(), []),
        (SamplingParams(top_k=V), []),
    ]
    params, suppressed = [c[0] for c in cases], [c[1] for c in cases]
    logits = torch.randn(len(cases), V) * 3
    logits[4, 7] = 30.0  # a suppressed id that would otherwise win
    seeds = [11 * i + 3 for i in range(len(cases))]
    drawn = run_sampler(logits, params, seeds, suppressed=suppressed)
    assert_tokens_match(drawn.tokens, logits, params, seeds, suppressed)
    assert drawn.tokens[6] == 8 and drawn.tokens[4] not in (0, 7, 299)
    want = torch.log_softmax(logits / torch.tensor(
        [effective_temperature(p.temperature) for p in params])[:, None], dim=-1)
    got = torch.tensor(drawn.logprobs, dtype=torch.float32)
    assert torch.allclose(got, want.gather(1, torch.tensor(drawn.tokens)[:, None]).squeeze(1),
                          atol=1e-5)
    # A plain row draws the same token in a filtered batch as in a plain one, and a filter that
    # removes nothing (top_k = V) is the plain race.
    plain = run_sampler(logits[8:], params[8:9] * 2, seeds[8:])
    assert plain.tokens == drawn.tokens[8:]


def test_degenerate_filters_are_greedy_and_min_p_filters(request):
    """top_k = 1 and a tiny top_p draw the argmax of the biased logits for every seed; min_p and
    top_k never let out a token they remove; the kept tokens are drawn in proportion."""
    if ran_in_child(request):
        return
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    n = 96
    rows = probs.log().repeat(n, 1)
    seeds = list(range(1000, 1000 + n))
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
              SamplingParams(top_k=1, logit_bias={"2": 1.0})):
        want = 2 if p.logit_bias else 0
        assert set(run_sampler(rows, [p] * n, seeds).tokens) == {want}
    for p, kept in ((SamplingParams(min_p=0.2), 3), (SamplingParams(top_k=3), 3),
                    (SamplingParams(top_p=0.6), 2)):
        toks = torch.tensor(run_sampler(rows, [p] * n, seeds).tokens)
        freq = torch.bincount(toks, minlength=5).float() / n
        assert freq[kept:].sum() == 0, (p, freq)
        target = probs[:kept] / probs[:kept].sum()
        assert (freq[:kept] - target).abs().max() < 0.16, (p, freq)  # > 3 sd at n = 96


def test_decode_overlap_stays_on_with_filtered_sampling(request, tiny_model_dir):
    """Filtered, biased and min_new_tokens requests decode in overlapped blocks (the scheduler's
    launch counters say so) and, their draws keyed by (seed, token index), get the tokens and
    logprobs of the same requests decoded one synchronous step at a time. A stop id biased to
    win is masked until min_new_tokens, then ends the request."""
    if ran_in_child(request):
        return
    overlapped, blocks = decode_filtered(tiny_model_dir, device=DEV, overlap=True, steps=2)
    synchronous, sync_blocks = decode_filtered(tiny_model_dir, device=DEV, overlap=False, steps=1)
    assert blocks.launches > 0 and blocks.draw_launches > 0 and sync_blocks.launches == 0
    for (toks, lps), (want_toks, want_lps) in zip(overlapped, synchronous):
        assert toks == want_toks
        assert np.allclose(lps, want_lps, atol=1e-5)
    biased = overlapped[2][0]
    assert len(biased) == 4 and STOP not in biased[:3] and biased[3] == STOP, biased


def test_filter_mask_keeps_tied_tokens_by_id_with_a_sort_or_a_top_k():
    """Tokens of equal probability (bf16 logits tie often) are kept lowest id first, as the
    loop reference's order says, whether the kept prefix is found by sorting the vocabulary or,
    with max_k, by its largest max_k probabilities."""
    from rltool.engine.sampling import filter_mask

    torch.manual_seed(3)
    B, V = 12, 200
    probs = torch.softmax(torch.randn(B, V).mul(2).round(), dim=-1)  # a few distinct values
    params = [SamplingParams(top_k=k, top_p=tp, min_p=mp) for k, tp, mp in
              [(7, 1.0, 0.0), (30, 1.0, 0.0), (1, 1.0, 0.0), (12, 0.37, 0.0), (40, 1.0, 0.3),
               (25, 0.61, 0.05)] * 2]
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    want = np.stack([ref_removed(probs[i].double().numpy(), p) for i, p in enumerate(params)])
    for max_k in (None, 40):
        got = filter_mask(probs, top_k=top_k, top_p=top_p, min_p=min_p, max_k=max_k)
        assert np.array_equal(got.numpy(), want), max_k


def test_the_largest_hash_does_not_make_its_token_win(request):
    """Bug: the hash's largest value, (2^24 - 1) + 0.5, rounds to 2^24 in float32, so U was
    exactly 1, the noise -log(-log U) +inf, and that token (about one row-step in 110 at a 152k
    vocabulary) was drawn whatever its probability. Seed 109806 gives token 55 of 64 that hash."""
    if ran_in_child(request):
        return
    seed, tok = 109806, 55
    offs = np.uint64(tok)
    h = fmix32(fmix32((offs * np.uint64(0x9E3779B1) + np.uint64(0x7F4A7C15)) & np.uint64(M32))
                ^ np.uint64(seed))
    assert int(h) >> 8 == 2**24 - 1  # the case this test is about
    logits = torch.full((1, 64), -40.0)
    logits[0, 3] = 0.0  # probability ~1; token 55 ~e-40
    drawn = run_sampler(logits, [SamplingParams()], [seed])
    assert drawn.tokens == [3]
