"""The two-process layout of `rltool serve` (--frontend-process): the HTTP front end in one
process, the scheduler in another, joined by rltool.engine.ipc's channel.

Checked against the one-process session engine (`builtin_engine`, same model and flags but the
layout): seeded and greedy requests give the same tokens, logprobs and text (stop strings,
streamed or not); abort and pause reach the scheduler; a weight update runs through the control
call; SIGTERM to the server ends both processes; a scheduler process that dies makes the front
end answer 503 and exit non-zero instead of hanging.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from rltool.engine import api

TWO_PROCESS = ["--frontend-process", "--num-threads", "1"]


def start(model_dir, tmp_path_factory, name: str, *extra: str):
    from rltool.rollout.launch import start_engine

    log_path = tmp_path_factory.mktemp("engine-logs") / f"{name}.log"
    proc = start_engine(["--engine", "builtin", "--model", str(model_dir), *TWO_PROCESS, *extra],
                        log_path=log_path, ready_timeout_s=120.0)
    return proc, log_path


@pytest.fixture(scope="module")
def two_process_engine(tiny_model_dir, tmp_path_factory):
    proc, log_path = start(tiny_model_dir, tmp_path_factory, "two-process",
                           "--allowed-weight-root", str(tmp_path_factory.getbasetemp()))
    yield proc
    proc.stop()


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60.0, **kw)


def scheduler_pid(url: str) -> int:
    return httpx.get(url + api.SERVER_INFO, timeout=30.0).json()["scheduler_pid"]


def stream_events(url: str, body: dict) -> list:
    with httpx.stream("POST", url + api.GENERATE, json=body, timeout=60.0) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def openai_stream_text(url: str, body: dict) -> str:
    """The text of a streamed OpenAI completion of `body`: its chunks' texts joined."""
    with httpx.stream("POST", url + api.OPENAI_COMPLETIONS, json={**body, "stream": True},
                      timeout=60.0) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_layout_is_two_processes(two_process_engine):
    info = httpx.get(two_process_engine.url + api.SERVER_INFO, timeout=30.0).json()
    assert info["frontend_process"] is True
    assert info["scheduler_pid"] != two_process_engine.pid


@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0, "sampling_seed": 7},
    {"temperature": 0.0, "stop": ["a", "b"]},
    {"temperature": 0.8, "top_k": 5, "sampling_seed": 3, "stop_token_ids": [9]},
])
def test_same_answers_as_one_process(two_process_engine, builtin_engine, sampling):
    """Tokens, recomputed logprobs (with top-k and input logprobs), text and finish reason are
    the one-process engine's, plain and streamed."""
    body = {"text": ["abcdef", "zyx"], "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 20, **sampling}}
    answers = []
    for engine in (builtin_engine, two_process_engine):
        r = post(engine.url, api.GENERATE, {**body, "rid": [uuid.uuid4().hex for _ in range(2)]})
        assert r.status_code == 200, r.text
        outs = r.json()
        for out in outs:
            del out["meta_info"]["id"], out["meta_info"]["e2e_latency"]
        answers.append(outs)
    assert answers[0] == answers[1]
    for i, text in enumerate(body["text"]):
        events = stream_events(two_process_engine.url, {
            **body, "text": text, "stream": True})
        final = events[-1]
        assert final["output_ids"] == answers[1][i]["output_ids"]
        assert final["text"] == answers[1][i]["text"]
        assert final["meta_info"]["finish_reason"] == answers[1][i]["meta_info"]["finish_reason"]
        assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
        assert all(final["output_ids"][:len(e["output_ids"])] == e["output_ids"]
                   for e in events)


def test_openai_stream_matches_plain_answer(two_process_engine):
    body = {"prompt": "hello", "max_tokens": 12, "temperature": 0.0, "stop": ["q"]}
    plain = post(two_process_engine.url, api.OPENAI_COMPLETIONS, body).json()
    assert openai_stream_text(two_process_engine.url, body) == plain["choices"][0]["text"]


# The one-process session engine's live checks, run against the two-process engine (before
# this module changes its weights: they expect version "default").
LIVE_CHECKS = [("test_server", name) for name in (
    "test_generate_single_shape_and_logprobs", "test_batch_and_n_return_prompt_major_lists",
    "test_input_and_top_logprobs", "test_stop_string_stop_token_and_eos",
    "test_concurrent_requests_share_decode_batches", "test_many_concurrent_requests_all_complete",
    "test_sampling_seed_is_honoured_outside_deterministic_mode",
    "test_streaming_is_cumulative_and_ends_with_done", "test_info_routes")] + [
    ("test_openai", name) for name in (
        "test_models_card", "test_completions_shape_logprobs_and_n",
        "test_chat_matches_native_generate_and_stream", "test_openai_errors_use_the_error_object")]


@pytest.mark.parametrize(("module", "name"), LIVE_CHECKS, ids=[n for _, n in LIVE_CHECKS])
def test_one_process_checks_pass_in_two_processes(two_process_engine, tiny_model_dir, module,
                                                  name):
    import importlib
    import inspect

    check = getattr(importlib.import_module(f"tests.engine.{module}"), name)
    given = {"builtin_engine": two_process_engine, "tiny_model_dir": tiny_model_dir}
    check(**{p: given[p] for p in inspect.signature(check).parameters})


def test_bad_requests_get_4xx_in_two_processes(two_process_engine):
    from tests.engine import test_server

    for path, body in test_server.BAD_REQUESTS:
        test_server.test_bad_requests_get_4xx_and_server_keeps_serving(two_process_engine,
                                                                       path, body)


def test_abort_pause_and_refusals_reach_the_scheduler(two_process_engine):
    """Paused, the engine keeps a request waiting: no timing needed to abort it."""
    url = two_process_engine.url
    rid = uuid.uuid4().hex
    result: dict = {}

    def run() -> None:
        result["r"] = post(url, api.GENERATE, {"input_ids": [5, 6], "rid": rid,
                                               "sampling_params": {"max_new_tokens": 50}})

    assert post(url, api.PAUSE_GENERATION, {"mode": "in_place"}).status_code == 200
    assert httpx.get(url + api.READY).status_code == 503
    t = threading.Thread(target=run)
    t.start()
    try:
        for _ in range(100):  # until the request waits in the scheduler
            state = httpx.get(url + api.SERVER_INFO).json()["internal_states"][0]
            if state["num_waiting_reqs"]:
                break
            time.sleep(0.05)
        dup = post(url, api.GENERATE, {"input_ids": [5], "rid": rid})
        assert dup.status_code == 400 and "duplicate request id" in dup.text
        assert post(url, api.ABORT_REQUEST, {"rid": rid}).status_code == 200
        t.join(timeout=60)
        assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        assert post(url, api.CONTINUE_GENERATION, {}).status_code == 200
    assert httpx.get(url + api.READY).status_code == 200
    bad = post(url, api.PAUSE_GENERATION, {"mode": "nap"})
    assert bad.status_code == 400 and "unknown pause mode" in bad.text


def test_weight_update_through_the_control_call(two_process_engine, tiny_model_dir,
                                                other_weights_dir, builtin_engine):
    url = two_process_engine.url
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 8,
                                                          "temperature": 0.0}}
    before = post(url, api.GENERATE, body).json()
    r = post(url, api.UPDATE_WEIGHTS_FROM_DISK, {"model_path": str(other_weights_dir),
                                                 "weight_version": "v1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert httpx.get(url + api.WEIGHT_VERSION).json()["weight_version"] == "v1"
    after = post(url, api.GENERATE, body).json()
    assert after["meta_info"]["weight_version"] == "v1"
    assert after["output_ids"] != before["output_ids"]
    outside = post(url, api.UPDATE_WEIGHTS_FROM_DISK, {"model_path": "/etc"})
    assert outside.status_code == 400 and not outside.json()["success"]
    r = post(url, api.UPDATE_WEIGHTS_FROM_DISK, {"model_path": str(tiny_model_dir),
                                                 "weight_version": "v2"})
    assert r.status_code == 200, r.text
    assert post(url, api.GENERATE, body).json()["output_ids"] == before["output_ids"]


def test_pinning_an_engine_pins_its_scheduler_process(two_process_engine):
    """The loop's `engine_cores` reach the scheduler process (every thread), not only the front
    end whose pid the loop holds; pinning the front end alone left the model's process on
    every core."""
    from rltool.loop.affinity import pin_tree

    proc = two_process_engine
    child = scheduler_pid(proc.url)
    before = os.sched_getaffinity(child)
    core = min(before)
    try:
        pin_tree(proc.pid, [core])
        for pid in (proc.pid, child):
            threads = os.listdir(f"/proc/{pid}/task")
            assert all(os.sched_getaffinity(int(tid)) == {core} for tid in threads)
    finally:
        pin_tree(proc.pid, sorted(before))


def test_sigterm_stops_both_processes(two_process_engine):
    """The module engine's last test: it ends the engine (the fixture's stop is then a no-op)."""
    proc = two_process_engine
    child = scheduler_pid(proc.url)
    assert proc.stop() == 0
    for _ in range(100):
        if not os.path.exists(f"/proc/{child}"):
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}")


def test_scheduler_death_answers_503_and_exits_non_zero(tiny_model_dir, tmp_path_factory):
    """The request waits (the engine is paused) when the scheduler process is killed."""
    proc, log_path = start(tiny_model_dir, tmp_path_factory, "death")
    result: dict = {}

    def run() -> None:
        result["r"] = post(proc.url, api.GENERATE, {
            "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 50}})

    url = proc.url
    pid = scheduler_pid(url)
    assert post(url, api.PAUSE_GENERATION, {"mode": "in_place"}).status_code == 200
    t = threading.Thread(target=run)
    t.start()
    try:
        for _ in range(100):  # until the request waits in the scheduler
            state = httpx.get(url + api.SERVER_INFO).json()["internal_states"][0]
            if state["num_waiting_reqs"]:
                break
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        t.join(timeout=60)
        assert result["r"].status_code == 503, result["r"].text
        assert "scheduler process exited" in result["r"].json()["error"]["message"]
        assert proc.popen.wait(timeout=60) == 3
        assert "scheduler process exited" in log_path.read_text()
    finally:
        proc.stop()


@pytest.mark.slow  # two interpreters load torch only to fail: ~25 s on a busy 2-core machine
def test_a_checkpoint_the_scheduler_cannot_load_exits_as_in_one_process(tiny_model_dir,
                                                                        tmp_path):
    """The scheduler process's typed error comes back to the front end: one line, exit 2."""
    model = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text("{not json")
    ready = tmp_path / "ready.json"
    proc = subprocess.run([sys.executable, "-m", "rltool", "serve", "--model", str(model),
                           *TWO_PROCESS, "--port", "0", "--ready-file", str(ready)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not ready.exists()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")
def test_cuda_two_processes_answer_as_the_engine_in_process(tiny_model_dir, tmp_path_factory):
    """On CUDA (where two processes are the default), deterministic seeded sampling through the
    two-process server gives the tokens, logprobs and text of the same engine driven in process
    (rltool.engine.inprocess: the scheduler thread and response building of one process, without
    a served start), plain and streamed."""
    import asyncio

    from rltool.engine.config import ServeConfig
    from rltool.engine.inprocess import InProcessEngine
    from rltool.rollout.launch import start_engine

    body = {"input_ids": [[5, 6, 7, 8], [9, 10]], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 5,
                                "ignore_eos": True}}
    engine = InProcessEngine(ServeConfig(model=tiny_model_dir, device="cuda",
                                         deterministic=True))
    try:
        expected = asyncio.run(engine.generate(body))
    finally:
        engine.stop()
    log_path = tmp_path_factory.mktemp("engine-logs") / "cuda-two-processes.log"
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir), "--device",
                         "cuda", "--deterministic", "--frontend-process"], log_path=log_path,
                        ready_timeout_s=300.0)
    try:
        assert httpx.get(proc.url + api.SERVER_INFO, timeout=30.0).json()["frontend_process"]
        outs = post(proc.url, api.GENERATE, body).json()
        streamed = stream_events(proc.url, {**body, "input_ids": body["input_ids"][0],
                                            "stream": True})[-1]
    finally:
        proc.stop()
    for out in (*expected, *outs):
        del out["meta_info"]["id"], out["meta_info"]["e2e_latency"]
    assert streamed["output_ids"] == outs[0]["output_ids"]
    assert outs == expected


def test_streamed_text_decodes_only_new_tokens_and_matches_a_whole_decode(tiny_model_dir):
    """`StreamedText` fed random outputs in random steps gives, after every step, the decode of
    the whole output so far (the tiny model's tokenizer has no partial characters), and decodes
    at most the tokens since the previous step's seam each time."""
    import random

    from rltool.engine.loading import load_tokenizer
    from rltool.engine.detokenize import StreamedText

    tokenizer = load_tokenizer(tiny_model_dir)
    calls: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kw)

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 60))]
        text, n = StreamedText(Counting(), True), 0
        while n < len(ids):
            step = rng.randint(1, 4)
            calls.clear()
            got = text.update(ids[:n + step])
            n = min(n + step, len(ids))
            assert got == tokenizer.decode(ids[:n], skip_special_tokens=True)
            assert max(calls) <= 8  # the last seam's tokens and the new ones


def test_lora_adapters_through_the_scheduler_process(tiny_model_dir, tmp_path_factory):
    """Adapter names are checked where the adapters live (the scheduler process): an unknown
    lora_path is refused 400 naming the loaded ones; load, generate and unload work as in one
    process, the adapter's greedy tokens those of a runner holding it."""
    from rltool.engine.paged_runner import PagedRunner
    from tests.helpers.lora_adapters import ALL_TARGETS, make_adapter
    from tests.helpers.scheduling import generate_once

    root = tmp_path_factory.mktemp("lora-root")
    model = root / "model"
    shutil.copytree(tiny_model_dir, model)
    full = make_adapter(model, root / "lora-full", r=4, alpha=8, targets=ALL_TARGETS,
                        seed=1)[1]
    proc, _ = start(model, tmp_path_factory, "lora", "--enable-lora", "--max-lora-rank", "8")
    try:
        url = proc.url
        gen = {"input_ids": [5, 9, 13, 2], "sampling_params": {"max_new_tokens": 4,
                                                               "temperature": 0.0}}
        unknown = post(url, api.GENERATE, {**gen, "lora_path": "full"})
        assert unknown.status_code == 400 and "loaded: none" in unknown.text, unknown.text
        r = post(url, api.LOAD_LORA_ADAPTER, {"lora_name": "full", "lora_path": str(full)})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"full": str(full)}
        out = post(url, api.GENERATE, {**gen, "lora_path": "full"}).json()
        runner = PagedRunner(model, device="cpu", dtype="fp32", max_running=8, page_size=4,
                             max_total_tokens=512, enable_lora=True, max_lora_rank=8)
        runner.lora.load("full", full)
        [want] = generate_once(runner, [gen["input_ids"]], ["full"], new=4,
                               max_prefill_tokens=64)
        assert out["output_ids"] == want.output_ids
        r = post(url, api.UNLOAD_LORA_ADAPTER, {"lora_name": "full"})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
    finally:
        proc.stop()


def test_channel_records_round_trip_exactly(tiny_model_dir):
    """A request sent to the scheduler process is the request expanded in the front end (its
    seeded generator too), and a final record rebuilds the response the scheduler's own request
    gives (logprobs to the last bit, top and input logprobs, routed experts, weight spans)."""
    import numpy as np
    import torch

    from rltool.engine import ipc
    from rltool.engine.loading import load_tokenizer
    from rltool.engine.request import Request, build_response
    from rltool.engine.sampling import SamplingParams, make_generator

    def request() -> Request:
        return Request(rid="r-1", prompt_ids=[4, 5, 6, 7],
                       params=SamplingParams(max_new_tokens=5, temperature=0.7, top_k=3,
                                             stop=["ab"], logit_bias={"4": -1.5}),
                       lora=None, return_logprob=True, logprob_start_len=1,
                       top_logprobs_num=2, token_ids_logprob=[4, 9],
                       return_text_in_logprobs=True, return_routed_experts=True,
                       generator=make_generator(1234))

    sent = request()
    got = ipc.decode_request(json.loads(json.dumps(ipc.encode_request(sent, stream=True))))
    for name in ("rid", "prompt_ids", "params", "lora", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
                 "return_routed_experts"):
        assert getattr(got, name) == getattr(sent, name), name
    assert torch.equal(torch.rand(8, generator=got.generator),
                       torch.rand(8, generator=sent.generator))

    done = request()
    done.output_ids = [9, 10, 11]
    done.output_logprobs = [-0.1, float("-inf"), -1e-300]
    done.output_top_logprobs = [[(-0.1, 9), (-2.5, 3)]] * 3
    done.output_token_ids_logprobs = [[(-1.25, 4), (-7.0, 9)]] * 3
    done.input_logprobs = [None, -0.75, -3.5]
    done.input_top_logprobs = [None, [(-0.75, 5), (-1.0, 8)], [(-3.5, 6), (-0.5, 2)]]
    done.routed_experts = np.arange(24, dtype=np.int32).reshape(6, 2, 2)
    done.spans = [("v0", 0), ("v1", 2)]
    done.finish_reason = {"type": "stop", "matched": "ab"}
    done.matched_stop_at, done.cached_tokens, done.text = 3, 2, "xyz"
    done.t_first_token, done.t_finish = done.t_arrival + 0.5, done.t_arrival + 1.5
    mirror = request()
    mirror.t_arrival = done.t_arrival
    ipc.apply_final(mirror, json.loads(ipc.frame({"fin": [ipc.encode_final(done)]})[4:])["fin"][0])
    tokenizer = load_tokenizer(tiny_model_dir)
    assert (build_response(mirror, tokenizer=tokenizer, weight_version="v1")
            == build_response(done, tokenizer=tokenizer, weight_version="v1"))


def test_a_refused_streamed_request_leaves_no_stream_behind():
    """A streamed request the scheduler refuses (a full queue) is forgotten by the outbox even
    when a step's flush took it in between its arrival and the refusal (the reader thread
    registers it before submitting it; the scheduler thread flushes after every iteration)."""
    from rltool.engine.request import Request
    from rltool.engine.sampling import SamplingParams
    from rltool.engine.scheduler_process import Outbox

    channel = _SentChannel()
    outbox = Outbox(channel, _StepRunner())
    refused = Request(rid="r-refused", prompt_ids=[1, 2], params=SamplingParams())
    kept = Request(rid="r-kept", prompt_ids=[1, 2], params=SamplingParams())
    outbox.stream(refused)
    outbox.stream(kept)
    outbox.flush()  # the scheduler thread's flush, between arrival and refusal
    outbox.unstream([refused])
    kept.record_token(7, -0.5, version="v0")
    outbox.flush()
    assert set(outbox.streams) == {"r-kept"}
    assert [m["tok"]["rids"] for m in channel.sent] == [["r-kept"]]


def test_an_answer_that_cannot_be_sent_answers_an_error():
    """A named call whose answer cannot be framed (a value JSON does not take) gets an error
    reply (the front end answers 500) instead of no reply, which left its HTTP request waiting
    for good."""
    import asyncio

    import numpy as np

    from rltool.engine.scheduler_process import SchedulerProcess

    class Ops:
        async def loads(self):
            return {"num_running_reqs": np.int64(3)}

    proc = SchedulerProcess.__new__(SchedulerProcess)
    proc.ops, proc.channel = Ops(), _SentChannel(framed=True)
    asyncio.run(proc.call(7, "loads", {}))
    [reply] = proc.channel.sent
    assert reply["id"] == 7 and "ok" not in reply
    assert reply["err"][0] == "TypeError" and "int64" in reply["err"][1]


def test_streamed_tokens_keep_the_weight_version_they_were_sampled_with(tiny_model_dir):
    """A step whose message holds tokens sampled before and after a weight update (the tokens
    drained before the update, then the step's) gives the front end's copies of streamed
    requests the scheduler's weight-version spans, not the version at the time of the message."""
    from rltool.engine.loading import load_tokenizer
    from rltool.engine.remote_link import RemoteLink
    from rltool.engine.request import Request
    from rltool.engine.sampling import SamplingParams
    from rltool.engine.scheduler_process import Outbox

    def request(rid: str) -> Request:
        return Request(rid=rid, prompt_ids=[4, 5], params=SamplingParams())

    runner, channel = _StepRunner(), _SentChannel(framed=True)
    outbox = Outbox(channel, runner)
    a, b = request("a"), request("b")
    outbox.stream(a)
    outbox.stream(b)
    a.record_token(7, -0.5, version="v0")
    outbox.flush()
    a.record_token(8, -0.25, version="v0")  # drained before the update
    runner.weight_version = "v1"
    b.record_token(3, -0.5, version="v1")  # a row after one of the old version
    outbox.flush()
    a.record_token(9, -0.125, version="v1")
    a.record_token(10, -1.0, version="v1")
    runner.weight_version = "v2"  # an update between a row's tokens
    a.record_token(11, -2.0, version="v2")
    outbox.flush()
    runner.weight_version = "v3"  # a version set with no token since
    outbox.flush()
    a.record_token(12, -0.5, version="v3")
    b.record_token(4, -0.5, version="v3")
    outbox.flush()

    link = RemoteLink.__new__(RemoteLink)
    copies = {"a": request("a"), "b": request("b")}
    updates = []
    for copy in copies.values():
        copy.on_token = lambda r: updates.append(r.rid)
    link.pending, link.texts = {rid: (copy, None) for rid, copy in copies.items()}, {}
    link.tokenizer = load_tokenizer(tiny_model_dir)
    for msg in channel.sent:
        link._handle(msg)
    for sched_req in (a, b):
        copy = copies[sched_req.rid]
        assert copy.output_ids == sched_req.output_ids
        assert copy.spans == sched_req.spans
    assert a.spans == [("v0", 0), ("v1", 2), ("v2", 4), ("v3", 5)]
    assert b.spans == [("v1", 0), ("v3", 1)]
    # one update per message that holds a request's tokens, however many it holds
    assert updates.count("a") == 4 and updates.count("b") == 2


def test_a_failure_handling_one_request_fails_only_that_request():
    """A request whose message the front end cannot handle (decoding its streamed text fails)
    ends with 500 and is aborted in the scheduler; the channel stays up and the next message
    still answers another request. The front end used to take any such error for a broken
    channel: every request got 503 and the server exited."""
    import asyncio

    from rltool.engine import ipc
    from rltool.engine.link import EngineInfo
    from rltool.engine.remote_link import RemoteLink
    from rltool.engine.request import Request
    from rltool.engine.sampling import SamplingParams

    class Tokenizer:
        def decode(self, ids, skip_special_tokens):
            raise ValueError("cannot decode token 3")

    class Proc:
        def poll(self):
            return None

    class Writer:
        def __init__(self):
            self.data = b""

        def write(self, data):
            self.data += data

    info = EngineInfo(tokenizer=Tokenizer(), model_path="m", tokenizer_path="m",
                      context_length=64, vocab_size=32, max_total_num_tokens=256, moe=False,
                      lora_enabled=False)
    done_b = Request(rid="b", prompt_ids=[4, 5], params=SamplingParams(), text="xy")
    done_b.record_token(6, -0.5, version="v0")
    done_b.finish_reason = {"type": "length", "length": 1}
    step_a = {"t": "step", "v": "v0", "fin": [], "tok": {
        "rids": ["a"], "n": ipc.pack([1], "<i4"), "ids": ipc.pack([3], "<i4"),
        "lp": ipc.pack([-0.25], "<f8"), "extra": [], "spans": []}}
    step_b = {"t": "step", "v": "v0", "tok": None, "fin": [ipc.encode_final(done_b)]}

    async def serve() -> tuple[dict, list, bytes]:
        reader, writer = asyncio.StreamReader(), Writer()
        link = RemoteLink(reader, writer, proc=Proc(), info=info, weight_version="v0")
        finished, refused = {}, []
        reqs = [Request(rid=rid, prompt_ids=[4, 5], params=SamplingParams()) for rid in "ab"]
        for req in reqs:
            req.on_finish = lambda r: finished.setdefault(r.rid, r)
        reqs[0].on_token = lambda r: None
        link.submit(reqs, on_refused=refused.append)
        reader.feed_data(ipc.frame(step_a) + ipc.frame(step_b))
        reading = asyncio.ensure_future(link._read())
        while "b" not in finished:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the frames of this turn go out
        assert link.exited is None
        reader.feed_eof()
        await reading
        return finished, refused, writer.data

    finished, refused, sent = asyncio.run(serve())
    assert not refused
    reason = finished["a"].finish_reason
    assert reason["status_code"] == 500 and reason["type"] == "abort"
    assert reason["message"] == "internal error: ValueError: cannot decode token 3"
    assert finished["b"].finish_reason == {"type": "length", "length": 1}
    assert finished["b"].output_ids == [6] and finished["b"].text == "xy"
    frames, at = [], 0
    while at < len(sent):
        (size,) = ipc.HEADER.unpack_from(sent, at)
        frames.append(json.loads(sent[at + ipc.HEADER.size:at + ipc.HEADER.size + size]))
        at += ipc.HEADER.size + size
    assert [f["t"] for f in frames] == ["submit", "abort"]
    assert frames[1]["rids"] == ["a"]


def test_a_dead_scheduler_thread_ends_the_scheduler_process(monkeypatch):
    """A scheduler thread that ended unasked (an error outside a step's handling) makes the
    scheduler process exit with EXIT_RUNTIME, so the front end answers 503 and stops; the
    process used to stay up with the thread dead, its /health 200 and every request waiting.
    A thread ended by the process's own stop is no death."""
    from rltool.engine import scheduler_process
    from rltool.engine.scheduler_process import SchedulerProcess
    from rltool.errors import EXIT_RUNTIME

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    class Scheduler:
        def __init__(self):
            self.thread = threading.Thread(target=lambda: None)
            self.thread.start()
            self.thread.join()

        @property
        def alive(self):
            return self.thread.is_alive()

    monkeypatch.setattr(scheduler_process, "THREAD_POLL_S", 0.01)
    monkeypatch.setattr(os, "_exit", exit_)
    proc = SchedulerProcess.__new__(SchedulerProcess)
    proc.sched, proc.stopping = Scheduler(), threading.Event()
    with pytest.raises(Exited) as exited:
        proc.watch_scheduler()
    assert exited.value.args == (EXIT_RUNTIME,)
    proc.stopping.set()
    proc.watch_scheduler()  # returns: the process is stopping


class _StepRunner:
    weight_version = "v0"


class _SentChannel:
    """What a scheduler process sends, kept: the messages, or with `framed` each as the front
    end reads it back (framed by rltool.engine.ipc, then decoded)."""

    def __init__(self, framed: bool = False):
        self.framed = framed
        self.sent = []

    def send(self, msg):
        if self.framed:
            from rltool.engine import ipc

            msg = json.loads(ipc.frame(msg)[ipc.HEADER.size:])
        self.sent.append(msg)


class _StepScheduler:
    """Runs operations when the test says (as the scheduler thread between steps); a weight
    update runs as the scheduler runs one while paused or idle: abort_all first, then at once."""

    on_iteration = None
    paused = None

    def __init__(self):
        self.queued, self.running, self.prefilling = [], {}, []

    def call(self, fn):
        import concurrent.futures

        future = concurrent.futures.Future()

        def op():
            future.set_result(fn())

        self.queued.append(op)
        return future

    def update_weights(self, apply, *, abort_all):
        def update():
            if abort_all:
                for rid in list(self.running):
                    self.abort(rid=rid, abort_all=False)
            return apply()

        return self.call(update)

    def abort(self, *, rid, abort_all):
        req = self.running.pop(rid)
        req.finish_reason = {"type": "abort", "message": "Aborted by /abort_request."}
        req.on_finish(req)
        return 1

    def run_ops(self):
        ops, self.queued = self.queued, []
        for op in ops:
            op()


def _answers_after_the_step_message(operation) -> object:
    """Run `operation(proc)` (an operation of a scheduler process over `_StepScheduler`, that
    ends the running request r1) and check its answer comes only after the iteration's step
    message, which carries r1's final record; returns the answer."""
    import asyncio
    from types import SimpleNamespace

    from rltool.engine.request import Request
    from rltool.engine.sampling import SamplingParams
    from rltool.engine.scheduler_process import SchedulerProcess

    cfg = SimpleNamespace(max_running_requests=4, allowed_sync_hosts=[])
    sched, channel = _StepScheduler(), _SentChannel()
    proc = SchedulerProcess(cfg, channel, _StepRunner(), sched)
    req = Request(rid="r1", prompt_ids=[4, 5], params=SamplingParams())
    req.on_finish = proc.outbox.finished
    sched.running["r1"] = req

    async def run() -> object:
        answering = asyncio.ensure_future(operation(proc))
        while not sched.queued:
            await asyncio.sleep(0)
        sched.run_ops()  # the iteration's operations: they end r1
        for _ in range(10):  # turns of the loop enough for an answer to arrive
            await asyncio.sleep(0)
        assert not answering.done() and not channel.sent
        sched.on_iteration()  # the end of the iteration: its step message goes out
        assert [(m["t"], [f["rid"] for f in m["fin"]]) for m in channel.sent] == [
            ("step", ["r1"])]
        return await answering

    try:
        return asyncio.run(run())
    finally:
        proc.loop.close()


def test_an_abort_answers_after_the_final_records_it_made():
    """The reply to an abort comes after the step message with the final records of the
    requests it ended, so the front end has freed their ids when the client hears of it (a
    request id reused at once is no duplicate, as in one process). The reply came as soon as
    the scheduler thread had run the abort, often before that step message."""
    assert _answers_after_the_step_message(lambda proc: proc.ops.abort(rid="r1")) == 1


def test_a_weight_update_with_abort_all_answers_after_the_final_records_it_made():
    """A weight update with abort_all answers after the step message with the final records of
    the requests it aborted, as /abort_request does (an aborted id reused at once is no
    duplicate). Its answer came as soon as the scheduler thread had applied it."""
    loaded = []

    def update(proc):
        return proc.ops.apply(lambda: loaded.append(True), abort_all=True,
                              weight_version="v1")

    status, body = _answers_after_the_step_message(update)
    assert (status, body["success"], loaded) == (200, True, [True])
