"""Multi-turn generation with a tool, and the built-in calculator environment.

`multi_turn` is the loop: the model generates until it stops; `tool(turn_text)` looks at what it
wrote and either returns an observation (appended as tokens with loss_mask 0, logprob 0.0 and
weight version -1; then the model continues) or None (the episode ends). Every turn is sent as
token ids, `sample.prompt_token_ids + sample.response_token_ids`, to the same engine (sticky
session routing), so nothing already generated is ever re-tokenized or re-templated.

The calculator (`--generate-fn rltool.rollout.calculator:generate`): the model writes
`<calc>EXPR</calc>`; generation stops at `</calc>`, EXPR (numbers, + - * / // % **, parentheses)
is evaluated safely (bounded in size and work; `error` for anything it cannot evaluate) and
`<result>VALUE</result>` is appended for the model to continue from.
The observation stays inside the assistant turn (as in Search-R1-style tool use) rather than in a
separate tool-role message, so the character tokenizer of the tiny models can express it.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from rltool.rollout.generate import GenerateContext, Sample, finish_label

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
MAX_TURNS = 4
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_EXPR_CHARS = 200
MAX_OPERATIONS = 64
MAX_INT_BITS = 1024  # ~308 decimal digits

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


def evaluate(expr: str) -> str:
    """Evaluate an arithmetic expression safely (no names, calls or attributes); 'error' if not.

    Bounded by construction: at most MAX_EXPR_CHARS characters and MAX_OPERATIONS operators,
    exponents of at most MAX_EXPONENT, and no integer (operand or result) beyond MAX_INT_BITS bits,
    checked before a power is computed; so every answer costs microseconds and prints (Python
    refuses str() of integers beyond ~4300 digits). Complex, infinite and NaN results are errors.
    """
    if len(expr) > MAX_EXPR_CHARS:
        return "error"
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
        if sum(isinstance(n, (ast.BinOp, ast.UnaryOp)) for n in ast.walk(tree)) > MAX_OPERATIONS:
            return "error"
        value = _eval(tree)
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError, MemoryError):
        return "error"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose exponent or integer result would exceed the caps, before computing it."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError("exponent too large")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        # With b = bit_length(base), base**exponent has more than (b - 1) * exponent bits and at
        # most b * exponent: refuse what is surely over the cap, and what passes has fewer than
        # MAX_INT_BITS + MAX_EXPONENT bits, cheap to compute before _checked applies the exact cap.
        if (abs(base).bit_length() - 1) * exponent >= MAX_INT_BITS:
            raise ValueError("result too large")


def _checked(value: object) -> int | float:
    """The value if it is a finite real within the integer cap; ValueError otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise ValueError("integer too large")
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError(f"not a finite real number: {type(value).__name__}")


async def generate(sample: Sample, ctx: GenerateContext) -> Sample:
    """`--generate-fn rltool.rollout.calculator:generate`: the calculator environment."""
    return await multi_turn(sample, ctx, tool=calculator_tool, stop=[CALL_CLOSE],
                            max_turns=int(ctx.options.get("max_turns", MAX_TURNS)))
