"""OpenAI-compatible routes of the live builtin engine: shapes, logprobs, streaming, errors."""

from __future__ import annotations

import json

import httpx

CHAT = {"model": "unknown", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 6,
        "temperature": 0}


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def events(url: str, path: str, body) -> list:
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_models_card(builtin_engine, tiny_model_dir):
    cards = httpx.get(builtin_engine.url + "/v1/models").json()
    assert cards["object"] == "list"
    card = cards["data"][0]
    assert card["owned_by"] == "sglang" and card["root"] == card["id"] and card["max_model_len"] > 0
    assert httpx.get(builtin_engine.url + f"/v1/models/{card['id']}").status_code == 200
    missing = httpx.get(builtin_engine.url + "/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_completions_shape_logprobs_and_n(builtin_engine):
    out = post(builtin_engine.url, "/v1/completions",
               {"prompt": ["ab", "cd"], "max_tokens": 4, "n": 2, "logprobs": 2,
                "ignore_eos": True, "log_metrics": True}).json()
    assert out["object"] == "text_completion" and len(out["choices"]) == 4
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for c in out["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
        assert all(len(t) <= 2 for t in lp["top_logprobs"]) and c["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # cpu: no cache
    assert "weight_version" in out["metadata"]
    echo = post(builtin_engine.url, "/v1/completions",
                {"prompt": "ab", "max_tokens": 2, "echo": True, "temperature": 0}).json()
    assert echo["choices"][0]["text"].startswith("ab")


def test_chat_matches_native_generate_and_stream(builtin_engine):
    out = post(builtin_engine.url, "/v1/chat/completions",
               {**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == out["usage"]["completion_tokens"]
    # Same prompt through the chat template by hand on the native route: same greedy text.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(httpx.get(builtin_engine.url + "/get_model_info")
                                        .json()["tokenizer_path"])
    ids = tok.encode(tok.apply_chat_template(CHAT["messages"], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    native = post(builtin_engine.url, "/generate",
                  {"input_ids": ids, "sampling_params": {"max_new_tokens": 6,
                                                         "temperature": 0}}).json()
    assert choice["message"]["content"] == native["text"]
    chunks = events(builtin_engine.url, "/v1/chat/completions",
                    {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
    assert text == native["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
        native["meta_info"]["completion_tokens"]


def test_openai_errors_use_the_error_object(builtin_engine):
    for body in ({"messages": []}, {**CHAT, "tools": [{"type": "function"}]},
                 {**CHAT, "max_tokens": 0}, {**CHAT, "top_p": 0}):
        r = post(builtin_engine.url, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["object"] == "error", body
    r = httpx.post(builtin_engine.url + "/v1/completions", content=b"prompt=x",
                   headers={"content-type": "application/x-www-form-urlencoded"})
    # Refused by the engine's guard before the route (a form is what a web page can send).
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_openai_bodies_become_generate_bodies():
    """The OpenAI routes take /generate's expansion: their bodies translate into its body."""
    from rltool.engine.routes.openai_bodies import ChatRequest, CompletionRequest

    completion = CompletionRequest(prompt=[[5, 6], [7]], max_tokens=3, n=2, seed=4, logprobs=1,
                                   echo=True, stop="x", model="m", log_metrics=True)
    defaults = {"ignore_eos": False, "skip_special_tokens": True, "no_stop_trim": False}
    assert completion.to_generate().model_dump(exclude_defaults=True) == {
        "input_ids": [[5, 6], [7]], "return_logprob": True, "logprob_start_len": 0,
        "top_logprobs_num": 1, "sampling_params": {"max_new_tokens": 3, "n": 2, "stop": "x",
                                                   "sampling_seed": 4, **defaults}}
    assert CompletionRequest(prompt="ab").to_generate().text == ["ab"]
    chat = ChatRequest(messages=[{"role": "user", "content": "a"}], top_logprobs=2,
                       temperature=0)
    # No token limit: the rest of the context; top_logprobs only count with logprobs.
    assert chat.to_generate([1, 2, 3], context_length=10).model_dump(exclude_defaults=True) == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 7, "temperature": 0.0, "n": 1, **defaults}}
