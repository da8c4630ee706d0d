"""The builtin engine in the caller's process: the same answers as its /generate route, weight
copies bit-equal to the sender's tensors (cast to the engine's dtype), and the route's refusals
raised as EngineError with the route's status."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rltool.engine import api
from rltool.engine.config import ServeConfig
from rltool.engine.inprocess import InProcessEngine
from rltool.errors import EngineError
from tests.engine.test_transfer import served
from tests.helpers.engines import serve_app

pytestmark = pytest.mark.timeout(120)
PAYLOAD = {"input_ids": [[5, 6, 7], [5, 6, 7], [8, 9]], "return_logprob": True,
           "sampling_params": [{"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": s}
                               for s in (1, 2, 3)]}


@pytest.fixture
def engine(tiny_model_dir):
    eng = InProcessEngine(ServeConfig(model=tiny_model_dir, device="cpu", deterministic=True,
                                      weight_version="0"))
    yield eng
    eng.stop()


def test_generate_answers_as_the_http_route(engine, tiny_model_dir):
    cfg = ServeConfig(model=tiny_model_dir, device="cpu", deterministic=True, weight_version="0")
    with serve_app(cfg) as (client, _):
        over_http = client.post(api.GENERATE, json=PAYLOAD).json()
    direct = asyncio.run(engine.generate(PAYLOAD))
    assert isinstance(direct, list) and len(direct) == 3
    for a, b in zip(direct, over_http):
        assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
        assert a["meta_info"]["weight_version"] == "0"
    one = asyncio.run(engine.generate({**PAYLOAD, "input_ids": [5, 6, 7],
                                       "sampling_params": PAYLOAD["sampling_params"][0]}))
    assert one["output_ids"] == direct[0]["output_ids"]
    info = asyncio.run(engine.get_model_info())
    assert info["tokenizer_path"] == str(tiny_model_dir) and info["dtype"] == "fp32"


def test_bad_body_is_an_engine_error_with_the_route_status(engine):
    with pytest.raises(EngineError) as err:
        asyncio.run(engine.generate({"input_ids": [5], "sampling_params": {"temperature": -1}}))
    assert err.value.status_code == 400 and "temperature" in str(err.value)


def test_load_tensors_is_bit_equal_and_all_or_nothing(engine):
    gen = torch.Generator().manual_seed(1)
    # Sent as float64: the engine casts to its own dtype (fp32), as the trainer's may differ.
    named = [(n, torch.randn(t.shape, generator=gen, dtype=torch.float64))
             for n, t in served(engine.runner).items()]
    engine.load_tensors(named, weight_version="7")
    now = served(engine.runner)
    for n, t in named:
        assert torch.equal(now[n], t.to(torch.float32)), n
    assert engine.runner.weight_version == "7"
    name, t = named[0]
    with pytest.raises(EngineError) as err:
        engine.load_tensors([(n, t * 2) for n, t in named[1:]] + [(name, t[:1])],
                            weight_version="8")
    assert err.value.status_code == 400 and "shape" in str(err.value)
    after = served(engine.runner)
    assert all(torch.equal(after[n], now[n]) for n in now)
    assert engine.runner.weight_version == "7"
    out = asyncio.run(engine.generate({**PAYLOAD, "input_ids": [5, 6, 7],
                                       "sampling_params": PAYLOAD["sampling_params"][0]}))
    assert out["meta_info"]["weight_version"] == "7"


def test_release_and_resume_memory(engine):
    """Released, the engine holds no weights and refuses a weight update; resumed, it answers
    as before (the weights of the checkpoint it was started with)."""
    before = asyncio.run(engine.generate(PAYLOAD))
    engine.release_memory()
    assert engine.runner.released
    with pytest.raises(EngineError, match="weights are released"):
        engine.load_tensors([], weight_version="1")
    engine.resume_memory()
    assert not engine.runner.released
    after = asyncio.run(engine.generate(PAYLOAD))
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]


def test_calls_on_a_stopped_engine_fail_with_503(engine):
    """A stopped engine's scheduler refuses every call with 'the engine is shutting down': each
    is raised with the 503 the routes answer, as is a weight update queued while the engine
    stopped (they were raised with no status, which callers took for neither bad input nor a
    stopping engine)."""
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(30)

    held = engine.scheduler.call(hold)
    assert entered.wait(30)
    waited: list[BaseException] = []

    def update() -> None:
        try:
            engine.load_tensors([], weight_version="1")
        except EngineError as e:
            waited.append(e)

    thread = threading.Thread(target=update)
    thread.start()
    engine.scheduler.request_stop()
    gate.set()
    held.result(30)
    thread.join(30)
    engine.stop()
    calls = {"load_tensors": lambda: engine.load_tensors([], weight_version="2"),
             "release_memory": engine.release_memory,
             "resume_memory": engine.resume_memory,
             "abort_request": lambda: asyncio.run(engine.abort_request(abort_all=True)),
             "generate": lambda: asyncio.run(engine.generate(PAYLOAD))}
    for name, call in calls.items():
        with pytest.raises(EngineError) as err:
            call()
        assert err.value.status_code == 503, name
        assert "the engine is shutting down" in str(err.value), name
    assert len(waited) == 1 and waited[0].status_code == 503
    assert "the engine is shutting down" in str(waited[0])
