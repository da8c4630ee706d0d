"""The builtin engine's adapters replaced and loaded while it serves: a policy sync of a smaller
adapter leaves nothing of the larger one, and /load_lora_adapter reads its files off the
scheduler thread."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from rltool.engine import lora_registry
from rltool.engine.paged_runner import PagedRunner
from tests.helpers.lora_adapters import ALL_TARGETS, make_adapter

PROMPT = [12, 4, 4, 9, 1, 2, 3, 8]


@pytest.fixture(scope="module")
def big_and_small(tiny_model_dir):
    """Rank 8 on every linear, then rank 4 on q/v only (other alpha, other blocks)."""
    root = tiny_model_dir.parent
    _, big = make_adapter(tiny_model_dir, root / "lora-r8-all", r=8, alpha=16,
                          targets=ALL_TARGETS, seed=11)
    _, small = make_adapter(tiny_model_dir, root / "lora-r4-qv", r=4, alpha=12,
                            targets=["q_proj", "v_proj"], seed=12)
    return big, small


def runner_of(model_dir, deterministic):
    return PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=8, page_size=4,
                       max_total_tokens=512, enable_lora=True, max_lora_rank=8,
                       deterministic=deterministic)


def sync(runner, path, how):
    """A policy sync of adapter directory `path`: from disk (as a delta also ends), or as
    tensors with the adapter's config in two buckets (as the loop sends them)."""
    from safetensors.torch import load_file

    if how == "disk":
        runner.load_weights(path)
        return
    named = sorted(load_file(str(path / "adapter_model.safetensors")).items())
    config = json.loads((path / "adapter_config.json").read_text())
    half = len(named) // 2
    runner.load_named_tensors(named[:half], lora_config=config)
    runner.load_named_tensors(named[half:], lora_config=config)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("first,second", [("tensor", "tensor"), ("disk", "tensor"),
                                          ("tensor", "disk"), ("disk", "disk")])
def test_smaller_policy_adapter_replaces_the_larger_exactly(tiny_model_dir, big_and_small,
                                                            deterministic, first, second):
    """Rank 8 on every module synced, then rank 4 on q/v only: the buffers and logits are those
    of an engine that synced only the second adapter, bit for bit (the first one's rows 4..7
    and its k/o/gate/up/down modules are gone), and the policy says rank 4."""
    big, small = big_and_small
    runner, alone = runner_of(tiny_model_dir, deterministic), runner_of(tiny_model_dir,
                                                                         deterministic)
    sync(alone, small, "disk")
    sync(runner, big, first)
    with_big = runner.full_pass_logits(PROMPT, start=1)
    sync(runner, small, second)
    got, want = runner.full_pass_logits(PROMPT, start=1), alone.full_pass_logits(PROMPT, start=1)
    assert not torch.equal(with_big, want)
    assert torch.equal(got, want)
    for key, (a, b) in alone.lora.layers.weights.items():
        assert torch.equal(runner.lora.layers.weights[key][0], a), key
        assert torch.equal(runner.lora.layers.weights[key][1], b), key
    assert runner.lora.describe()[0]["rank"] == 4
    assert runner.lora.describe()[0]["scaling"] == 3.0


def test_same_coverage_sync_replaces_block_by_block(tiny_model_dir, big_and_small):
    """A tensor sync of the policy's own rank and modules (the loop's every step) overwrites its
    blocks in place: a bucket uploads only the fused linears it touched."""
    from safetensors.torch import load_file

    big, _ = big_and_small
    runner = runner_of(tiny_model_dir, False)
    sync(runner, big, "disk")
    layers, uploads = runner.lora.layers, []
    update = layers.update
    layers.update = lambda adapter, keys: (uploads.append(keys), update(adapter, keys))[1]
    config = json.loads((big / "adapter_config.json").read_text())
    named = sorted(load_file(str(big / "adapter_model.safetensors")).items())
    runner.load_named_tensors(named[:2], lora_config=config)
    assert uploads == [{(0, "down")}]


def test_load_reads_the_adapter_while_the_scheduler_steps(tiny_model_dir, big_and_small,
                                                          monkeypatch):
    """/load_lora_adapter held inside its file read: a whole generation runs meanwhile (the
    scheduler keeps stepping), and the load completes once the read is let go."""
    from rltool.engine.config import ServeConfig
    from tests.helpers.engines import serve_app

    big, _ = big_and_small
    entered, release = threading.Event(), threading.Event()
    read, readers = lora_registry.read_adapter, []

    def held_read(*args, **kwargs):
        readers.append(threading.current_thread().name)
        entered.set()
        assert release.wait(60)
        return read(*args, **kwargs)

    monkeypatch.setattr(lora_registry, "read_adapter", held_read)
    admin = {"Authorization": "Bearer sekret"}
    cfg = ServeConfig(model=tiny_model_dir, device="cpu", enable_lora=True, max_lora_rank=8,
                      admin_api_key="sekret")
    with serve_app(cfg) as (client, runner):
        sched = client.app.state.engine.scheduler
        answers = []
        loader = threading.Thread(target=lambda: answers.append(client.post(
            "/load_lora_adapter", headers=admin,
            json={"lora_name": "big", "lora_path": str(big)})))
        loader.start()
        try:
            assert entered.wait(60)
            steps, outs = sched.num_decode_forwards, []
            gen = threading.Thread(target=lambda: outs.append(client.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                         "ignore_eos": True}})))
            gen.start()
            gen.join(60)
            assert outs, "no generation while the adapter's files were read"
            assert outs[0].status_code == 200, outs[0].text
            assert len(outs[0].json()["output_ids"]) == 12
            assert sched.num_decode_forwards >= steps + 11
            assert not answers and loader.is_alive()  # still in its read
        finally:
            release.set()
            loader.join(60)
            if "gen" in locals():
                gen.join(60)
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["loaded_adapters"] == {"big": str(big)}
        assert readers and readers[0] != "rltool-scheduler"
        again = client.post("/load_lora_adapter", headers=admin,
                            json={"lora_name": "big", "lora_path": str(big)})
        assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
