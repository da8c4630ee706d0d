"""Hostile or malformed input on the builtin engine's HTTP routes: a 4xx naming the problem, never
a 500, unbounded work or a retryable refusal of what can never fit; engine failures surface on
every generation route."""

from __future__ import annotations

import shutil

import pytest

from rltool.engine.config import ServeConfig
from rltool.engine.request import Request
from rltool.engine.sampling import SamplingParams
from tests.helpers.engines import serve_app

pytestmark = pytest.mark.timeout(120)
MAX_RUNNING, MAX_QUEUED = 4, 8
MOST = MAX_RUNNING + MAX_QUEUED  # the most requests one body can ever hold
JSON = {"content-type": "application/json"}
DEEP = 100_000


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """(TestClient, runner) of an engine that takes MOST requests and reloads weights from under
    the session's temporary directory."""
    cfg = ServeConfig(model=tiny_model_dir, device="cpu", max_running_requests=MAX_RUNNING,
                      max_queued_requests=MAX_QUEUED,
                      allowed_weight_root=[tmp_path_factory.getbasetemp()])
    with serve_app(cfg) as served:
        yield served


@pytest.fixture
def client(engine):
    return engine[0]


def raw_post(client, path: str, content: bytes):
    return client.post(path, content=content, headers=JSON)


def one_token(client) -> None:
    """The engine still serves."""
    r = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text


TOO_MANY = [
    ("/generate", {"text": "a", "sampling_params": {"n": MOST + 1}}),
    ("/generate", {"text": "a", "sampling_params": {"n": 1_000_000}}),
    ("/generate", {"input_ids": [[5], [6], [7]], "sampling_params": {"n": MOST // 3 + 1}}),
    ("/v1/completions", {"prompt": "a", "n": MOST + 1}),
    ("/v1/completions", {"prompt": ["a", "b"], "n": MOST // 2 + 1}),
]


def test_more_samples_than_the_engine_holds_is_a_400(client):
    """A body of more requests (prompts x n) than the engine ever holds is a 400 naming the limit,
    answered before any request is built (n=1e6 included); a body of exactly the limit is
    served."""
    for path, body in TOO_MANY:
        r = client.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json() if path.startswith("/v1") else r.json()["error"]
        assert f"at most {MOST}" in error["message"] and "--max-queued-requests" in error["message"]
    r = client.post("/generate", json={"input_ids": [[5], [6]], "sampling_params": {
        "n": MOST // 2, "max_new_tokens": 1}})
    assert r.status_code == 200 and len(r.json()) == MOST


def test_token_ids_logprob_is_deduplicated_and_bounded(engine):
    """token_ids_logprob is de-duplicated and holds at most the vocabulary's size of ids (100k
    copies of one id would make a 28.5 MB answer)."""
    client, runner = engine
    r = client.post("/generate", json={
        "input_ids": [5, 6, 7], "return_logprob": True, "token_ids_logprob": [4, 5, 4, 4],
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    rows = r.json()["meta_info"]["output_token_ids_logprobs"]
    assert [[x[1] for x in row] for row in rows] == [[4, 5], [4, 5]]
    r = client.post("/generate", json={"input_ids": [5], "return_logprob": True,
                                       "token_ids_logprob": [4] * (runner.vocab_size + 1)})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "token_ids_logprob" in message and str(runner.vocab_size) in message


MALFORMED = {
    "deep": b'{"text": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "surrogate-text": b'{"text": "hi\\ud800"}',
    "surrogate-rid": b'{"text": "hi", "rid": "r\\ud800x"}',
    "not-utf8": b'{"text": "\xff\xfe"}',
}


def test_malformed_generate_body_is_a_400(client):
    """A deeply nested body, or a lone surrogate in text or rid, or bytes that are not UTF-8: a
    400 from /generate's JSON parser (the OpenAI routes' strictness), never a 500."""
    for name, content in MALFORMED.items():
        r = raw_post(client, "/generate", content)
        assert r.status_code == 400, (name, r.text)
        assert r.json()["object"] == "error" and "body is not valid JSON" in r.json()["message"]
    one_token(client)


def test_deeply_nested_tensor_message_is_a_400(client):
    r = client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": ["[" * DEEP], "load_format": "rltool_shm"})
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False
    assert "serialized_named_tensors[0] is not a tensor message" in r.json()["message"]


def test_chat_content_parts(client):
    """Chat content parts: text parts are joined, anything else is a 400 naming the part."""
    def chat(content):
        return client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 1})

    for content, match in ((["hi"], "messages[0].content[0] must be a content part"),
                           ([{"type": "image_url", "image_url": {"url": "x"}}], "only text"),
                           ([{"type": "text", "text": 5}], "messages[0].content[0].text")):
        r = chat(content)
        assert r.status_code == 400 and r.json()["object"] == "error", r.text
        assert match in r.json()["message"]
    parts = chat([{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}])
    assert parts.status_code == 200
    assert parts.json()["usage"]["prompt_tokens"] == chat("abc").json()["usage"]["prompt_tokens"]


def test_truncated_checkpoint_is_a_400(client, tiny_model_dir, tmp_path):
    """/update_weights_from_disk on a truncated model.safetensors: a 400 naming the file."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    r = client.post("/update_weights_from_disk", json={"model_path": str(broken)})
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and str(f) in r.json()["message"]
    one_token(client)


def test_openai_routes_surface_engine_failures(engine, monkeypatch):
    """A request the engine failed (status 500) is a 500 on the OpenAI routes too, as on
    /generate, not a 200 with finish_reason "abort"."""
    client, runner = engine

    def broken(*_args, **_kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, "full_pass_logits", broken)
    body = {"prompt": "ab", "max_tokens": 2, "echo": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500, r.text
    assert r.json()["object"] == "error" and "injected failure" in r.json()["message"]
    chunks = client.post("/v1/completions", json={**body, "stream": True}).text
    assert '"error"' in chunks and "injected failure" in chunks and '"code": 500' in chunks


def test_openai_duplicate_rid_uses_the_error_object(client):
    """A duplicate rid is a 400 in OpenAI's error object."""
    sched = client.app.state.engine.scheduler
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        sched.submit([Request(rid="dup", prompt_ids=[5], params=SamplingParams(max_new_tokens=1))])
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "rid": "dup"})
    finally:
        assert client.post("/continue_generation", json={}).status_code == 200
    assert r.status_code == 400, r.text
    assert r.json()["object"] == "error" and "duplicate request id" in r.json()["message"]
