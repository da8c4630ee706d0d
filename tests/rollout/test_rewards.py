"""The reward registry: task, generic, math, custom module:function and remote URL rewards."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rltool.data.tasks import TASKS
from rltool.errors import BadInputError, EngineTimeoutError, RewardError
from rltool.rollout.rewards import (RewardResult, extract_math_answer, normalize_math_answer,
                                    resolve_reward)

SLOW_CAP_S = 60.0  # bounds a hang of the "slow" answer only; the tests never wait for it


def test_task_rewards_exact_and_partial():
    exact, partial = resolve_reward("reverse"), resolve_reward("reverse:partial")
    assert resolve_reward("reverse:exact")("p", "4321", "4321", {}) == RewardResult(1.0, {"exact": 1.0})
    assert exact("reverse 1234", "4321\nextra lines", "4321", {}).reward == 1.0
    assert exact("reverse 1234", "4321<|im_end|>", "4321", {}).reward == 1.0
    assert exact("reverse 1234", "4331", "4321", {}).reward == 0.0
    r = partial("reverse 1234", "4331", "4321", {})
    assert r.reward == pytest.approx(0.75) and r.components == {"exact": 0.0, "partial": 0.75}
    # extra characters cost credit; never below 0
    assert partial("", "432199", "4321", {}).reward == pytest.approx(0.5)
    assert partial("", "99999999", "4321", {}).reward == 0.0


def test_add_partial_credit_is_aligned_at_the_units_digit():
    add = resolve_reward("add:partial")
    assert add("", "1235", "1234", {}).reward == pytest.approx(0.75)
    assert add("", "234", "1234", {}).reward == pytest.approx(0.75)  # dropped leading digit
    assert resolve_reward("reverse:partial")("", "234", "1234", {}).reward == 0.0


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_labels_earn_full_reward(task):
    from rltool.data.tasks import make_rows

    for row in make_rows(task, num=20, seed=3):
        for spec in (task, f"{task}:partial"):
            assert resolve_reward(spec)(row["prompt"], row["label"], row["label"], {}).reward == 1.0


def test_generic_label_rewards():
    assert resolve_reward("exact")("", " ok \n", "ok", {}).reward == 1.0
    assert resolve_reward("partial")("", "ab", "abcd", {}).reward == pytest.approx(0.5)
    with pytest.raises(BadInputError, match="needs a label"):
        resolve_reward("exact")("", "ok", None, {})


@pytest.mark.parametrize("response,label,correct", [
    (r"so the answer is \boxed{\frac{7}{2}}", "3.50", 1.0),
    (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0),
    ("total: 1,000.", "1000", 1.0),
    ("#### 72", "72", 1.0),
    ("x = 3, y = 4,", "4", 1.0),  # a trailing comma is not a thousands separator
    (r"first 5 then \boxed{6} finally 7", "6", 1.0),  # boxed wins over the last number
    (r"\boxed{\$5}", "5", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{x + 1}", "x+1", 1.0),
    (r"\boxed{\text{blue}}", "blue", 1.0),
    ("-3/4", "-0.75", 1.0),
    ("it is 12", "13", 0.0),
    ("1,2", "12", 0.0),
    ("I do not know", "1", 0.0),
])
def test_math_reward(response, label, correct):
    r = resolve_reward("math")("q", response, label, {})
    assert r.reward == correct


def test_math_helpers():
    from fractions import Fraction

    assert extract_math_answer(r"\boxed{\frac{1}{\sqrt{2}}}") == r"\frac{1}{\sqrt{2}}"
    assert extract_math_answer(r"cut \boxed{12") == "12"  # unbalanced box: fall back to a number
    assert extract_math_answer("none") is None
    assert normalize_math_answer("1,000") == 1000
    assert normalize_math_answer("3.50") == Fraction(7, 2)
    assert normalize_math_answer("1/0") == "1/0"
    assert resolve_reward("math")("", "nothing", "1", {}).components == {"correct": 0.0,
                                                                         "has_answer": 0.0}
    assert resolve_reward("math")("", r"\boxed{2}", r"\boxed{2.0}", {}).reward == 1.0


def test_bad_specs_are_bad_input():
    for spec, match in [("", "empty"), ("nope", "names no reward"),
                        ("reverse:bogus", "reverse:partial"),
                        ("no_such_module_xyz:fn", "cannot import"),
                        ("json:no_such_fn", "has no function"), ("missing.py:f", "no such file"),
                        ("http://exa mple.com:xx/", "not a valid URL")]:
        with pytest.raises(BadInputError, match=match):
            resolve_reward(spec)


def test_custom_reward_from_a_file(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "def length(prompt, response, label, metadata):\n"
        "    return len(response) / metadata['scale']\n"
        "def parts(prompt, response, label, metadata):\n"
        "    return {'reward': 2, 'fmt': 1.0, 'ok': True}\n"
        "def nested(prompt, response, label, metadata):\n"
        "    return {'reward': 0.5, 'components': {'a': 0.25}}\n"
        "def nokey(prompt, response, label, metadata):\n"
        "    return {'score': 1}\n"
        "def nan(prompt, response, label, metadata):\n"
        "    return float('nan')\n"
        "def text(prompt, response, label, metadata):\n"
        "    return 'high'\n"
        "def boom(prompt, response, label, metadata):\n"
        "    raise ZeroDivisionError('oops')\n")
    assert resolve_reward(f"{f}:length")("", "abcd", None, {"scale": 2}) == RewardResult(2.0, {})
    assert resolve_reward(f"{f}:parts")("", "", None, {}) == RewardResult(2.0, {"fmt": 1.0, "ok": 1.0})
    assert resolve_reward(f"{f}:nested")("", "", None, {}) == RewardResult(0.5, {"a": 0.25})
    with pytest.raises(BadInputError, match="without a 'reward' key"):
        resolve_reward(f"{f}:nokey")("", "", None, {})
    with pytest.raises(BadInputError, match="finite"):
        resolve_reward(f"{f}:nan")("", "", None, {})
    with pytest.raises(BadInputError, match="must be a number"):
        resolve_reward(f"{f}:text")("", "", None, {})
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        resolve_reward(f"{f}:boom")("", "", None, {})


def test_custom_reward_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "rltool_test_rm.py").write_text(
        "def fn(prompt, response, label, metadata):\n    return float(response == label)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("rltool_test_rm:fn")
    assert fn("", "a", "a", {}).reward == 1.0 and fn("", "a", "b", {}).reward == 0.0


class _RewardHandler(BaseHTTPRequestHandler):
    """Scores len(response) / 10; `response == "slow"` does not answer until the server's
    `release` event is set (at teardown; a generous cap only bounds a hang); `"bad"` answers 500;
    `"garbage"` answers non-JSON; `"nokey"` answers JSON without a reward."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        response = body["response"]
        if response == "slow":
            self.server.release.wait(SLOW_CAP_S)
        status, payload = 200, {"reward": len(response) / 10, "components": {"len": len(response)}}
        if response == "bad":
            status, payload = 500, {"error": "model crashed"}
        if response == "nokey":
            payload = {"score": 1}
        data = b"not json" if response == "garbage" else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client timed out on the slow request: expected in the timeout test

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardHandler)
    server.seen = []
    server.release = threading.Event()
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/score"
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_remote_reward(reward_server):
    server, url = reward_server
    fn = resolve_reward(url, timeout_s=5.0)
    assert fn("p", "abcd", "x", {"m": 1}) == RewardResult(0.4, {"len": 4.0})
    assert server.seen[-1] == {"prompt": "p", "response": "abcd", "label": "x"}
    # thread-safe: the rollout stage scores from worker threads
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda n: fn("p", "a" * n, None, {}).reward, range(8)))
    assert out == pytest.approx([n / 10 for n in range(8)])
    for response, match in [("bad", "HTTP 500"), ("garbage", "non-JSON"), ("nokey", "'reward'")]:
        with pytest.raises(RewardError, match=match):
            fn("p", response, None, {})
    fn.close()


def test_remote_reward_timeout(reward_server):
    """A reward model that does not answer makes the call fail with EngineTimeoutError after the
    reward timeout. Checked without timing the call: the server holds the answer until the test
    ends (an answer only comes after SLOW_CAP_S, far beyond the timeout), so the call can only
    return by timing out; one that waited for the server would get a reward and fail the test."""
    server, url = reward_server
    fn = resolve_reward(url, timeout_s=0.2)
    with pytest.raises(EngineTimeoutError, match="within 0.2 s"):
        fn("p", "slow", None, {})
    assert server.seen[-1]["response"] == "slow"  # it reached the server, which never answered
    assert not server.release.is_set()
    fn.close()


def test_remote_reward_unreachable():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fn = resolve_reward(f"http://127.0.0.1:{port}/", timeout_s=2.0)
    with pytest.raises(RewardError, match="unreachable"):
        fn("p", "r", None, {})
    fn.close()
