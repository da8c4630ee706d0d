"""The text of a streamed request: in one process the scheduler thread decodes it incrementally
(`StreamedText`, only the tokens since the last whole characters), as the two-process front end
does, so a long stream costs decode work linear in its length and both layouts stream the same
text at every event, also for a tokenizer whose tokens split characters."""

from __future__ import annotations

import functools
import json
import shutil
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from rltool.data.tokenizer import CHARSET, build_tokenizer
from rltool.engine import api
from rltool.engine.app import EngineState, build_app
from rltool.engine.config import ServeConfig
from rltool.engine.loading import load_tokenizer
from rltool.engine.paged_runner import PagedRunner
from rltool.engine.paged_scheduler import PagedScheduler
from tests.engine.test_frontend_process import openai_stream_text, stream_events

NUM_STREAMED = 300
# Lead bytes and continuation bytes of é, 中, 文, 😀 and µ in place of CHARSET's last sixteen
# characters (the tiny model's vocabulary keeps its size): one token per byte, so sampled
# outputs cut characters and hold invalid UTF-8 (decoded as U+FFFD).
SPLIT_BYTES = "".join(chr(b) for b in (0xC3, 0xA9, 0xE4, 0xB8, 0xAD, 0xE6, 0x96, 0x87, 0xF0,
                                       0x9F, 0x98, 0x80, 0xC2, 0xB5, 0xA4, 0xBC))
SEEDED = {"input_ids": [5, 6, 7, 8], "sampling_params": {
    "max_new_tokens": 60, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}}


def test_a_long_one_process_stream_decodes_each_token_a_bounded_number_of_times(tiny_model_dir):
    """Regression: one process decoded the whole output at every streamed token, so a stream of
    n tokens decoded about n * n / 2 tokens. Each event's text is still the decode of the
    output so far (the tiny tokenizer never splits a character), the last one the whole
    output's."""
    runner = PagedRunner(tiny_model_dir, device="cpu", dtype="fp32", max_running=2, page_size=4)
    sched = PagedScheduler(runner, max_running=2)
    tokenizer = runner.tokenizer
    decode = tokenizer.decode
    decoded: list[int] = []

    def counting(ids, **kw):
        decoded.append(len(ids))
        return decode(ids, **kw)

    app = build_app(EngineState(cfg=ServeConfig(model=tiny_model_dir, device="cpu"),
                                runner=runner, scheduler=sched, started=time.monotonic()))
    sched.start()
    try:
        with TestClient(app) as client:
            tokenizer.decode = counting
            body = {**SEEDED, "sampling_params": {**SEEDED["sampling_params"],
                                                  "max_new_tokens": NUM_STREAMED}, "stream": True}
            with client.stream("POST", api.GENERATE, json=body) as r:
                assert r.status_code == 200
                lines = [x[len("data: "):] for x in r.iter_lines() if x.startswith("data: ")]
    finally:
        del tokenizer.decode
        sched.stop()
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    # an event per token while the stream keeps up, fewer when tokens come faster
    assert 1 <= len(events) <= NUM_STREAMED and len(events[-1]["output_ids"]) == NUM_STREAMED
    for event in events:
        assert event["text"] == decode(event["output_ids"], skip_special_tokens=True)
    # Two decodes of at most a seam's tokens and the new one per token, and the final decode.
    assert sum(decoded) <= 8 * NUM_STREAMED + NUM_STREAMED, (len(decoded), sum(decoded))


@pytest.fixture(scope="module")
def split_char_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with a byte-level tokenizer of the same size whose tokens split
    characters."""
    out = tmp_path_factory.mktemp("split-chars") / "model"
    shutil.copytree(tiny_model_dir, out)
    build_tokenizer(out, charset=CHARSET[:-len(SPLIT_BYTES)] + SPLIT_BYTES)
    return out


@pytest.fixture(scope="module")
def both_layouts(split_char_model, tmp_path_factory):
    from rltool.rollout.launch import start_engine

    engines = {}
    try:
        for flag in ("--no-frontend-process", "--frontend-process"):
            log_path = tmp_path_factory.mktemp("engine-logs") / f"split{flag}.log"
            engines[flag] = start_engine(["--engine", "builtin", "--model", str(split_char_model),
                                          "--num-threads", "1", flag], log_path=log_path,
                                         ready_timeout_s=120.0)
        yield engines["--no-frontend-process"], engines["--frontend-process"]
    finally:
        for engine in engines.values():
            engine.stop()


def test_both_layouts_stream_the_same_text_at_every_event(both_layouts, split_char_model):
    """A seeded request whose output cuts characters streams the same events (text, tokens) in
    one process as in two: only whole characters, each event's text extending the last one's,
    and the final text the decode of the whole output. Which token counts get an event depends
    on how fast the stream runs (events hold every token so far), so the layouts are compared
    where both sent one."""
    one, two = ([(e["text"], e["output_ids"], e["meta_info"]["finish_reason"])
                 for e in stream_events(engine.url, {**SEEDED, "stream": True})]
                for engine in both_layouts)
    assert one[-1] == two[-1]
    at = {len(ids): (text, ids) for text, ids, _ in one}
    assert all(at[len(ids)] == (text, ids) for text, ids, _ in two if len(ids) in at)
    tokenizer = load_tokenizer(split_char_model)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    final_ids = one[-1][1]
    assert any(decode(final_ids[:k]).endswith("\ufffd") for k in range(1, len(final_ids))), (
        "the output never ends inside a character")
    for events in (one, two):
        texts = [text for text, _, _ in events]
        assert not any(t.endswith("\ufffd") for t in texts[:-1])
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert all(decode(ids).startswith(text) for text, ids, _ in events)
        assert texts[-1] == decode(final_ids)


def test_openai_stream_of_split_characters_adds_up_to_the_plain_text(both_layouts):
    """The chunks of a streamed completion whose tokens split characters add up to the plain
    completion's text in either layout (a streamed text that ended in U+FFFD and then changed
    lost every later chunk's text)."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 60, "temperature": 1.0, "seed": 11,
            "ignore_eos": True}
    for engine in both_layouts:
        plain = httpx.post(engine.url + api.OPENAI_COMPLETIONS, json=body, timeout=60.0).json()
        assert openai_stream_text(engine.url, body) == plain["choices"][0]["text"]
