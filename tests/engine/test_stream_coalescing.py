"""A stream's updates coalesce (`EngineState.updates`): tokens that come while the stream is not
running reach it as one cumulative event per request, in either layout (the two-process front
end calls back on the event loop's thread, one process from the scheduler thread); a response
the front end fails to build ends only that request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rltool.engine.config import ServeConfig
from rltool.engine.link import EngineInfo
from rltool.engine.loading import load_tokenizer
from rltool.engine.request import Request
from rltool.engine.routes.base import EngineState
from rltool.engine.sampling import SamplingParams


class RecordingLink:
    """Takes submitted requests and aborts; the test plays the scheduler."""

    weight_version = "0"
    lora_names = None

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def submit(self, reqs, *, on_refused) -> None:
        pass

    def abort(self, rids) -> None:
        self.aborted += rids


@pytest.fixture
def state(tiny_model_dir):
    info = EngineInfo(tokenizer=load_tokenizer(tiny_model_dir), model_path=str(tiny_model_dir),
                      tokenizer_path=str(tiny_model_dir), context_length=512, vocab_size=64,
                      max_total_num_tokens=1024, moe=False, lora_enabled=False)
    return EngineState(cfg=ServeConfig(model=tiny_model_dir, device="cpu"), link=RecordingLink(),
                       info=info)


def requests() -> list[Request]:
    return [Request(rid=rid, prompt_ids=[4, 5], params=SamplingParams()) for rid in "ab"]


def token(req: Request, t: int) -> None:
    req.record_token(t, -0.5, version="0")
    req.on_token(req)


def finish(req: Request) -> None:
    req.finish_reason = {"type": "length", "length": len(req.output_ids)}
    req.on_finish(req)


async def consume(state: EngineState, reqs: list[Request], events: list) -> None:
    async for i, final, event in state.updates(reqs):
        events.append((i, final, list(event["output_ids"]),
                       event["meta_info"]["finish_reason"]))


def test_tokens_between_runs_of_the_stream_are_one_event(state):
    async def main():
        reqs, events = requests(), []
        task = asyncio.create_task(consume(state, reqs, events))
        await asyncio.sleep(0)  # the stream submits and waits
        a, b = reqs
        for t in (7, 8, 9):
            token(a, t)
        token(b, 3)
        await asyncio.sleep(0.01)
        assert events == [(0, False, [7, 8, 9], None), (1, False, [3], None)]
        token(b, 4)
        finish(a)
        finish(b)
        await task
        return events[2:]

    assert asyncio.run(main()) == [(0, True, [7, 8, 9], {"type": "length", "length": 3}),
                                   (1, True, [3, 4], {"type": "length", "length": 2})]


def test_updates_from_the_scheduler_thread_coalesce_too(state):
    async def main():
        reqs, events = requests(), []
        task = asyncio.create_task(consume(state, reqs, events))
        await asyncio.sleep(0)
        a, b = reqs

        def scheduler() -> None:  # responses are built on this thread, in token order
            for t in (7, 8, 9):
                token(a, t)
            finish(a)
            token(b, 3)
            finish(b)

        thread = threading.Thread(target=scheduler)
        thread.start()
        thread.join()
        await task
        return events

    assert asyncio.run(main()) == [(0, True, [7, 8, 9], {"type": "length", "length": 3}),
                                   (1, True, [3], {"type": "length", "length": 1})]


def test_a_response_that_fails_to_build_ends_only_its_request(state, monkeypatch):
    respond = state.respond

    def failing(req: Request):
        if req.rid == "a" and req.finish_reason is None:
            raise ValueError("cannot build")
        return respond(req)

    monkeypatch.setattr(state, "respond", failing)

    async def main():
        reqs, events = requests(), []
        task = asyncio.create_task(consume(state, reqs, events))
        await asyncio.sleep(0)
        a, b = reqs
        token(a, 7)
        token(b, 3)
        await asyncio.sleep(0.01)
        token(a, 8)  # the request already ended for its stream: nothing more of it is sent
        finish(b)
        await task
        return events

    events = asyncio.run(main())
    assert [(i, final) for i, final, _, _ in events] == [(0, True), (1, False), (1, True)]
    reason = events[0][3]
    assert reason["status_code"] == 500 and "ValueError: cannot build" in reason["message"]
    assert state.link.aborted == ["a"]
