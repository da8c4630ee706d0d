"""The builtin engine over HTTP (session engine, read-only): response shapes, logprobs, concurrency,
continuous batching, stop conditions, bad requests."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import pytest

from rltool.rollout.client import EngineClient
from tests.helpers.engines import engine_call

META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
             "reasoning_tokens", "weight_version", "weight_versions", "e2e_latency"}


def post(url: str, path: str, body=None, **kwargs) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60.0, **kwargs)


def test_generate_single_shape_and_logprobs(builtin_engine):
    r = post(builtin_engine.url, "/generate",
             {"text": "abc", "return_logprob": True, "model": "unknown", "log_metrics": True,
              "sampling_params": {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert META_KEYS <= set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 7
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 7}]
    lps = meta["output_token_logprobs"]
    assert len(lps) == len(out["output_ids"]) == meta["output_token_logprobs_length"] == 7
    assert all(isinstance(lp, float) and lp <= 0 and tok == oid and text is None
               for (lp, tok, text), oid in zip(lps, out["output_ids"]))


def test_batch_and_n_return_prompt_major_lists(builtin_engine):
    r = post(builtin_engine.url, "/generate",
             {"input_ids": [[5, 6, 7], [8, 9]], "rid": "batch", "return_logprob": True,
              "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True}})
    outs = r.json()
    assert r.status_code == 200 and isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["id"] for o in outs] == ["batch_0_0", "batch_0_1", "batch_1_0",
                                                    "batch_1_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 2, 2]
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 3 for o in outs)


def test_input_and_top_logprobs(builtin_engine):
    out = post(builtin_engine.url, "/generate",
               {"input_ids": [5, 6, 7, 8], "return_logprob": True, "logprob_start_len": 0,
                "top_logprobs_num": 3, "token_ids_logprob": [4, 5],
                "return_text_in_logprobs": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                    "ignore_eos": True}}).json()
    meta = out["meta_info"]
    assert [x[1] for x in meta["input_token_logprobs"]] == [5, 6, 7, 8]
    assert meta["input_token_logprobs"][0][0] is None
    assert all(x[0] <= 0 for x in meta["input_token_logprobs"][1:])
    assert len(meta["output_top_logprobs"]) == 4 and all(len(t) == 3
                                                         for t in meta["output_top_logprobs"])
    # Greedy: the chosen token is the top-1 entry, with the same logprob.
    for (lp, tok, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp) and isinstance(text, str)
    assert [[x[1] for x in row] for row in meta["output_token_ids_logprobs"]] == [[4, 5]] * 4


def test_stop_string_stop_token_and_eos(builtin_engine):
    base = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 30,
                                                        "temperature": 0.0, "ignore_eos": True}}
    free = post(builtin_engine.url, "/generate", base).json()
    ids, text = free["output_ids"], free["text"]
    # A stop token id: generation ends at its first occurrence, the token is included.
    stop_tok = ids[4]
    first = ids.index(stop_tok)
    out = post(builtin_engine.url, "/generate",
               {**base, "sampling_params": {**base["sampling_params"],
                                            "stop_token_ids": [stop_tok]}}).json()
    assert out["output_ids"] == ids[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # A stop string: trimmed from text unless no_stop_trim.
    stop = text[5:7]
    at = text.find(stop)
    out = post(builtin_engine.url, "/generate",
               {**base, "sampling_params": {**base["sampling_params"], "stop": stop}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:at]
    kept = post(builtin_engine.url, "/generate",
                {**base, "sampling_params": {**base["sampling_params"], "stop": [stop],
                                             "no_stop_trim": True}}).json()
    assert kept["text"] == text[:at + len(stop)]


def test_concurrent_requests_share_decode_batches(builtin_engine):
    """Requests arriving at different times are decoded in the same forward batch: the early
    request takes 119 decode forwards (its first token comes from the prefill), each late one 19;
    had no late one shared a forward with it, the engine would have run at least 119 + 19."""
    first = f"early-{uuid.uuid4().hex[:6]}"
    late = [f"late{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    sp = {"max_new_tokens": 120, "ignore_eos": True}

    async def main():
        async with EngineClient(builtin_engine.url, timeout_s=120) as c:
            before = (await c.get_server_info())["internal_states"][0]
            early = asyncio.create_task(c.generate({"text": "abc", "rid": first,
                                                    "sampling_params": sp}))
            while True:  # wait until the first request is decoding
                st = (await c.get_server_info())["internal_states"][0]
                if st["num_decode_forwards"] > before["num_decode_forwards"]:
                    break
                await asyncio.sleep(0.01)
            outs = await asyncio.gather(*[c.generate({"text": "xy" * (i + 1), "rid": rid,
                                                      "sampling_params": {**sp,
                                                                          "max_new_tokens": 20}})
                                          for i, rid in enumerate(late)])
            early = await early
            return before, early, outs, (await c.get_server_info())["internal_states"][0]

    before, early, outs, st = asyncio.run(main())
    assert early["meta_info"]["completion_tokens"] == 120
    assert all(o["meta_info"]["completion_tokens"] == 20 for o in outs)
    forwards = st["num_decode_forwards"] - before["num_decode_forwards"]
    assert forwards < 119 + 19, "late requests never joined the early request's decode batch"
    assert st["max_decode_batch_seen"] >= 4 and st["gen_throughput"] > 0


def test_many_concurrent_requests_all_complete(builtin_engine):
    async def main():
        async with EngineClient(builtin_engine.url, timeout_s=120) as c:
            return await asyncio.gather(*[
                c.generate({"input_ids": [5 + i % 20, 6], "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 2 + i % 9}})
                for i in range(40)])

    outs = asyncio.run(main())
    for o in outs:
        meta = o["meta_info"]
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(o["output_ids"])


def test_sampling_seed_is_honoured_outside_deterministic_mode(builtin_engine):
    """A seeded request draws from its own generator in the batched engine too (the seed used to
    be ignored outside --deterministic, so `rltool.demo --seed` could not seed its sampling):
    the same seed repeats its tokens while other requests share the batch, another seed differs."""
    def body(seed: int, text: str = "abc") -> dict:
        return {"text": text, "rid": uuid.uuid4().hex,
                "sampling_params": {"max_new_tokens": 24, "ignore_eos": True,
                                    "temperature": 1.0, "sampling_seed": seed}}

    async def main():
        async with EngineClient(builtin_engine.url, timeout_s=60) as c:
            alone = await c.generate(body(11))
            crowd = await asyncio.gather(c.generate(body(11)), c.generate(body(12)),
                                         *(c.generate(body(s, "zz")) for s in range(6)))
            return alone, crowd

    alone, crowd = asyncio.run(main())
    assert crowd[0]["output_ids"] == alone["output_ids"]
    assert crowd[1]["output_ids"] != alone["output_ids"]


def test_streaming_is_cumulative_and_ends_with_done(builtin_engine):
    with httpx.stream("POST", builtin_engine.url + "/generate", timeout=60,
                      json={"text": "ab", "stream": True, "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    import json

    events = [json.loads(line[6:]) for line in lines[:-1]]
    # an event per wake-up of the stream with all tokens so far (one per token when the
    # stream keeps up; fewer, fuller ones when tokens come faster than it runs)
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths[-1] == 4 and lengths == sorted(set(lengths))
    assert [e["meta_info"]["finish_reason"] is None for e in events] == [True] * (
        len(events) - 1) + [False]
    for before, after in zip(events, events[1:]):
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])


def test_info_routes(builtin_engine, tiny_model_dir):
    info = engine_call(builtin_engine.url, "get_model_info")
    assert info["tokenizer_path"] == str(tiny_model_dir) and info["is_generation"] is True
    assert info["weight_version"] == "default" and info["architectures"] == ["Qwen2ForCausalLM"]
    server = httpx.get(builtin_engine.url + "/server_info").json()
    assert isinstance(server["internal_states"], list) and len(server["internal_states"]) == 1
    for key in ("tp_size", "dp_size", "context_length", "max_running_requests", "version"):
        assert key in server
    assert httpx.get(builtin_engine.url + "/health_generate", timeout=30).status_code == 200
    assert httpx.get(builtin_engine.url + "/ready").status_code == 200
    load = httpx.get(builtin_engine.url + "/v1/loads").json()["loads"][0]
    assert load["dp_rank"] == 0 and load["num_waiting_reqs"] == 0
    assert engine_call(builtin_engine.url, "health") is True


BAD_REQUESTS = [
    ("/generate", {"text": "a", "sampling_params": {"bogus": 1}}),
    ("/generate", {"text": "a", "input_ids": [1]}),
    ("/generate", {"sampling_params": {}}),
    ("/generate", {"input_ids": []}),
    ("/generate", {"input_ids": [10 ** 6]}),
    ("/generate", {"input_ids": [-1]}),
    ("/generate", {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 100}}),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 0}}),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "many"}}),
    ("/generate", {"text": "a", "sampling_params": {"stop": ["x"] * 33}}),
    ("/generate", {"text": "a", "sampling_params": {"repetition_penalty": 1.5}}),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}),
    ("/generate", {"text": "a", "lora_path": "x"}),
    ("/generate", {"text": 5}),
    ("/generate", [1, 2]),
    ("/generate", "not json"),
    ("/pause_generation", {"mode": "sideways"}),
    ("/pause_generation", None),
    ("/abort_request", {"rid": 5}),
    ("/release_memory_occupation", {"tags": ["gpu"]}),
    ("/update_weights_from_disk", {}),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}),
]


@pytest.mark.parametrize("path,body", BAD_REQUESTS)
def test_bad_requests_get_4xx_and_server_keeps_serving(builtin_engine, path, body):
    if isinstance(body, str):
        r = httpx.post(builtin_engine.url + path, content=body, timeout=30)
    elif body is None:
        r = httpx.post(builtin_engine.url + path, timeout=30)
    else:
        r = post(builtin_engine.url, path, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()
    assert err.get("object") == "error" or "message" in err.get("error", {}) \
        or err.get("success") is False, err
    ok = post(builtin_engine.url, "/generate", {"text": "a", "sampling_params":
                                                {"max_new_tokens": 1}})
    assert ok.status_code == 200


def test_duplicate_rid_in_flight_is_refused(builtin_engine):
    """The engine is paused, so the first request surely waits in flight when its duplicate
    arrives (a running 150-token request could finish first on a loaded machine)."""
    url = builtin_engine.url
    rid = f"dup-{uuid.uuid4().hex[:6]}"
    result = {}

    def first():
        result["r"] = post(url, "/generate", {"text": "a", "rid": rid,
                                              "sampling_params": {"max_new_tokens": 8}})

    assert post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
    t = threading.Thread(target=first)
    t.start()
    try:
        for _ in range(600):  # until the scheduler holds the request
            if httpx.get(url + "/server_info").json()["internal_states"][0]["num_waiting_reqs"]:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the first request never reached the scheduler")
        dup = post(url, "/generate", {"text": "b", "rid": rid})
    finally:
        assert post(url, "/continue_generation", {}).status_code == 200
        t.join()
    assert dup.status_code == 400 and "duplicate" in dup.json()["error"]["message"]
    assert result["r"].status_code == 200


def test_listener_disables_nagle_and_fast_http_stack_is_installed():
    """Accepted sockets inherit TCP_NODELAY from the listener: without it each keep-alive response
    waited ~44 ms for the client's delayed ACK. uvloop and httptools are dependencies (the
    engine's event loop and uvicorn's `http="auto"` pick them); a missing one must fail here."""
    import socket

    from rltool.engine.server import _loop_factory, bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        sock.close()
    import uvloop
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    assert _loop_factory() is uvloop.new_event_loop
    assert AutoHTTPProtocol.__name__ == "HttpToolsProtocol"


def test_an_idle_connection_is_kept_past_client_pool_expiries(builtin_engine):
    """A keep-alive connection idle for longer than uvicorn's default 5 s still serves the next
    request: clients pool connections longer than that (aiohttp 15 s), and a server closing them
    sooner races the client's next request on them."""
    import socket
    import time
    from urllib.parse import urlsplit

    from rltool.engine.server import KEEP_ALIVE_S

    host, port = urlsplit(builtin_engine.url).hostname, urlsplit(builtin_engine.url).port
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, port), timeout=30) as sock:
        for idle_s in (5.5, 0):  # past uvicorn's default keep-alive, well inside KEEP_ALIVE_S
            sock.sendall(request)
            head = sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 200"), head
            time.sleep(idle_s)
    assert KEEP_ALIVE_S > 15


def test_serving_modules_leave_torch_compiler_stack_unimported():
    """The engine's processes start without importing torch's compiler stack (about 1.4 s on a
    CPU, more where many packages are installed): torch's varlen attention, whose module imports
    it, loads on first use only."""
    import subprocess
    import sys

    code = ("import sys; import rltool.engine.app, rltool.engine.server, "
            "rltool.engine.scheduler_process, rltool.engine.paged_runner, rltool.train.packed, "
            "rltool.train.torch_backend; from rltool import varlen; "
            "print('torch._dynamo' in sys.modules, end=' '); varlen.available(); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
