"""Reward functions, resolved from a `--reward SPEC` string.

Every reward is a plain, thread-safe callable

    reward_fn(prompt: str, response: str, label: str | None, metadata: dict) -> RewardResult

so the rollout stage can score samples in worker threads while generation continues.
`RewardResult.reward` is the scalar the advantages use; `components` are named parts that go to the
shard's `rewards` column and to the metrics.

Specs (`resolve_reward`), tried in this order:
- `exact`, `partial`: generic, on the label (answer = response up to its first newline).
- `TASK`, `TASK:exact`, `TASK:partial`: a built-in task's rewards (`rltool data list`).
- `math`: `\\boxed{...}` (or else the last number) compared with the label after normalisation.
- `http://HOST/PATH`, `https://...`: a remote reward model, POST `{prompt, response, label}` and
  answer `{"reward": float, "components": {name: float}}` (components optional).
- `module:function` or `path/to/file.py:function`: a custom Python function with the signature
  above returning a float or a dict with a `reward` key (other numeric keys become components).
Built-in names win over a module of the same name.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

from rltool.data.tasks import TASKS, extract_answer, partial_reward
from rltool.errors import BadInputError, EngineTimeoutError, RewardError


@dataclass(frozen=True)
class RewardResult:
    reward: float
    components: dict[str, float] = field(default_factory=dict)


RewardFn = Callable[[str, str, "str | None", dict[str, Any]], RewardResult]

SPEC_HELP = ("exact, partial, TASK, TASK:exact, TASK:partial, math, http(s)://URL, module:function "
             "or file.py:function")


def resolve_reward(spec: str, *, timeout_s: float = 30.0) -> RewardFn:
    """Turn a `--reward` spec into a reward callable; BadInputError for a spec that names nothing."""
    spec = spec.strip()
    if not spec:
        raise BadInputError(f"--reward is empty; use one of: {SPEC_HELP}")
    if spec in ("exact", "partial"):
        return LabelReward(spec)
    if spec == "math":
        return MathReward()
    if spec.startswith(("http://", "https://")):
        return RemoteReward(spec, timeout_s=timeout_s)
    name, _, variant = spec.partition(":")
    if name in TASKS:
        if variant not in ("", "exact", "partial"):
            raise BadInputError(f"--reward {spec}: task {name} has rewards {name}:exact and "
                                f"{name}:partial, not {variant!r}")
        return LabelReward(variant or "exact", task=name)
    if variant:
        return load_custom_reward(name, variant)
    raise BadInputError(f"--reward {spec!r} names no reward; use one of: {SPEC_HELP} "
                        f"(tasks: {', '.join(TASKS)})")


def check_labels(reward_fn: RewardFn, prompts: list[Any], *, spec: str) -> None:
    """BadInputError (before any sampling) when the reward needs labels and a prompt has none."""
    if not getattr(reward_fn, "needs_label", False):
        return
    missing = next((p for p in prompts if p.label is None), None)
    if missing is not None:
        raise BadInputError(f"--reward {spec} needs a label, but prompt {missing.prompt_id!r} "
                            f"(row {missing.row_index}) has none; add a \"label\" to every "
                            "prompt row or choose another --reward")


def _require_label(label: str | None, *, what: str) -> str:
    if label is None:
        raise BadInputError(f"reward {what} needs a label, but the prompt has none; add a "
                            "\"label\" to every prompt row or choose another --reward")
    return label


@dataclass(frozen=True)
class LabelReward:
    """Exact or partial-credit match of the extracted answer against the label.

    Components: always `exact`; `partial` too for the partial-credit variant.
    """

    variant: str  # "exact" | "partial"
    task: str | None = None
    needs_label: ClassVar[bool] = True  # the stage checks every prompt has one before sampling
    # A string comparison bounded by the response length: the collector calls it on its event
    # loop (no thread hand-over per sample, no timeout), which cost more than the comparison.
    inline: ClassVar[bool] = True

    def __call__(self, prompt: str, response: str, label: str | None,
                 metadata: dict[str, Any]) -> RewardResult:
        what = f"{self.task}:{self.variant}" if self.task else self.variant
        label = _require_label(label, what=what)
        exact = float(extract_answer(response) == label)
        if self.variant == "exact":
            return RewardResult(exact, {"exact": exact})
        credit = TASKS[self.task].partial_reward(response, label) if self.task else \
            partial_reward(response, label)
        return RewardResult(credit, {"exact": exact, "partial": credit})


# --- math answers -----------------------------------------------------------------------------

# Thousands separators only in groups of three, so "1,000" is one number and "3, 4," are two.
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
        j += 1
    return None  # unbalanced: the answer was cut off


def extract_math_answer(response: str) -> str | None:
    """The `\\boxed{}` answer, else the last number in the response (GSM8K `#### 42` included)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = _NUMBER_RE.findall(response)
    return numbers[-1] if numbers else None


def normalize_math_answer(answer: str) -> Fraction | str:
    """A number as an exact Fraction (`1,000`, `3.50`, `7/2`, `\\frac{7}{2}`, `$5`, `50%` kept as
    50), anything else as a whitespace- and markup-free string."""
    s = _TEXT_RE.sub(r"\1", answer.strip())
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    for markup in ("\\$", "$", "\\%", "%"):
        s = s.replace(markup, "")
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"\s+", "", s)
    frac = _FRAC_RE.match(s)
    if frac:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    # Thousands separators only where they group digits by three ("1,000", not "1,2").
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        if re.fullmatch(r"-?\d+(\.\d+)?/-?\d+(\.\d+)?|-?\d*\.?\d+(e-?\d+)?", s):
            num, _, den = s.partition("/")
            return Fraction(num) / Fraction(den) if den else Fraction(num)
    except (ValueError, ZeroDivisionError):
        pass
    return s


@dataclass(frozen=True)
class MathReward:
    """1.0 when the response's final answer equals the label as a number (or as normalised text).

    Components: `correct`, and `has_answer` (0 when nothing answer-like was found).
    """

    needs_label: ClassVar[bool] = True

    def __call__(self, prompt: str, response: str, label: str | None,
                 metadata: dict[str, Any]) -> RewardResult:
        label = _require_label(label, what="math")
        answer = extract_math_answer(response)
        if answer is None:
            return RewardResult(0.0, {"correct": 0.0, "has_answer": 0.0})
        want = last_boxed(label)
        correct = float(normalize_math_answer(answer) ==
                        normalize_math_answer(label if want is None else want))
        return RewardResult(correct, {"correct": correct, "has_answer": 1.0})


# --- custom Python functions ------------------------------------------------------------------

_custom_lock = threading.Lock()


def load_custom_reward(module: str, function: str) -> RewardFn:
    """Import `module` (a dotted module name or a .py file path) and wrap its `function`."""
    with _custom_lock:  # imports are not re-entrant-safe across threads
        if module.endswith(".py"):
            path = Path(module)
            if not path.is_file():
                raise BadInputError(f"--reward {module}:{function}: no such file {path}")
            name = f"rltool_custom_reward_{abs(hash(str(path.resolve())))}"
            mod = sys.modules.get(name)
            if mod is None:
                spec = importlib.util.spec_from_file_location(name, path)
                assert spec is not None and spec.loader is not None
                mod = importlib.util.module_from_spec(spec)
                try:
                    spec.loader.exec_module(mod)
                except Exception as e:
                    raise BadInputError(f"--reward {module}:{function}: importing {path} "
                                        f"failed: {e!r}") from e
                sys.modules[name] = mod
        else:
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                raise BadInputError(f"--reward {module}:{function}: cannot import {module} ({e}); "
                                    f"is it on PYTHONPATH? Built-in rewards: {SPEC_HELP}") from e
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise BadInputError(f"--reward {module}:{function}: {module} has no function {function}")
    return CustomReward(fn, name=f"{module}:{function}")


@dataclass(frozen=True)
class CustomReward:
    fn: Callable[..., Any]
    name: str

    def __call__(self, prompt: str, response: str, label: str | None,
                 metadata: dict[str, Any]) -> RewardResult:
        try:
            value = self.fn(prompt, response, label, metadata)
        except Exception as e:
            raise RewardError(f"reward {self.name} raised {e!r}") from e
        return to_reward_result(value, source=self.name)


def to_reward_result(value: Any, *, source: str) -> RewardResult:
    """A float/int/bool, or a dict with `reward` (+ numeric components, or a `components` dict)."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, dict):
        if "reward" not in value:
            raise BadInputError(f"reward {source} returned a dict without a 'reward' key: "
                                f"{sorted(value)}")
        rest = value.get("components", {k: v for k, v in value.items() if k != "reward"})
        if not isinstance(rest, dict):
            raise BadInputError(f"reward {source}: 'components' must be an object of numbers")
        reward = _finite(value["reward"], source=source, key="reward")
        return RewardResult(reward, {str(k): _finite(v, source=source, key=str(k))
                                     for k, v in rest.items()})
    return RewardResult(_finite(value, source=source, key="reward"))


def _finite(value: Any, *, source: str, key: str) -> float:
    if isinstance(value, (bool, int, float)):
        out = float(value)
        if math.isfinite(out):
            return out
        raise BadInputError(f"reward {source}: {key} is {out}; rewards must be finite numbers")
    raise BadInputError(f"reward {source}: {key} must be a number, got {type(value).__name__}")


# --- remote reward model ----------------------------------------------------------------------

class RemoteReward:
    """POST `{prompt, response, label}` to a reward-model URL; thread-safe (one pooled client)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0):
        import httpx

        try:
            httpx.URL(url)
        except httpx.InvalidURL as e:
            raise BadInputError(f"--reward {url}: not a valid URL ({e})") from e
        if timeout_s <= 0:
            raise BadInputError(f"reward timeout must be > 0 seconds, got {timeout_s}")
        self.url = url
        self.timeout_s = timeout_s
        self._client = httpx.Client(timeout=timeout_s)

    def __call__(self, prompt: str, response: str, label: str | None,
                 metadata: dict[str, Any]) -> RewardResult:
        import httpx

        try:
            r = self._client.post(self.url, json={"prompt": prompt, "response": response,
                                                  "label": label})
        except httpx.TimeoutException as e:
            raise EngineTimeoutError(f"reward model {self.url} did not answer within "
                                     f"{self.timeout_s:g} s; raise the reward timeout or check the "
                                     "server") from e
        except httpx.HTTPError as e:
            raise RewardError(f"reward model {self.url} is unreachable: {e!r}") from e
        if r.status_code != 200:
            raise RewardError(f"reward model {self.url} answered HTTP {r.status_code}: "
                              f"{r.text[:200]!r}")
        try:
            body = r.json()
        except ValueError as e:
            raise RewardError(f"reward model {self.url} answered non-JSON: {r.text[:200]!r}") from e
        if not isinstance(body, dict) or "reward" not in body:
            raise RewardError(f"reward model {self.url} answered without a 'reward' field: "
                              f"{r.text[:200]!r}")
        try:
            return to_reward_result({"reward": body["reward"],
                                     "components": body.get("components") or {}},
                                    source=self.url)
        except BadInputError as e:
            raise RewardError(str(e)) from e

    def close(self) -> None:
        self._client.close()
