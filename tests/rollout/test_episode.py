"""Agentic episodes (rltool.rollout.episode) with a scripted engine and scripted environments:
the trained tokens are exactly the engine's output ids plus the environment's templated
observations, loss masks cover model tokens only, rewards per turn and per episode, and an
environment that raises, hangs or answers garbage fails its episode without failing the call."""

from __future__ import annotations

import asyncio
import time

import pytest

from rltool.env.base import Environment, StepResult
from rltool.rollout.episode import ChatRenderer, make_env_generate, EnvSource
from rltool.rollout.generate import GenerateContext, Sample, SessionClient
from rltool.rollout.router import Router
from tests.helpers.scripted_engine import ScriptedEngine as BaseScriptedEngine


class ScriptedEngine(BaseScriptedEngine):
    """A new weight version every turn, logprobs -0.5 - 0.01 * i."""

    def version(self) -> str:
        return str(len(self.payloads))

    def logprob(self, i: int) -> float:
        return -0.5 - 0.01 * i


class Countdown(Environment):
    """Three steps; rewards 0.25, 0.5, then done with 1.0; verify adds 2.0."""

    name = "countdown"
    stop = ["</go>"]

    def reset(self, *, seed, task):
        self.n = 0
        return [{"role": "system", "content": "count."}, {"role": "user", "content": task["prompt"]}]

    def step(self, action):
        self.n += 1
        if self.n == 3:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=[{"role": "tool", "content": f"left {3 - self.n}"}],
                          reward=0.25 * self.n)

    def verify(self):
        return 2.0


class Recording(Countdown):
    actions = []

    def step(self, action):
        Recording.actions.append(action)
        return super().step(action)


class Raising(Countdown):
    def step(self, action):
        raise RuntimeError("tool crashed")


class Hanging(Countdown):
    def step(self, action):
        time.sleep(4.0)
        return StepResult(done=True)


class Garbage(Countdown):
    def step(self, action):
        return StepResult(observation=[{"role": "robot", "content": 3}])


class NotANumber(Countdown):
    def step(self, action):
        return {"reward": float("nan"), "done": True}


class BadVerify(Countdown):
    def step(self, action):
        return {"reward": 1.0, "done": True}  # a dict is accepted as the step's answer

    def verify(self):
        return "yes"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def run(tok, env_cls, script, *, max_turns=8, max_response_len=200, timeout_s=5.0):
    engine = ScriptedEngine(tok, script)
    source = EnvSource(f"{__name__}:{env_cls.__name__}", workers=2)
    fn = make_env_generate(source, max_turns=max_turns, step_timeout_s=timeout_s, tokenizer=tok)
    sample = Sample(uid="u0", prompt_id="p0", group_id=0, sample_index=0, prompt="go",
                    prompt_token_ids=[])

    async def main():
        router = Router({engine.url: engine}, concurrency=1)
        ctx = GenerateContext(client=SessionClient(router, session_id="u0"),
                              sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                        "max_response_len": max_response_len, "seed": 7},
                              tokenizer=tok)
        return await fn(sample, ctx)

    return asyncio.run(main()), engine


def test_tokens_are_the_engines_plus_templated_observations(tok):
    eos = tok.eos_token
    script = [("a <go>", {"type": "stop", "matched": "</go>"}),  # stop string: no closing token
              ("b" + eos, {"type": "stop", "matched": tok.eos_token_id}),  # ended on EOS
              ("c" + eos, {"type": "stop", "matched": tok.eos_token_id})]
    sample, engine = run(tok, Countdown, script)
    enc = lambda text: tok.encode(text, add_special_tokens=False)
    turns = [enc(t) for t, _ in script]
    # Written out by hand from the tiny Qwen-style template: the model's turn is closed with
    # what it lacks of "<|im_end|>\n", the tool message follows, then the generation prompt.
    obs1 = enc("<|im_end|>\n<|im_start|>tool\nleft 2<|im_end|>\n<|im_start|>assistant\n")
    obs2 = enc("\n<|im_start|>tool\nleft 1<|im_end|>\n<|im_start|>assistant\n")
    prompt = enc("<|im_start|>system\ncount.<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n"
                 "<|im_start|>assistant\n")
    assert sample.prompt_token_ids == prompt
    assert sample.response_token_ids == turns[0] + obs1 + turns[1] + obs2 + turns[2]
    assert sample.loss_mask == ([1] * len(turns[0]) + [0] * len(obs1) + [1] * len(turns[1])
                                + [0] * len(obs2) + [1] * len(turns[2]))
    # Every request was the previous one's input plus what came back, never re-tokenized.
    inputs = [p["input_ids"] for p in engine.payloads]
    assert inputs[0] == prompt
    assert inputs[1] == prompt + turns[0] + obs1
    assert inputs[2] == inputs[1] + turns[1] + obs2
    assert all(p["sampling_params"]["stop"] == ["</go>"] for p in engine.payloads)
    # Logprobs and versions: the engine's for model tokens, 0.0 / -1 for observation tokens.
    lp = [-0.5 - 0.01 * i for i in range(len(turns[0]))]
    assert sample.rollout_logprobs[:len(turns[0]) + len(obs1)] == pytest.approx(
        lp + [0.0] * len(obs1))
    assert sample.weight_versions == ([1] * len(turns[0]) + [-1] * len(obs1) + [2] * len(turns[1])
                                      + [-1] * len(obs2) + [3] * len(turns[2]))
    start2 = len(turns[0]) + len(obs1)
    assert sample.turn_starts == [0, start2, start2 + len(turns[1]) + len(obs2)]
    assert sample.turn_rewards == [0.25, 0.5, 3.0]  # verify's 2.0 joins the last turn
    assert sample.reward == pytest.approx(3.75)
    assert sample.status == "completed"


def test_the_environment_gets_the_turns_text_finish_and_tool_calls(tok):
    Recording.actions.clear()
    script = [("a <go>", {"type": "stop", "matched": "</go>"}),
              ("b" + tok.eos_token, {"type": "stop", "matched": tok.eos_token_id}),
              ("c", {"type": "length", "length": 1})]
    run(tok, Recording, script)
    assert [(a["role"], a["content"], a["finish"], a["tool_calls"]) for a in Recording.actions] == [
        ("assistant", "a <go>", {"type": "stop", "matched": "</go>"}, []),
        ("assistant", "b", {"type": "stop", "matched": tok.eos_token_id}, []),
        ("assistant", "c", {"type": "length", "length": 1}, [])]


def test_max_turns_and_budget_end_the_episode(tok):
    go = ("x <go>", {"type": "stop", "matched": "</go>"})
    sample, _ = run(tok, Countdown, [go, go], max_turns=2)
    assert (sample.status, sample.finish_reason) == ("completed", "max_turns")
    assert len(sample.turn_starts) == len(sample.turn_rewards) == 2
    sample, _ = run(tok, Countdown, [go, go], max_response_len=12)
    assert sample.status == "truncated" and len(sample.response_token_ids) == 12
    assert len(sample.loss_mask) == 12


@pytest.mark.parametrize("env_cls, reason", [(Raising, "env_error: RuntimeError: tool crashed"),
                                             (Hanging, "env_timeout: step 0 took more than 1.5s"),
                                             (Garbage, "env_error: env step 0: message 0"),
                                             (NotANumber, "env_error: env step 0: reward must"),
                                             (BadVerify, "env_error: env verify: reward must")])
def test_env_failure_fails_the_episode(tok, env_cls, reason):
    sample, _ = run(tok, env_cls, [("y <go>", {"type": "stop", "matched": "</go>"})],
                    timeout_s=1.5)
    assert sample.status == "failed" and sample.finish_reason.startswith(reason)
    assert len(sample.turn_rewards) == len(sample.turn_starts) == 1


def test_renderer_refuses_template_that_drops_content(tok):
    from rltool.errors import BadInputError

    class Dropping:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(m["role"] for m in messages)

    with pytest.raises(BadInputError, match="verbatim"):
        ChatRenderer(Dropping())
