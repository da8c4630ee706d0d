"""In-flight weight updates of the async rollout stream against a live engine, checked token by
token in the shard: in_place and retract keep the tokens generated before the update (a sample
shows version 0 tokens followed by version 1 tokens), abort regenerates the aborted samples from
scratch (every token of a requeued sample is from the new version)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from rltool.data.tasks import make_rows, write_prompts
from rltool.loop.async_rollout import RolloutStream
from rltool.loop.async_staleness import StalenessGate

pytestmark = pytest.mark.slow
MAX_UPDATES = 6  # an update may land when nothing is mid-generation; then try the next version
IDLE_WAIT_S = 30.0  # the longest wait for the stream to be generating before an update


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from rltool.rollout.launch import start_engine

    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = start_engine(["--engine", "builtin", "--model", str(tiny_model_dir), "--num-threads",
                         "1"], log_path=log, ready_timeout_s=120.0)
    yield proc
    proc.stop()


def engine_state(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]


def wait_until_generating(stream: RolloutStream, url: str) -> None:
    """Until the stream has samples in flight and the engine has decoded tokens for requests it
    is still running: the state an update should land in (rather than a sleep that hopes some
    tokens are in). Nothing is asserted here: the stream's gate may hold it idle until the next
    take, and samples may finish first; the update then lands with nothing mid-generation and the
    loop tries the next version. The deadline only bounds that wait."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while stream.in_flight_samples() == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    before = engine_state(url)["total_output_tokens"]
    while stream.in_flight_samples() > 0 and time.monotonic() < deadline:
        state = engine_state(url)
        if state["num_running_reqs"] > 0 and state["total_output_tokens"] > before:
            return
        time.sleep(0.005)


async def update(url: str, model_dir: str, *, mode: str, version: int) -> None:
    from rltool.rollout.client import EngineClient

    async with EngineClient(url) as client:
        await client.pause_generation(mode)
        await client.update_weights_from_disk(model_dir, weight_version=str(version))
        await client.continue_generation()


def shard_versions(stream: RolloutStream, groups: list, out) -> list[list[int]]:
    """Write the groups as a shard and read each sample's per-token versions back from it."""
    from rltool.data.shards import open_shard

    cfg = stream.cfg.model_copy(update={"out": str(out)})
    stream.inputs.write(cfg, groups, meta=stream.inputs.shard_meta(cfg, producer="test",
                                                                    extra={}),
                        config_name="rollout_config.toml")
    return [v for b in open_shard(out).iter_batches(columns=["weight_versions"])
            for v in b.column("weight_versions").to_pylist()]


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_update_modes_keep_or_regenerate_tokens(mode, engine, tiny_model_dir, tmp_path):
    from rltool.rollout.stage import RolloutConfig

    write_prompts(make_rows("reverse", num=16, seed=1), tmp_path / "p.jsonl")
    cfg = RolloutConfig(engines=[engine.url], prompts=str(tmp_path / "p.jsonl"),
                        out=str(tmp_path / "unused"), reward="reverse:partial",
                        n_samples_per_prompt=2, rollout_batch_size=2, max_response_len=400,
                        seed=0, quiet=True)
    stream = RolloutStream(cfg, gate=StalenessGate(max_staleness=1, batch_groups=2,
                                                   versions_per_step=1),
                           engine_version=0, next_position=0, redo=[])
    stream.start()
    mixed, single_new, requeued = 0, 0, 0
    try:
        for version in range(1, MAX_UPDATES + 1):
            wait_until_generating(stream, engine.url)
            asyncio.run(update(engine.url, str(tiny_model_dir), mode=mode, version=version))
            stream.set_versions(trainer_version=version, engine_version=version)
            groups, dropped, _ = stream.take(4, train_version=version)
            assert not dropped  # K=1 and one update per batch: nothing can be older
            requeued += stream.requeued_since_last_call()
            for versions in shard_versions(stream, groups, tmp_path / f"shard-{version}"):
                assert versions == sorted(versions)  # a version never goes back
                if {version - 1, version} <= set(versions):
                    mixed += 1
                elif set(versions) == {version}:
                    single_new += 1
            if (mixed if mode != "abort" else requeued):
                break
    finally:
        stream.stop()
    if mode == "abort":
        assert requeued > 0 and mixed == 0 and single_new >= requeued
    else:
        assert mixed > 0 and requeued == 0
