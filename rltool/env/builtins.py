"""The built-in environments (`rltool env list`).

- calculator: the model writes `<calc>EXPR</calc>`; the tool answers with the value
  (rltool.env.arith.evaluate: bounded arithmetic, no names or calls) as a tool message;
  an answer without a call ends the episode, reward 1 when its last number equals the label.
- python: the model writes `<python>CODE</python>`; the code runs in the sandbox
  (rltool.env.sandbox) and its output, or the limit it hit, comes back as a tool message; the
  final answer is scored like the calculator's.
- guess: a multi-step game. The environment holds a number in [1, 64] (the label's, else drawn
  from the seed); each turn the model guesses, the environment answers "higher" or "lower";
  reward 0.1 for a guess inside the range the hints so far allow, 1.0 for the number (done).
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from rltool.env.base import Environment, Message, StepResult, task_messages

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text)
    return float(found[-1]) if found else None


def answer_reward(text: str, label: str | None) -> float:
    """1.0 when the last number of `text` equals the label's number, else 0.0."""
    if label is None:
        return 0.0
    want, got = last_number(str(label)), last_number(text)
    return float(want is not None and got is not None and abs(want - got) < 1e-6)


def tool_call(action: dict[str, Any], open_tag: str, close_tag: str) -> str | None:
    """The body of the tool call the turn ended with, or None when it made none.

    The engine stops on the closing tag; its tokens keep the tag even where its text drops it,
    so a turn that stopped on it (finish `{"type": "stop", "matched": close_tag}`) or ends with it
    is a call."""
    text = action.get("content", "")
    finish = action.get("finish") or {}
    stopped = isinstance(finish, dict) and finish.get("matched") == close_tag
    if not (stopped or text.rstrip().endswith(close_tag)):
        return None
    _, sep, body = text.rpartition(open_tag)
    if not sep:
        return None
    return body.rstrip().removesuffix(close_tag)


class _ToolEnv(Environment):
    """A tool the model calls with `<tag>...</tag>`; a turn without a call is the final answer."""

    open_tag: ClassVar[str] = ""
    close_tag: ClassVar[str] = ""

    def reset(self, *, seed: int, task: dict[str, Any]) -> list[Message]:
        self.label = task.get("label")
        self.calls = 0
        return task_messages(task)

    def step(self, action: dict[str, Any]) -> StepResult:
        body = tool_call(action, self.open_tag, self.close_tag)
        if body is None:
            return StepResult(reward=answer_reward(action.get("content", ""), self.label),
                              done=True, info={"tool_calls": self.calls})
        self.calls += 1
        content, info = self.run_tool(body)
        return StepResult(observation=[{"role": "tool", "content": content}], info=info)

    def run_tool(self, body: str) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError


class CalculatorEnv(_ToolEnv):
    name = "calculator"
    description = ("arithmetic tool: <calc>EXPR</calc> -> the value; reward 1 when the final "
                   "answer's last number equals the label")
    open_tag, close_tag = "<calc>", "</calc>"
    stop = ["</calc>"]

    def run_tool(self, body: str) -> tuple[str, dict[str, Any]]:
        from rltool.env.arith import evaluate

        return evaluate(body), {}


class PythonEnv(_ToolEnv):
    name = "python"
    description = ("code execution: <python>CODE</python> runs in the sandbox (uid 65534, no "
                   "network, CPU/wall/memory/process/output limits) -> its output; reward as "
                   "calculator")
    open_tag, close_tag = "<python>", "</python>"
    stop = ["</python>"]

    def __init__(self, limits: Any = None):
        from rltool.env.sandbox import Limits

        self.limits = limits or Limits()

    def run_tool(self, body: str) -> tuple[str, dict[str, Any]]:
        from rltool.env.sandbox import run_python

        result = run_python(body, limits=self.limits)
        return result.report(), {"sandbox": {"killed": result.killed,
                                             "exit_code": result.exit_code,
                                             "isolation": result.isolation}}


class GuessEnv(Environment):
    name = "guess"
    description = ("multi-step: guess a number in [1, 64] from higher/lower hints; 0.1 per "
                   "consistent guess, 1.0 for the number")
    low, high = 1, 64

    def reset(self, *, seed: int, task: dict[str, Any]) -> list[Message]:
        label = last_number(str(task.get("label") or ""))
        self.secret = int(label) if label is not None else random.Random(seed).randint(
            self.low, self.high)
        self.lo, self.hi = self.low, self.high
        prompt = task.get("prompt") or (f"guess my number from {self.low} to {self.high}. "
                                        "answer with one number.")
        return task_messages({"prompt": prompt})

    def step(self, action: dict[str, Any]) -> StepResult:
        guess = last_number(action.get("content", ""))
        if guess is None:
            return StepResult(observation=[{"role": "user", "content": "say one number."}])
        guess_int = int(guess)
        if guess_int == self.secret:
            return StepResult(reward=1.0, done=True, info={"secret": self.secret})
        consistent = self.lo <= guess_int <= self.hi
        if guess_int < self.secret:
            self.lo = max(self.lo, guess_int + 1)
            hint = "higher."
        else:
            self.hi = min(self.hi, guess_int - 1)
            hint = "lower."
        return StepResult(observation=[{"role": "user", "content": hint}],
                          reward=0.1 if consistent else 0.0)


BUILTINS: dict[str, type[Environment]] = {
    cls.name: cls for cls in (CalculatorEnv, PythonEnv, GuessEnv)}
