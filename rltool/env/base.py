"""The environment interface.

An environment is one episode's state. The rollout (rltool.rollout.episode) drives it:

    messages = env.reset(seed=seed, task=task)      # the conversation the model starts from
    while not done:
        ... the model writes one assistant turn ...
        result = env.step({"role": "assistant", "content": text, "finish": finish,
                           "tool_calls": [...]})   # tool_calls: parsed <tool_call> blocks
        # result.observation: messages appended after the turn (tool results, user replies)
        # result.reward: this turn's reward; result.done: the episode is over
    final = env.verify()                            # optional end-of-episode reward (None: none)
    env.close()

`task` is the prompt row: {"prompt": str | [messages], "label": str | None, "metadata": {...},
"prompt_id": str}. `seed` is the same for every sample of a group, so GRPO compares samples of
one task instance. `stop` lists the strings a tool call ends with; the engine stops there so the
environment can answer the call before the model goes on. Methods are synchronous: the rollout
runs each in a worker thread under a per-step timeout (`--env-step-timeout-s`), so a slow tool
does not stall generation. An exception or a timeout fails the episode (`env_error`,
`env_timeout`), never the rollout step.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rltool.errors import BadInputError, RltoolError

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]


class EnvError(RltoolError):
    """An environment failed (raised, timed out, or answered something malformed)."""


class EnvTimeoutError(EnvError):
    """An environment call ran past its timeout."""


@dataclass
class StepResult:
    """What one step gives back: messages to append, the turn's reward, whether it ended."""

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"observation": self.observation, "reward": self.reward, "done": self.done,
                "info": self.info}

    @classmethod
    def from_json(cls, value: Any, *, where: str) -> "StepResult":
        """A step's answer checked: a StepResult or its JSON form; EnvError when malformed."""
        if isinstance(value, StepResult):
            value = value.to_json()
        if not isinstance(value, dict):
            raise EnvError(f"{where}: a step result must be an object, got {type(value).__name__}")
        reward = value.get("reward", 0.0)
        if (isinstance(reward, bool) or not isinstance(reward, (int, float))
                or not math.isfinite(reward)):
            raise EnvError(f"{where}: reward must be a finite number, got {reward!r}")
        info = value.get("info") or {}
        if not isinstance(info, dict):
            raise EnvError(f"{where}: info must be an object")
        return cls(observation=check_messages(value.get("observation") or [], where=where),
                   reward=float(reward), done=bool(value.get("done", False)), info=info)


def check_messages(messages: Any, *, where: str) -> list[Message]:
    """Messages as a list of {role, content} dicts with a known role; EnvError otherwise."""
    if not isinstance(messages, list):
        raise EnvError(f"{where}: messages must be a list, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES
                and isinstance(m.get("content"), str)):
            raise EnvError(f"{where}: message {i} must be {{'role': one of {ROLES}, "
                           f"'content': str}}, got {str(m)[:80]}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The JSON tool calls of an assistant turn in the Hermes / Qwen form
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, in order; a block that is not
    such an object is kept as {"error": why, "raw": text} so the environment can answer it."""
    calls: list[dict[str, Any]] = []
    for raw in TOOL_CALL.findall(text):
        try:
            value = json.loads(raw)
        except ValueError as e:
            calls.append({"error": f"not JSON: {e}", "raw": raw})
            continue
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            calls.append({"error": "not an object with a name", "raw": raw})
            continue
        calls.append({"name": value["name"], "arguments": value.get("arguments") or {}})
    return calls


def task_messages(task: dict[str, Any]) -> list[Message]:
    """The prompt of a task row as messages (a string is the user turn)."""
    prompt = task.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return check_messages(prompt, where="task prompt")


class Environment:
    """Base class of environments; subclasses implement `reset` and `step`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    stop: ClassVar[list[str]] = []  # strings that end a tool call (the engine stops on them)

    def reset(self, *, seed: int, task: dict[str, Any]) -> list[Message]:
        raise NotImplementedError

    def step(self, action: dict[str, Any]) -> StepResult:
        raise NotImplementedError

    def verify(self) -> float | None:
        """A reward for the whole episode, added to its last turn's; None: nothing to add."""
        return None

    def close(self) -> None:
        """Release what the episode holds (processes, files)."""


def load_env_class(spec: str) -> type[Environment]:
    """A built-in name or `module:Class` -> the environment class; BadInputError otherwise."""
    import importlib

    from rltool.env.builtins import BUILTINS

    if spec in BUILTINS:
        return BUILTINS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise BadInputError(f"--env {spec!r} is neither a built-in environment "
                            f"({', '.join(sorted(BUILTINS))}) nor module:Class; `rltool env list` "
                            "shows the built-ins")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BadInputError(f"--env {spec!r}: cannot import {module_name} ({e}); is it on "
                            "PYTHONPATH?") from e
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and callable(getattr(cls, "reset", None))
            and callable(getattr(cls, "step", None))):
        raise BadInputError(f"--env {spec!r}: {module_name}.{attr} is not an environment class "
                            "(a class with reset(seed=, task=) and step(action) methods)")
    return cls
