"""Built-in verifiable tasks on short digit strings, with exact and partial-credit rewards.

Each task makes prompt rows `{"prompt_id", "prompt", "label", "metadata"}`; `prompt` is the user
turn (the chat template is applied by the rollout stage). The answer is the response text up to
the first newline or end-of-turn token, stripped.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from rltool import atomic
from rltool.config import StageConfig
from rltool.data.tokenizer import EOS_TOKEN, PAD_TOKEN
from rltool.errors import BadInputError


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    make: Callable[[random.Random, int, int], tuple[str, str]]  # (rng, min_len, max_len) -> (prompt, label)
    min_len: int
    max_len: int
    # (response, label) -> credit in [0, 1]; None means `partial_reward`.
    partial: Callable[[str, str], float] | None = None

    def exact_reward(self, response: str, label: str) -> float:
        return exact_reward(response, label)

    def partial_reward(self, response: str, label: str) -> float:
        return (self.partial or partial_reward)(response, label)


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))


def _copy(rng: random.Random, lo: int, hi: int) -> tuple[str, str]:
    s = _digits(rng, lo, hi)
    return f"copy {s}", s


def _reverse(rng: random.Random, lo: int, hi: int) -> tuple[str, str]:
    s = _digits(rng, lo, hi)
    return f"reverse {s}", s[::-1]


def _sort(rng: random.Random, lo: int, hi: int) -> tuple[str, str]:
    s = _digits(rng, lo, hi)
    return f"sort {s}", "".join(sorted(s))


def _add(rng: random.Random, lo: int, hi: int) -> tuple[str, str]:
    a, b = (int(_digits(rng, lo, hi)) for _ in range(2))
    return f"{a}+{b}=", str(a + b)


def number_partial_reward(response: str, label: str) -> float:
    """Like `partial_reward` but aligned at the units digit, so `1234` vs `1235` earns 3/4 and a
    dropped leading digit keeps the credit of the digits that are right."""
    answer = extract_answer(response)
    return partial_reward(answer[::-1], label[::-1])


TASKS: dict[str, Task] = {
    t.name: t for t in (
        Task("copy", "repeat the digit string", _copy, 1, 4),
        Task("reverse", "reverse the digit string", _reverse, 2, 5),
        Task("sort", "sort the digits ascending", _sort, 2, 5),
        Task("add", "add two numbers", _add, 1, 3,
             partial=number_partial_reward),
    )
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise BadInputError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}") from None


def make_rows(task: str, *, num: int, seed: int, min_len: int | None = None,
              max_len: int | None = None) -> list[dict[str, Any]]:
    t = get_task(task)
    lo = t.min_len if min_len is None else min_len  # `or` would turn an explicit 0 into the default
    hi = t.max_len if max_len is None else max_len
    if not 1 <= lo <= hi:
        raise BadInputError(f"need 1 <= --min-len <= --max-len, got {lo} and {hi}")
    if num < 1:
        raise BadInputError(f"--num must be >= 1, got {num}")
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        prompt, label = t.make(rng, lo, hi)
        rows.append({"prompt_id": f"{task}-{seed}-{i}", "prompt": prompt, "label": label,
                     "metadata": {"task": task}})
    return rows


def prompts_jsonl(rows: list[dict[str, Any]]) -> str:
    """Prompt rows as JSONL text, one sorted-key object per line."""
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def write_prompts(rows: list[dict[str, Any]], out: str | os.PathLike) -> Path:
    out = Path(out)
    atomic.write_text(out, prompts_jsonl(rows))
    return out


def extract_answer(response: str) -> str:
    """The response up to its first newline or end-of-turn token (engines may keep it), stripped."""
    for stop in ("\n", EOS_TOKEN, PAD_TOKEN):
        response = response.split(stop, 1)[0]
    return response.strip()


def exact_reward(response: str, label: str) -> float:
    return 1.0 if extract_answer(response) == label else 0.0


def partial_reward(response: str, label: str) -> float:
    """Fraction of label positions matched, minus a penalty for extra characters; in [0, 1]."""
    answer = extract_answer(response)
    if not label:
        return float(answer == label)
    hits = sum(1 for a, b in zip(answer, label) if a == b)
    extra = max(0, len(answer) - len(label))
    return max(0.0, (hits - extra) / len(label))


class DataMakeConfig(StageConfig):
    """`rltool data make` (the `[data]` table of a config file)."""

    task: str = Field(description="Built-in task (`rltool data list`).")
    num: int = Field(gt=0, description="Number of prompts.")
    seed: int = Field(0, description="Generator seed; the same seed gives the same file.")
    min_len: int | None = Field(None, description="Shortest digit string (task default).")
    max_len: int | None = Field(None, description="Longest digit string (task default).")
    out: str = Field(description="Output .jsonl file, or - for stdout.")
