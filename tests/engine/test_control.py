"""The builtin engine's control plane on a deterministic engine this module owns: deterministic
invariance and exact trainer-layout logprobs, pause modes, abort, weight updates (version spans),
memory release/resume, queue limits, and a clean shutdown."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from rltool.errors import EngineError
from rltool.logprobs import sequence_logprobs
from rltool.rollout.client import EngineClient

LONG = {"max_new_tokens": 400, "ignore_eos": True}


def rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def wait_decoding(c: EngineClient, request_id: str, *, tokens: int = 3) -> None:
    """Wait until `request_id`, the one request these tests run at a time, has been in at least
    `tokens` decode forwards: counted from the first poll that sees it in flight."""
    start = None
    for _ in range(3000):
        st = (await c.get_server_info())["internal_states"][0]
        if start is None and st["num_running_reqs"] > 0:
            start = st["num_decode_forwards"]
        if start is not None and st["num_decode_forwards"] - start >= tokens:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{request_id} never started decoding")


async def wait_queued(c: EngineClient, *, requests: int = 1) -> dict:
    """Wait until the engine holds `requests` requests queued (not running): a request sent while
    generation is paused or the weights are released has reached the engine and is held there.
    The bound on polls only ends a hang."""
    for _ in range(3000):
        st = (await c.get_server_info())["internal_states"][0]
        if st["num_waiting_reqs"] >= requests:
            return st
        await asyncio.sleep(0.01)
    raise AssertionError(f"no request was ever queued: {st}")


def run(coro):
    return asyncio.run(coro)


def test_deterministic_alone_vs_among_15_others_and_trainer_layout(det_engine, tiny_model_dir):
    probe = {"input_ids": [5, 9, 13, 2, 30], "return_logprob": True,
             "sampling_params": {"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95,
                                 "sampling_seed": 7, "ignore_eos": True}}

    async def main():
        async with EngineClient(det_engine.url, timeout_s=120) as c:
            alone = await c.generate({**probe, "rid": rid("alone")})
            others = [c.generate({"input_ids": [7 + i, 3 + i, 11] * (1 + i % 4),
                                  "sampling_params": {"max_new_tokens": 5 + 3 * i,
                                                      "sampling_seed": i}, "rid": rid("o")})
                      for i in range(15)]
            crowd = await asyncio.gather(*others[:8], c.generate({**probe, "rid": rid("crowd")}),
                                         *others[8:])
            st = (await c.get_server_info())["internal_states"][0]
            return alone, crowd[8], st

    alone, crowded, st = run(main())
    assert st["max_decode_batch_seen"] >= 8  # it really ran among the others
    assert alone["output_ids"] == crowded["output_ids"]
    lp_alone = [x[0] for x in alone["meta_info"]["output_token_logprobs"]]
    lp_crowd = [x[0] for x in crowded["meta_info"]["output_token_logprobs"]]
    assert lp_alone == lp_crowd  # bit-identical
    # Exact alignment with the trainer's layout (rltool.logprobs.sequence_logprobs, fp32).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ref = sequence_logprobs(model, probe["input_ids"] + alone["output_ids"],
                            response_start=len(probe["input_ids"]), temperature=0.9)
    assert ref.tolist() == lp_alone


def test_abort_request_by_rid(det_engine):
    r = rid("abortme")

    async def main():
        async with EngineClient(det_engine.url, timeout_s=60) as c:
            task = asyncio.create_task(c.generate({"text": "ab", "rid": r, "return_logprob": True,
                                                   "sampling_params": LONG}))
            await wait_decoding(c, r)
            await c.abort_request(rid=r)
            return await task

    out = run(main())
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 400
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]


def test_pause_abort_blocks_new_requests_until_continue(det_engine):
    r = rid("pa")

    async def main():
        async with EngineClient(det_engine.url, timeout_s=60) as c:
            task = asyncio.create_task(c.generate({"text": "ab", "rid": r, "sampling_params": LONG}))
            await wait_decoding(c, r)
            await c.pause_generation("abort")
            aborted = await task
            late = asyncio.create_task(c.generate({"text": "x", "sampling_params":
                                                   {"max_new_tokens": 2}}))
            queued = await wait_queued(c)  # it reached the engine, which holds it
            blocked = not late.done() and queued["num_running_reqs"] == 0
            ready = httpx.get(det_engine.url + "/ready").status_code
            health = await c.health()
            await c.continue_generation()
            return aborted, blocked, await late, ready, health

    aborted, blocked, late, ready, health = run(main())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert blocked and late["meta_info"]["completion_tokens"] == 2
    assert ready == 503 and health is True  # paused: not ready, but alive (docs/serve.md)
    assert httpx.get(det_engine.url + "/ready").status_code == 200


def test_pause_retract_recomputes_and_allows_flush(det_engine):
    r = rid("pr")
    # Long enough that the request is still decoding when the pause lands on a loaded machine
    # (60 tokens finished before the pause under CI load).
    sp = {"max_new_tokens": 300, "ignore_eos": True, "sampling_seed": 3}

    async def main():
        async with EngineClient(det_engine.url, timeout_s=60) as c:
            ref = await c.generate({"input_ids": [4, 5, 6], "rid": rid("ref"),
                                    "sampling_params": sp})
            task = asyncio.create_task(c.generate({"input_ids": [4, 5, 6], "rid": r,
                                                   "sampling_params": sp}))
            await wait_decoding(c, r)
            await c.pause_generation("retract")
            st = (await c.get_server_info())["internal_states"][0]
            await c.flush_cache()  # allowed: nothing holds KV while retracted
            await c.continue_generation()
            return ref, await task, st

    ref, out, st = run(main())
    assert st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 1
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    # Recomputed KV gives the same continuation (deterministic engine).
    assert out["output_ids"] == ref["output_ids"]


def test_weight_update_in_place_mid_generation_gives_version_spans(det_engine, other_weights_dir,
                                                                  tiny_model_dir):
    r = rid("wu")

    async def main():
        async with EngineClient(det_engine.url, timeout_s=60) as c:
            task = asyncio.create_task(c.generate({"text": "ab", "rid": r, "return_logprob": True,
                                                   "sampling_params": LONG}))
            await wait_decoding(c, r, tokens=5)
            await c.pause_generation("in_place")
            with pytest.raises(EngineError) as flush_err:  # KV is held: flush refused
                await c.flush_cache()
            res = await c.update_weights_from_disk(str(other_weights_dir), weight_version="1")
            info = await c.get_model_info()
            await c.continue_generation()
            out = await task
            back = await c.update_weights_from_disk(str(tiny_model_dir), weight_version="2")
            return flush_err.value, res, info, out, back

    flush_err, res, info, out, back = run(main())
    assert flush_err.status_code == 400
    assert res["success"] is True and "Weight version updated to 1" in res["message"]
    assert res["num_paused_requests"] == 1
    assert info["weight_version"] == "1" and info["model_path"] == str(other_weights_dir)
    spans = out["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 400
    assert 5 <= spans[1]["start"] < 400
    assert out["meta_info"]["weight_version"] == "1"
    assert back["success"] is True


def test_weight_update_waits_for_in_flight_requests(det_engine, other_weights_dir):
    """An unpaused update waits for the request in flight (SGLang's writer lock): every token of
    that request comes from the version served before the update, whatever version the shared
    engine serves when the test starts."""
    r = rid("wait")

    async def main():
        async with EngineClient(det_engine.url, timeout_s=60) as c:
            before = (await c.get_model_info())["weight_version"]
            task = asyncio.create_task(c.generate({"text": "ab", "rid": r, "sampling_params":
                                                   {"max_new_tokens": 80, "ignore_eos": True}}))
            await wait_decoding(c, r)
            res = await c.update_weights_from_disk(str(other_weights_dir), weight_version="3")
            after = (await c.get_model_info())["weight_version"]
            return before, res, after, await task

    before, res, after, out = run(main())
    assert before != "3" and after == "3"
    assert res["success"] and res["num_paused_requests"] == 0
    assert out["meta_info"]["weight_versions"] == [{"version": before, "start": 0, "end": 80}]


def test_wrong_shape_checkpoint_is_refused_and_serving_continues(det_engine, tiny_model_dir,
                                                                 tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    name = "model.embed_tokens.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    r = httpx.post(det_engine.url + "/update_weights_from_disk", timeout=60,
                   json={"model_path": str(bad), "weight_version": "bad"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert name in r.json()["message"]
    ok = httpx.post(det_engine.url + "/generate", timeout=60,
                    json={"text": "a", "sampling_params": {"max_new_tokens": 2}}).json()
    assert ok["meta_info"]["weight_version"] == "3"


def test_release_and_resume_memory(det_engine):
    async def main():
        async with EngineClient(det_engine.url, timeout_s=60) as c:
            await c.release_memory_occupation()
            st = (await c.get_server_info())["internal_states"][0]
            healthy = await c.health()
            pending = asyncio.create_task(c.generate({"text": "a", "sampling_params":
                                                      {"max_new_tokens": 3}}))
            queued = await wait_queued(c)  # it reached the engine, which holds it
            waited = not pending.done() and queued["num_running_reqs"] == 0
            await c.resume_memory_occupation()
            return st, healthy, waited, await pending

    st, healthy, waited, out = run(main())
    assert st["weights_released"] is True and healthy and waited
    assert out["meta_info"]["completion_tokens"] == 3


def test_update_weight_version_only_renames(det_engine):
    r = httpx.post(det_engine.url + "/update_weight_version", timeout=30,
                   json={"new_version": "7", "abort_all_requests": False})
    assert r.status_code == 200 and r.json()["new_version"] == "7"
    out = httpx.post(det_engine.url + "/generate", timeout=60,
                     json={"text": "a", "sampling_params": {"max_new_tokens": 1}}).json()
    assert out["meta_info"]["weight_version"] == "7"
    assert httpx.post(det_engine.url + "/update_weight_version", json={},
                      timeout=30).status_code == 400


def test_a_full_queue_gives_429_and_a_body_that_never_fits_400(det_engine):
    """16 running + 64 queued at most: a body of 100 prompts can never be taken (400, naming the
    limit); one of 80 held while generation is paused fills the queue, so the next request waits
    for room (429, retryable)."""
    one = {"max_new_tokens": 1}
    r = httpx.post(det_engine.url + "/generate", timeout=60,
                   json={"input_ids": [[5, 6]] * 100, "sampling_params": one})
    assert r.status_code == 400 and "holds at most 80" in r.text

    async def main():
        async with EngineClient(det_engine.url, timeout_s=60) as c:
            await c.pause_generation("in_place")
            fill = asyncio.create_task(c.generate({"input_ids": [[5, 6]] * 80,
                                                   "sampling_params": one}))
            await wait_queued(c, requests=80)
            more = await asyncio.to_thread(
                httpx.post, det_engine.url + "/generate", timeout=30,
                json={"input_ids": [5, 6], "sampling_params": one})
            await c.continue_generation()
            return more.status_code, len(await fill)

    assert run(main()) == (429, 80)


def test_shutdown_leaves_no_process_behind(det_engine):
    """Runs last in this module: SIGTERM with a request in flight ends the server cleanly."""
    pid = det_engine.pid

    async def main():
        async with EngineClient(det_engine.url, timeout_s=30, max_retries=0) as c:
            task = asyncio.create_task(c.generate({"text": "a", "sampling_params": LONG}))
            # Stop as soon as the request runs (a fixed sleep let a fast host finish all 400
            # tokens first).
            while (await c.get_server_info())["internal_states"][0]["num_running_reqs"] == 0:
                await asyncio.sleep(0.01)
            code = await asyncio.to_thread(det_engine.stop, 15)
            try:
                result = await task
            except EngineError as e:
                result = e
            return code, result

    code, result = run(main())
    assert code == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    # The in-flight request got an answer (an abort or an error), not a hang.
    assert isinstance(result, EngineError) or result["meta_info"]["finish_reason"]["type"] == "abort"
