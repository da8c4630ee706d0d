"""The stop rule: which token ends a request and with what finish reason (SGLang's), checked
against the rule's cheap per-token test, which must never say no where the decision says stop."""

from __future__ import annotations

import pytest

from rltool.engine.sampling import SamplingParams
from rltool.engine.stop_rule import StopRule

EOS = {2}


def rule(prompt_len: int = 3, context_length: int = 100, **params) -> StopRule:
    return StopRule.for_request(SamplingParams(**params), prompt_len=prompt_len,
                                eos_token_ids=EOS, context_length=context_length)


def no_text() -> str:
    raise AssertionError("the text is decoded only for stop strings and patterns")


def test_eos_and_stop_token_ids_stop_after_min_new_tokens():
    r = rule(max_new_tokens=10, stop_token_ids=[7], min_new_tokens=2)
    assert r.reason(1, 2, no_text) is None  # EOS before min_new_tokens: goes on
    assert r.reason(2, 2, no_text) == ({"type": "stop", "matched": 2}, None)
    assert r.reason(3, 7, no_text) == ({"type": "stop", "matched": 7}, None)
    assert r.reason(3, 5, no_text) is None
    assert not r.may_stop(1, 2) and r.may_stop(2, 2) and not r.may_stop(3, 5)


def test_ignore_eos_keeps_only_the_stop_token_ids():
    r = rule(max_new_tokens=10, stop_token_ids=[7], ignore_eos=True)
    assert r.stop_ids == frozenset({7})
    assert r.reason(4, 2, no_text) is None


def test_length_is_max_new_tokens_or_the_context_left():
    assert rule(max_new_tokens=5).reason(5, 9, no_text) == ({"type": "length", "length": 5}, None)
    capped = rule(prompt_len=8, context_length=12, max_new_tokens=50)
    assert capped.max_new_tokens == 4
    assert capped.reason(3, 9, no_text) is None
    assert capped.reason(4, 9, no_text) == ({"type": "length", "length": 4}, None)
    assert capped.may_stop(4, 9) and not capped.may_stop(3, 9)


def test_a_stop_token_at_the_length_limit_reports_stop():
    assert rule(max_new_tokens=3).reason(3, 2, no_text) == ({"type": "stop", "matched": 2}, None)


@pytest.mark.parametrize("keep", [False, True])
def test_stop_strings_cut_the_text_unless_kept(keep):
    r = rule(max_new_tokens=50, stop=["END", "b"], no_stop_trim=keep)
    assert r.checks_text and r.may_stop(1, 9)  # every token needs the text checked
    assert r.reason(1, 9, lambda: ("aaa", 0)) is None
    reason, cut = r.reason(4, 9, lambda: ("aaENDb", 0))
    assert reason == {"type": "stop", "matched": "END"}  # the earliest match wins
    assert cut == (5 if keep else 2)


def test_a_string_wins_over_a_pattern_at_the_same_offset_and_min_new_tokens_holds_both():
    r = rule(max_new_tokens=50, stop=["ab"], stop_regex=["a+b"], min_new_tokens=3)
    assert r.reason(2, 9, lambda: ("xab", 0)) is None
    assert r.reason(3, 9, lambda: ("xab", 0)) == ({"type": "stop", "matched": "ab"}, 1)
    assert r.reason(3, 9, lambda: ("aab", 0)) == ({"type": "stop", "matched": "a+b"}, 0)
