"""Built-in tasks: generated rows are correct and their rewards behave (float64 references)."""

from __future__ import annotations

import pytest

from rltool.data.tasks import (TASKS, exact_reward, extract_answer, get_task, make_rows,
                               number_partial_reward, partial_reward)
from rltool.errors import BadInputError


def _reference_partial(answer: str, label: str) -> float:
    hits = 0
    for i in range(min(len(answer), len(label))):
        hits += answer[i] == label[i]
    extra = len(answer) - len(label) if len(answer) > len(label) else 0
    return max(0.0, (hits - extra) / len(label))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rows_are_solved_by_their_labels(task):
    rows = make_rows(task, num=200, seed=5)
    t = get_task(task)
    for r in rows:
        p, label = r["prompt"], r["label"]
        if task == "add":
            a, b = p.removesuffix("=").split("+")
            assert str(int(a) + int(b)) == label
        else:
            verb, digits = p.split(" ")
            assert verb == task and digits.isdigit() and t.min_len <= len(digits) <= t.max_len
            assert label == {"copy": digits, "reverse": digits[::-1],
                             "sort": "".join(sorted(digits))}[task]
        assert t.exact_reward(label, label) == 1.0 and t.partial_reward(label, label) == 1.0


def test_extract_answer():
    assert extract_answer("  123 \nmore") == "123"
    assert extract_answer("123<|im_end|>") == "123"
    assert extract_answer("12<|endoftext|><|endoftext|>") == "12"
    assert extract_answer("") == ""


@pytest.mark.parametrize("answer,label", [("4321", "4321"), ("4331", "4321"), ("43", "4321"),
                                          ("432199", "4321"), ("", "12"), ("9999999", "1"),
                                          ("abc", "abd")])
def test_partial_reward_matches_reference(answer, label):
    assert partial_reward(answer, label) == pytest.approx(_reference_partial(answer, label))
    assert exact_reward(answer + "\n", label) == float(answer == label)
    assert number_partial_reward(answer, label) == pytest.approx(
        _reference_partial(answer[::-1], label[::-1]))


def test_partial_reward_empty_label():
    assert partial_reward("", "") == 1.0 and partial_reward("x", "") == 0.0


def test_unknown_task():
    with pytest.raises(BadInputError, match="choose one of copy, reverse, sort, add"):
        get_task("multiply")
