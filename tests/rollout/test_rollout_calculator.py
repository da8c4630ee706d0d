"""The calculator environment and the multi-turn loop, with a scripted engine: tool calls are
executed, observations get loss_mask 0 / logprob 0.0 / version -1, and every turn is sent as the
exact token continuation of the previous one."""

from __future__ import annotations

import asyncio

import pytest

from rltool.env import arith
from rltool.rollout.calculator import evaluate, generate
from rltool.rollout.generate import GenerateContext, Sample, SessionClient
from rltool.rollout.router import Router
from tests.helpers.scripted_engine import ScriptedEngine


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def run_calculator(tok, script, *, max_response_len=64):
    engine = ScriptedEngine(tok, script)
    prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "3*4+1?"}],
                                                    tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    sample = Sample(uid="u0", prompt_id="p0", group_id=0, sample_index=0, prompt="3*4+1?",
                    prompt_token_ids=prompt_ids)

    async def main():
        router = Router({engine.url: engine}, concurrency=1)
        ctx = GenerateContext(client=SessionClient(router, session_id="u0"),
                              sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                        "max_response_len": max_response_len, "seed": None},
                              tokenizer=tok)
        return await generate(sample, ctx)

    return asyncio.run(main()), engine, prompt_ids


def test_tool_call_is_executed_and_masked(tok):
    eos = tok.eos_token_id
    script = [("ok <calc>3*4</calc>", {"type": "stop", "matched": "</calc>"}),
              ("so 13" + tok.eos_token, {"type": "stop", "matched": eos})]
    sample, engine, prompt_ids = run_calculator(tok, script)
    turn1 = tok.encode("ok <calc>3*4</calc>", add_special_tokens=False)
    tool = tok.encode("<result>12</result>\n", add_special_tokens=False)
    turn2 = tok.encode("so 13" + tok.eos_token, add_special_tokens=False)
    assert sample.status == "completed" and sample.metadata["tool_calls"] == 1
    assert sample.response_token_ids == turn1 + tool + turn2
    assert sample.loss_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert sample.rollout_logprobs == [-0.25] * len(turn1) + [0.0] * len(tool) + [-0.25] * len(turn2)
    assert sample.weight_versions == [3] * len(turn1) + [-1] * len(tool) + [3] * len(turn2)
    # Token-in/token-out: turn 2 is conditioned on exactly prompt + turn 1 + tool tokens.
    assert engine.payloads[0]["input_ids"] == prompt_ids
    assert engine.payloads[1]["input_ids"] == prompt_ids + turn1 + tool
    assert engine.payloads[0]["sampling_params"]["stop"] == ["</calc>"]


def test_no_tool_call_ends_the_episode_and_budget_truncates(tok):
    sample, engine, _ = run_calculator(tok, [("12345", {"type": "length", "length": 5})],
                                       max_response_len=5)
    assert sample.status == "truncated" and len(engine.payloads) == 1
    script = [("<calc>1+1</calc>", {"type": "stop", "matched": "</calc>"})]
    sample, engine, _ = run_calculator(tok, script, max_response_len=20)
    # 16 model tokens leave room for 4 of the 20 observation tokens: truncated by the tool output.
    assert sample.status == "truncated" and sample.finish_reason == "length:tool_output"
    assert len(sample.response_token_ids) == 20 and sample.loss_mask[16:] == [0] * 4


@pytest.mark.parametrize("expr,want", [("3*4", "12"), ("(1+2)*-3", "-9"), ("7/2", "3.5"),
                                       ("2**10", "1024"), ("1/0", "error"), ("2**999", "error"),
                                       ("__import__('os')", "error"), ("a+1", "error"),
                                       ("1+", "error"), ("7//2", "3")])
def test_evaluate_is_safe_arithmetic(expr, want):
    assert evaluate(expr) == want


@pytest.mark.parametrize("expr", ["((9**64)**64)**2", "(((9**64)**64)**64)**64",
                                  "(2**64)**16", "(2**63)**16*(2**63)**16", "(-8)**0.5",
                                  "1e308*10", "1e999", "1j", "True", "0**-1", "-" * 100 + "1",
                                  "(" * 150 + "1" + ")" * 150])
def test_evaluate_is_bounded_and_never_raises(expr, monkeypatch):
    """Bug: `((9**64)**64)**2` raised in str() (an integer of ~7800 digits) and nested powers ran
    away in time and memory. The evaluator caps integer size, exponent and operation count and
    answers 'error' for anything it cannot evaluate. Its work is checked without timing it: every
    arithmetic operation it performs is counted and its integers measured. At most MAX_OPERATIONS
    operations run, none on an integer beyond MAX_INT_BITS bits, and none gives more than twice
    that (the product of two capped integers; a power is refused before it is computed)."""
    ops, operand_bits, result_bits = [], [0], [0]

    def counted(fn):
        def op(*args):
            ops.append(fn.__name__)
            operand_bits.extend(a.bit_length() for a in args if isinstance(a, int))
            result = fn(*args)
            if isinstance(result, int):
                result_bits.append(result.bit_length())
            return result
        return op

    monkeypatch.setattr(arith, "_BINARY", {k: counted(f) for k, f in arith._BINARY.items()})
    monkeypatch.setattr(arith, "_UNARY", {k: counted(f) for k, f in arith._UNARY.items()})
    assert evaluate(expr) == "error"
    assert len(ops) <= arith.MAX_OPERATIONS
    assert max(operand_bits) <= arith.MAX_INT_BITS, ops
    assert max(result_bits) <= 2 * arith.MAX_INT_BITS, ops


def test_evaluate_keeps_results_just_inside_the_caps():
    """The caps are exact: the largest integer allowed prints in full and matches Python."""
    assert evaluate("(2**63)**16") == str((2**63) ** 16)
    assert evaluate("9**64") == str(9**64)
    assert evaluate("-(2**62)**16*2**30") == str(-(2**62) ** 16 * 2**30)
    assert evaluate("(2**60)**17*1.0") == f"{float(2**1020):.6g}"
    assert evaluate("+".join(["1"] * 65)) == "65" and evaluate("+".join(["1"] * 66)) == "error"
