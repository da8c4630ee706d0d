"""A LoRA run's delta sync across a change of adapter (another rank, fewer target modules): the
engine ends up serving exactly the new adapter, nothing of the old one."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from rltool.delta.config import SyncConfig
from rltool.delta.publish import publish_version
from rltool.delta.pull import pull_weights
from rltool.engine.paged_runner import PagedRunner
from rltool.io.checkpoint import is_delta_dir
from rltool.rundir import weight_dir_name
from rltool.train.lora import model_tensors, write_adapter
from tests.helpers.lora_adapters import ALL_TARGETS, make_adapter

PROMPT = [12, 4, 4, 9, 1, 2, 3, 8]


def runner_of(model_dir):
    return PagedRunner(model_dir, device="cpu", dtype="fp32", max_running=8, page_size=4,
                       max_total_tokens=512, enable_lora=True, max_lora_rank=8)


def test_delta_sync_to_a_smaller_adapter_serves_it_alone(tiny_model_dir, tmp_path):
    """Version 1 rank 8 on every module, version 2 rank 4 on q/v only (no delta possible: other
    tensors, so a full version), version 3 the same adapter changed (a delta on version 2): the
    engine that pulled and loaded each in turn serves versions 2 and 3 bit for bit as an engine
    that loaded only that one."""
    _, big = make_adapter(tiny_model_dir, tmp_path / "big", r=8, alpha=16, targets=ALL_TARGETS,
                          seed=21)
    _, small = make_adapter(tiny_model_dir, tmp_path / "small", r=4, alpha=12,
                            targets=["q_proj", "v_proj"], seed=22)
    changed = tmp_path / "changed"
    changed.mkdir()
    tensors = model_tensors(load_file(str(small / "adapter_model.safetensors")))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 0.5
    write_adapter(changed, tensors=tensors,
                  config=json.loads((small / "adapter_config.json").read_text()))

    publish, local = tmp_path / "publish", tmp_path / "engine-weights"
    sync = SyncConfig(sync="delta")
    runner = runner_of(tiny_model_dir)
    for version, src in enumerate((big, small, changed), start=1):
        publish_version(src, sync, publish_dir=publish, version=version)
        pull_weights(local_checkpoint_dir=local, source_dir=publish, target_version=version)
        runner.load_weights(local)
        alone = runner_of(tiny_model_dir)
        alone.load_weights(src)
        assert torch.equal(runner.full_pass_logits(PROMPT, start=1),
                           alone.full_pass_logits(PROMPT, start=1)), version
    assert not is_delta_dir(publish / weight_dir_name(2))
    assert is_delta_dir(publish / weight_dir_name(3))
    assert runner.lora.describe()[0]["rank"] == 4
