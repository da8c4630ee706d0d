"""Regression: aborting one request of a running decode batch (non-deterministic mode) left its rid
in the batch, so every later decode step raised KeyError and the engine answered 500 forever."""

from __future__ import annotations

import asyncio

from rltool.rollout.client import EngineClient

LONG = {"max_new_tokens": 300, "ignore_eos": True}


def test_abort_one_of_a_batch_keeps_the_engine_serving(tiny_model_dir, tmp_path):
    from rltool.rollout.launch import start_engine

    engine = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir)],
                          log_path=tmp_path / "engine.log", ready_timeout_s=120.0)
    try:
        async def main():
            async with EngineClient(engine.url, timeout_s=60) as c:
                tasks = [asyncio.create_task(c.generate({"text": "ab", "rid": f"batch-{i}",
                                                         "sampling_params": LONG}))
                         for i in range(3)]
                start = None  # decode forwards when all three were running
                for _ in range(3000):
                    st = (await c.get_server_info())["internal_states"][0]
                    if start is None and st["num_running_reqs"] == 3:
                        start = st["num_decode_forwards"]
                    if start is not None and st["num_decode_forwards"] > start:
                        break  # a decode forward ran all three: they share the batch
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("the three requests never shared a decode batch")
                await c.abort_request(rid="batch-1")
                outs = await asyncio.gather(*tasks)
                after = await c.generate({"text": "ab", "sampling_params": {"max_new_tokens": 4}})
                return outs, after

        outs, after = asyncio.run(main())
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
        assert reasons == ["length", "abort", "length"]
        assert after["meta_info"]["completion_tokens"] >= 1
    finally:
        engine.stop()
