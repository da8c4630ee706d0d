"""Multi-turn generation with a tool, and the built-in calculator environment.

`multi_turn` is the loop: the model generates until it stops; `tool(turn_text)` looks at what it
wrote and either returns an observation (appended as tokens with loss_mask 0, logprob 0.0 and
weight version -1; then the model continues) or None (the episode ends). Every turn is sent as
token ids, `sample.prompt_token_ids + sample.response_token_ids`, to the same engine (sticky
session routing), so nothing already generated is ever re-tokenized or re-templated.

The calculator (`--generate-fn rltool.rollout.calculator:generate`): the model writes
`<calc>EXPR</calc>`; generation stops at `</calc>`, EXPR (numbers, + - * / // % **, parentheses)
is evaluated safely (rltool.env.arith: bounded in size and work; `error` for anything it
cannot evaluate) and
`<result>VALUE</result>` is appended for the model to continue from.
The observation stays inside the assistant turn (as in Search-R1-style tool use) rather than in a
separate tool-role message, so the character tokenizer of the tiny models can express it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rltool.env.arith import evaluate
from rltool.rollout.generate import GenerateContext, Sample, finish_label

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
MAX_TURNS = 4

Tool = Callable[[str, dict[str, Any]], "str | None"]


async def multi_turn(sample: Sample, ctx: GenerateContext, *, tool: Tool,
                     max_turns: int = MAX_TURNS, stop: list[str] | None = None,
                     turn_max_new_tokens: int | None = None) -> Sample:
    """Alternate model turns and tool observations within the response budget.

    `tool(turn_text, finish)` gets the decoded text of the model's last turn and its
    finish_reason dict (`{"type": "stop", "matched": "</calc>"}`), and returns the observation
    text or None to end the episode.
    """
    limit = ctx.sampling["max_response_len"]
    for turn in range(max_turns):
        budget = limit - len(sample.response_token_ids)
        if budget <= 0:
            sample.status, sample.finish_reason = "truncated", "length"
            return sample
        max_new = min(budget, turn_max_new_tokens) if turn_max_new_tokens else budget
        extra = {"stop": stop} if stop else {}
        payload = {"input_ids": sample.tokens, "return_logprob": True,
                   "sampling_params": ctx.sampling_params(max_new_tokens=max_new, turn=turn,
                                                          sample=sample, **extra)}
        response = await ctx.client.generate(payload, sticky=True)
        start = len(sample.response_token_ids)
        finish_type = sample.append_engine_output(response)
        sample.finish_reason = finish_label(finish_type, response)
        if finish_type == "abort":
            sample.status = "aborted"
            return sample
        finish = response.get("meta_info", {}).get("finish_reason") or {}
        turn_text = ctx.tokenizer.decode(sample.response_token_ids[start:],
                                         skip_special_tokens=True)
        observation = tool(turn_text, finish)
        if observation is None:
            ran_out = finish_type == "length" and len(sample.response_token_ids) >= limit
            sample.status = "truncated" if ran_out else "completed"
            return sample
        obs_ids = list(ctx.tokenizer.encode(observation, add_special_tokens=False))
        room = limit - len(sample.response_token_ids)
        sample.append_tool_tokens(obs_ids[:room])
        sample.metadata["tool_calls"] = sample.metadata.get("tool_calls", 0) + 1
        if len(obs_ids) > room:
            sample.status, sample.finish_reason = "truncated", "length:tool_output"
            return sample
    sample.status, sample.finish_reason = "completed", "max_turns"
    return sample


def calculator_tool(turn_text: str, finish: dict[str, Any]) -> str | None:
    """Observation for a turn that stopped on `</calc>`; None when the model did not call the tool."""
    if not (isinstance(finish, dict) and finish.get("type") == "stop"
            and finish.get("matched") == CALL_CLOSE):
        return None
    head, sep, expr = turn_text.rpartition(CALL_OPEN)
    if not sep:
        return None
    expr = expr.removesuffix(CALL_CLOSE)
    # The engine trims the matched stop string from the text but not from the tokens; close the
    # call in the observation only when the tokens lack it.
    prefix = "" if turn_text.endswith(CALL_CLOSE) else CALL_CLOSE
    return f"{prefix}<result>{evaluate(expr)}</result>\n"


async def generate(sample: Sample, ctx: GenerateContext) -> Sample:
    """`--generate-fn rltool.rollout.calculator:generate`: the calculator environment."""
    return await multi_turn(sample, ctx, tool=calculator_tool, stop=[CALL_CLOSE],
                            max_turns=int(ctx.options.get("max_turns", MAX_TURNS)))
