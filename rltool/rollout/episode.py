"""Episodes against an environment (`--env NAME|module:Class|URL`): the agentic generate function.

One sample is one episode. `env.reset(seed, task)` gives the opening messages, rendered once with
the chat template (`add_generation_prompt`) as the sample's prompt tokens. Then, turn by turn:
the engine generates from `sample.tokens` (token ids in, token ids out: its output ids are
appended exactly as it returned them, loss_mask 1, with its logprobs and weight versions), the
decoded turn goes to `env.step`, and the observation messages it returns are rendered through the
chat template and tokenized once (`ChatRenderer.observation_ids`), appended with loss_mask 0,
logprob 0.0 and version -1. Nothing already in the sample is ever re-tokenized, so the trainer
sees exactly the tokens the engine produced.

The episode ends when the environment says done, after `--max-turns` model turns, or when the
response budget (`--max-response-len`, all turns and observations) runs out. Each turn's reward
goes to `turn_rewards`, the response offset where each model turn starts to `turn_starts`; an
end-of-episode `verify()` reward is added to the last turn's; the episode reward (`reward`) is
their sum. Environment calls run in worker threads under `--env-step-timeout-s`; a call that
raises or times out fails the episode (`env_error: ...`, `env_timeout: ...`), not the step.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

from rltool.env.base import (EnvError, EnvTimeoutError, Environment, StepResult, check_messages,
                             parse_tool_calls)
from rltool.env.threads import CallLimiter, call_in_thread
from rltool.errors import BadInputError
from rltool.rollout.generate import GenerateContext, GenerateFn, Sample, derive_seed, finish_label

log = logging.getLogger(__name__)
MARK = "rltoolmark"  # placeholder content; lower-case letters survive every tokenizer's charset


class ChatRenderer:
    """Environment messages as token ids, through the tokenizer's chat template.

    An observation is the template's rendering of the messages after an assistant turn: the text
    that `[u, a] + observation` with a generation prompt adds to `[u, a]`. Before it comes
    whatever the template closes an assistant turn with (`<|im_end|>\\n`) minus the part the model
    already generated (an EOS token, when it stopped on one)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": MARK}, {"role": "assistant", "content": MARK}]
        self._base = self._render(base, generation_prompt=False)
        if self._base.count(MARK) != 2:
            raise BadInputError("the chat template does not render message contents verbatim; "
                                "--env needs a template that does")
        self.closing = self._base[self._base.rfind(MARK) + len(MARK):]
        self._base_messages = base

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self._render(messages, generation_prompt=True))

    def observation_text(self, turn_text: str, messages: list[dict[str, str]]) -> str:
        """What follows a model turn whose text (special tokens kept) is `turn_text`."""
        full = self._render(self._base_messages + messages, generation_prompt=True)
        if not full.startswith(self._base):
            raise BadInputError("the chat template renders earlier turns differently once more "
                                "messages follow; --env needs a prefix-stable template")
        closing = self.closing
        for k in range(len(closing), 0, -1):
            if turn_text.endswith(closing[:k]):
                closing = closing[k:]
                break
        return closing + full[len(self._base):]

    def observation_ids(self, turn_text: str, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.observation_text(turn_text, messages))


class EnvSource:
    """Makes one environment per episode from `--env`: a built-in name, module:Class, or the URL
    of `rltool env serve` (each episode a remote one)."""

    def __init__(self, spec: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 workers: int = 32):
        self.spec = spec
        # Environment calls run in threads of their own, at most `workers` at once (not on the
        # event loop's few default executor threads, so slow tools run side by side).
        self.limiter = CallLimiter(workers)
        self.remote = spec.startswith(("http://", "https://"))
        if self.remote:
            from rltool.env.remote import RemoteEnvClient

            self.client = RemoteEnvClient(spec, api_key=api_key, timeout_s=timeout_s)
            self.info = self.client.info()
            self.stop = list(self.info.get("stop") or [])
        else:
            from rltool.env.base import load_env_class

            self.cls = load_env_class(spec)
            self.stop = list(getattr(self.cls, "stop", []) or [])

    def make(self) -> Environment:
        if self.remote:
            return self.client.episode()
        return self.cls()


async def _call(fn: Any, *args: Any, timeout_s: float, what: str, limiter: Any = None,
                **kwargs: Any) -> Any:
    return await call_in_thread(fn, *args, timeout_s=timeout_s, what=what, limiter=limiter,
                                **kwargs)


def make_env_generate(source: EnvSource, *, max_turns: int, step_timeout_s: float,
                      tokenizer: Any, max_tokens_per_turn: int | None = None) -> GenerateFn:
    """The generate function of `--env`: one episode per sample (module docstring)."""
    renderer = ChatRenderer(tokenizer)

    async def generate(sample: Sample, ctx: GenerateContext) -> Sample:
        if sample.response_token_ids:
            return sample.fail("env_error: an episode cannot resume from a partial sample")
        try:
            env = await _call(source.make, timeout_s=step_timeout_s, what="creating the env",
                              limiter=source.limiter)
        except Exception as e:  # noqa: BLE001 - an environment failure fails the episode
            return sample.fail(_failure(e))
        try:
            return await run_episode(sample, ctx, env=env, renderer=renderer, stop=source.stop,
                                     max_turns=max_turns, step_timeout_s=step_timeout_s,
                                     max_tokens_per_turn=max_tokens_per_turn,
                                     limiter=source.limiter)
        except Exception as e:  # noqa: BLE001 - a raising, hanging or malformed env
            if not isinstance(e, EnvError):
                log.warning("environment failed on sample %s: %s: %s", sample.uid,
                            type(e).__name__, e)
            if sample.turn_starts is not None:  # the turn that failed has no reward
                sample.turn_rewards += [0.0] * (len(sample.turn_starts) - len(sample.turn_rewards))
            return sample.fail(_failure(e))
        finally:
            with contextlib.suppress(Exception):
                # Bounded by the step timeout: a hanging close must not hold the episode.
                await _call(env.close, timeout_s=step_timeout_s, what="close",
                            limiter=source.limiter)

    return generate


def _failure(e: BaseException) -> str:
    if isinstance(e, EnvTimeoutError):
        return f"env_timeout: {e}"
    if isinstance(e, EnvError):
        return f"env_error: {e}"
    return f"env_error: {type(e).__name__}: {e}"


async def run_episode(sample: Sample, ctx: GenerateContext, *, env: Environment,
                      renderer: ChatRenderer, stop: list[str], max_turns: int,
                      step_timeout_s: float, max_tokens_per_turn: int | None = None,
                      limiter: Any = None) -> Sample:
    seed = derive_seed(ctx.sampling.get("seed") or 0, f"group-{sample.group_id}", 0)
    task = {"prompt": _prompt_value(sample), "label": sample.label,
            "metadata": sample.metadata, "prompt_id": sample.prompt_id}
    messages = check_messages(await _call(env.reset, seed=seed, task=task, limiter=limiter,
                                          timeout_s=step_timeout_s, what="reset"),
                              where="env reset")
    sample.prompt_token_ids = renderer.prompt_ids(messages)
    sample.prompt = (messages[0]["content"] if len(messages) == 1 else
                     "\n".join(f"{m['role']}: {m['content']}" for m in messages))
    sample.turn_rewards, sample.turn_starts = [], []
    limit = ctx.sampling["max_response_len"]
    status, finish_reason = "completed", "max_turns"
    for turn in range(max_turns):
        budget = limit - len(sample.response_token_ids)
        if budget <= 0:
            status, finish_reason = "truncated", "length"
            break
        extra = {"stop": stop} if stop else {}
        if max_tokens_per_turn:
            budget = min(budget, max_tokens_per_turn)
        payload = {"input_ids": sample.tokens, "return_logprob": True,
                   "sampling_params": ctx.sampling_params(max_new_tokens=budget, turn=turn,
                                                          sample=sample, **extra)}
        response = await ctx.client.generate(payload, sticky=True)
        start = len(sample.response_token_ids)
        sample.turn_starts.append(start)
        finish_type = sample.append_engine_output(response)
        finish_reason = finish_label(finish_type, response)
        if finish_type == "abort":
            sample.turn_rewards.append(0.0)
            sample.status, sample.finish_reason = "aborted", finish_reason
            return sample
        finish = response.get("meta_info", {}).get("finish_reason") or {}
        ids = sample.response_token_ids[start:]
        text = ctx.tokenizer.decode(ids, skip_special_tokens=True)
        action = {"role": "assistant", "finish": finish if isinstance(finish, dict) else {},
                  "content": text, "tool_calls": parse_tool_calls(text)}
        result = await _call(env.step, action, timeout_s=step_timeout_s, what=f"step {turn}",
                             limiter=limiter)
        result = StepResult.from_json(result, where=f"env step {turn}")
        sample.turn_rewards.append(result.reward)
        if result.info:
            sample.metadata.setdefault("env_info", []).append(result.info)
        if result.done:
            status = "completed"
            break
        if finish_type == "length" and len(sample.response_token_ids) >= limit:
            status = "truncated"
            break
        obs = renderer.observation_ids(ctx.tokenizer.decode(ids, skip_special_tokens=False),
                                       result.observation)
        room = limit - len(sample.response_token_ids)
        sample.append_tool_tokens(obs[:room])
        if len(obs) > room:
            status, finish_reason = "truncated", "length:observation"
            break
    else:
        finish_reason = "max_turns"
    final = await _call(env.verify, timeout_s=step_timeout_s, what="verify", limiter=limiter)
    if final is not None:
        if isinstance(final, bool) or not isinstance(final, (int, float)) or not math.isfinite(
                final):
            raise EnvError(f"env verify: reward must be a finite number or None, got {final!r}")
        final = float(final)
        if sample.turn_rewards:
            sample.turn_rewards[-1] += final
        else:
            sample.turn_rewards.append(final)
            sample.turn_starts.append(len(sample.response_token_ids))
    sample.reward = float(sum(sample.turn_rewards))
    sample.rewards = {"env_turns": float(len(sample.turn_starts)),
                      **({"verify": final} if final is not None else {})}
    sample.status, sample.finish_reason = status, finish_reason
    return sample


def _prompt_value(sample: Sample) -> Any:
    """The task prompt as the prompt file gave it (a string or a chat list)."""
    row = sample.prompt_row
    return row.prompt if row is not None and hasattr(row, "prompt") else sample.prompt
