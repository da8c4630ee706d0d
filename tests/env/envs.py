"""Environments the tests load by module:Class (in-process and through `rltool env serve`)."""

from __future__ import annotations

import time

from rltool.env.base import Environment, StepResult


def turn_reward(text: str) -> float:
    """A reward the test can recompute from the shard: 0.1 x (letters in the turn mod 3)."""
    return 0.1 * (sum(ch.isalpha() for ch in text) % 3)


class Scripted(Environment):
    """Three turns; each turn's reward is turn_reward(its text); verify adds 1.0 when the task's
    label is "bonus". Prompt ids whose metadata says so hang or raise in step 1."""

    name = "scripted"
    description = "test environment with known rewards"

    def reset(self, *, seed, task):
        self.turn, self.task = 0, task
        self.seen = []
        return [{"role": "user", "content": str(task["prompt"])}]

    def step(self, action):
        self.turn += 1
        fault = (self.task.get("metadata") or {}).get("fault")
        if self.turn == 2 and fault == "hang":
            time.sleep(8.0)
        if self.turn == 2 and fault == "raise":
            raise RuntimeError("scripted crash")
        reward = turn_reward(action["content"])
        if self.turn == 3:
            return StepResult(reward=reward, done=True)
        return StepResult(observation=[{"role": "tool", "content": f"turn {self.turn} ok"}],
                          reward=reward)

    def verify(self):
        return 1.0 if self.task.get("label") == "bonus" else None


class Slow(Environment):
    name = "slow"

    def reset(self, *, seed, task):
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        time.sleep(2.0)
        return StepResult(done=True)


class Crashing(Environment):
    name = "crashing"

    def reset(self, *, seed, task):
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        raise RuntimeError("boom")
