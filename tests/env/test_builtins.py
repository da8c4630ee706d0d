"""The built-in environments, step by step."""

from __future__ import annotations

import pytest

from rltool.env.base import load_env_class

CALL = {"type": "stop", "matched": "</calc>"}


def test_calculator_answers_calls_and_scores_the_final_answer():
    env = load_env_class("calculator")()
    assert env.reset(seed=0, task={"prompt": "3*4+1?", "label": "13"}) == [
        {"role": "user", "content": "3*4+1?"}]
    r = env.step({"content": "ok <calc>3*4</calc>", "finish": CALL})
    assert (r.observation, r.reward, r.done) == ([{"role": "tool", "content": "12"}], 0.0, False)
    # The engine drops the matched stop string from the text; the finish still says it matched.
    assert env.step({"content": "<calc>2**", "finish": CALL}).observation[0]["content"] == "error"
    assert (env.step({"content": "so 13"}).reward, env.step({"content": "so 12"}).reward) == (
        1.0, 0.0)


def test_python_runs_code_in_the_sandbox_and_reports_limits():
    env = load_env_class("python")()
    env.reset(seed=0, task={"prompt": "?", "label": "6"})
    r = env.step({"content": "<python>print(2*3)</python>",
                  "finish": {"type": "stop", "matched": "</python>"}})
    assert r.observation == [{"role": "tool", "content": "6"}]
    assert r.info["sandbox"]["killed"] is None and r.info["sandbox"]["exit_code"] == 0
    r = env.step({"content": "<python>x = bytearray(1 << 31)</python>"})
    assert r.observation[0]["content"].endswith("memory limit 256 MiB hit (MemoryError)")
    assert env.step({"content": "it is 6"}).reward == 1.0


@pytest.mark.parametrize("label, guesses, rewards", [
    ("10", ["32", "16", "40", "8", "10"], [0.1, 0.1, 0.0, 0.1, 1.0]),
    (None, ["say"], [0.0]),
])
def test_guess_rewards_consistent_guesses(label, guesses, rewards):
    env = load_env_class("guess")()
    env.reset(seed=1, task={"label": label})
    got = [env.step({"content": g}) for g in guesses]
    assert [r.reward for r in got] == rewards
    assert got[-1].done == (label is not None)


def test_guess_draws_the_number_from_the_seed():
    a, b = load_env_class("guess")(), load_env_class("guess")()
    a.reset(seed=5, task={}), b.reset(seed=5, task={})
    assert a.secret == b.secret and 1 <= a.secret <= 64


def test_tool_calls_are_parsed_from_the_turn():
    from rltool.env.base import parse_tool_calls

    text = ('let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call> and <tool_call>{"name": "now"}</tool_call><tool_call>oops</tool_call>'
            '<tool_call>[1]</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[:2] == [{"name": "add", "arguments": {"a": 1, "b": 2}},
                         {"name": "now", "arguments": {}}]
    assert calls[2]["error"].startswith("not JSON") and calls[2]["raw"] == "oops"
    assert calls[3] == {"error": "not an object with a name", "raw": "[1]"}
    assert parse_tool_calls("no calls here") == []
