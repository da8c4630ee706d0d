"""Sampling and the logprob convention, against float64 plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from rltool.engine.sampling import SamplingParams, filter_probs, make_generator
from tests.helpers.sampling import sample


def ref_logprobs(row: list[float], temperature: float) -> list[float]:
    t = 1.0 if temperature < 1e-6 else temperature
    scaled = [x / t for x in row]
    m = max(scaled)
    z = math.log(sum(math.exp(x - m) for x in scaled)) + m
    return [x - z for x in scaled]


def ref_filter(probs: list[float], *, top_k: int, top_p: float, min_p: float) -> list[float]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set()
    mass = 0.0
    for rank, i in enumerate(order):
        if rank > 0 and (top_k > 0 and rank >= top_k or mass > top_p
                         or probs[i] < min_p * probs[order[0]]):
            continue
        keep.add(i)
        mass += probs[i]
    return [p if i in keep else 0.0 for i, p in enumerate(probs)]


def test_logprobs_follow_the_convention_and_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 11) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=2),
              SamplingParams(temperature=1.3, top_p=0.5)]
    tokens, lps = sample(logits, params, generators=[None, make_generator(1), make_generator(2)],
                         suppressed=[[], [], []])
    assert int(tokens[0]) == int(logits[0].argmax())
    for row, p in enumerate(params):
        ref = ref_logprobs(logits[row].double().tolist(), p.temperature)
        # Reported before filtering: every token of the vocabulary has a finite logprob.
        assert all(abs(a - b) < 1e-5 for a, b in zip(lps[row].tolist(), ref))
    # top_k=2 can only draw one of the two largest logits.
    assert int(tokens[1]) in logits[1].topk(2).indices.tolist()


@pytest.mark.parametrize("top_k,top_p,min_p", [(-1, 0.6, 0.0), (3, 1.0, 0.0), (-1, 1.0, 0.2),
                                               (4, 0.8, 0.05), (1, 0.3, 0.9)])
def test_filter_matches_reference(top_k, top_p, min_p):
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(2, 17, dtype=torch.float64) * 2, dim=-1)
    p = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    got = filter_probs(probs, [p, p])
    for row in range(2):
        ref = ref_filter(probs[row].tolist(), top_k=top_k, top_p=top_p, min_p=min_p)
        assert got[row].tolist() == pytest.approx(ref, abs=1e-12)


def test_seeded_draw_does_not_depend_on_batch_position():
    torch.manual_seed(2)
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=1.0)] * 5
    alone, _ = sample(logits[2:3], params[:1], generators=[make_generator(9)], suppressed=[[]])
    gens = [make_generator(s) for s in (1, 2, 9, 4, 5)]
    batched, _ = sample(logits, params, generators=gens, suppressed=[[]] * 5)
    assert int(batched[2]) == int(alone[0])


def test_suppressed_tokens_are_never_drawn_but_keep_their_logprob():
    logits = torch.zeros(1, 4)
    logits[0, 3] = 50.0
    tokens, lps = sample(logits, [SamplingParams(temperature=0.0)], generators=[None],
                         suppressed=[[3]])
    assert int(tokens[0]) != 3 and lps[0, 3] > -1e-3


def test_draws_follow_the_filtered_distribution():
    """Empirical frequencies of the exponential-race sampler vs the float64 filtered probs."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = SamplingParams(temperature=0.8, top_p=0.9)
    gen = make_generator(3)
    counts = [0] * 5
    draws = 4000
    for _ in range(draws):
        tok, _ = sample(logits, [p], generators=[gen], suppressed=[[]])
        counts[int(tok[0])] += 1
    probs = [math.exp(x) for x in ref_logprobs(logits[0].double().tolist(), 0.8)]
    ref = ref_filter(probs, top_k=-1, top_p=0.9, min_p=0.0)
    total = sum(ref)
    for c, r in zip(counts, ref):
        assert abs(c / draws - r / total) < 0.03


@pytest.mark.parametrize("bad", [{"top_p": 0.0}, {"top_k": 0}, {"temperature": -1},
                                 {"max_new_tokens": -1}, {"bogus": 1}, {"stop": ["a"] * 33},
                                 {"repetition_penalty": 1.2}, {"regex": "a+"}, {"n": 0},
                                 {"min_p": 1.5}])
def test_invalid_sampling_params_are_rejected(bad):
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


def test_null_means_default_and_stop_accepts_a_string():
    p = SamplingParams(temperature=None, stop="x", sampling_seed=None)
    assert p.temperature == 1.0 and p.stop == ["x"] and p.sampling_seed is None
