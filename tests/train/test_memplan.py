"""The memory plan of the colocated loop (rltool.train.memplan): exact parameter, optimizer, weight
and KV bytes for the presets' shapes, the policy `auto` chooses, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch

from rltool.data.models import PRESETS, build_config
from rltool.errors import ConfigError
from rltool.train.memplan import GIB, Shape, activation_bytes, choose, plan

KNOBS = dict(micro_batch_tokens=4096, recompute=True, kv_tokens=65536)


def hf_params(arch: str, preset: str) -> tuple[Shape, int]:
    """The shape and the parameter count of the HF model transformers builds (on the meta
    device: no memory)."""
    from transformers import AutoModelForCausalLM

    config = build_config(arch, preset, vocab_size=512, eos_token_id=1, pad_token_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return Shape.of(config), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch,preset", [("qwen2", p) for p in PRESETS]
                         + [("llama", "tiny"), ("qwen3", "small")])
def test_parameter_count_is_exact(arch, preset):
    shape, n = hf_params(arch, preset)
    assert shape.arch == arch and shape.params == n


def test_the_7b_state_bytes_and_the_plans_of_both_policies():
    shape = Shape.of(PRESETS["qwen2.5-7b"], arch="qwen2")
    n = shape.params
    assert n == 7_615_616_512  # Qwen2.5-7B's published count
    assert 113 < 16 * n / GIB < 114  # fp32 params + grads + AdamW
    for name in ("all", "optimizer"):
        p = plan(shape, offload=name, **KNOBS)
        assert p.train["params"] == p.train["grads"] == 4 * n and p.train["optimizer"] == 8 * n
        assert p.rollout["engine_weights"] == 2 * n
        assert p.rollout["kv_pool"] == 65536 * 2 * 28 * 4 * 128 * 2  # layers, KV heads, head dim
        assert p.host["staged_weights"] == 2 * n and p.host["optimizer"] == 8 * n
    keep = plan(shape, offload="optimizer", **KNOBS)
    move = plan(shape, offload="all", **KNOBS)
    assert keep.rollout["trainer_params"] == 4 * n and "params" not in keep.host
    assert move.host["params"] == 4 * n and "trainer_params" not in move.rollout
    assert keep.peak("rollout") - move.peak("rollout") == move.peak("host") - keep.peak("host")
    assert keep.peak("train") == move.peak("train")
    assert "offload optimizer: rollout" in keep.summary()


def test_activations_shrink_with_recompute_and_grow_with_the_token_cap():
    shape = Shape.of(PRESETS["qwen2.5-7b"], arch="qwen2")

    def total(**kw):
        return sum(activation_bytes(shape, compute_dtype="bf16", logprob_chunk_tokens=4096,
                                    **kw).values())

    assert total(tokens=4096, recompute=True) < total(tokens=4096, recompute=False) / 3
    assert total(tokens=2048, recompute=True) < total(tokens=4096, recompute=True)
    # Chunked logits: the vocabulary's share stops growing past one chunk.
    big = activation_bytes(shape, tokens=16384, compute_dtype="bf16", recompute=True,
                           logprob_chunk_tokens=4096)
    assert big["logits"] == 4096 * shape.vocab * 12


def test_auto_on_one_h200_keeps_the_7b_parameters_and_moves_everything_of_the_3b():
    h200, host = int(139.8 * GIB), int(120 * GIB)
    seven = Shape.of(PRESETS["qwen2.5-7b"], arch="qwen2")
    three = Shape.of(PRESETS["qwen2.5-3b"], arch="qwen2")
    p = choose(seven, device_bytes=h200, host_bytes=host, **KNOBS)
    assert p.offload == "optimizer" and p.peak("train") < h200 and p.peak("host") < 0.75 * host
    assert choose(three, device_bytes=h200, host_bytes=host, **KNOBS).offload == "all"
    assert choose(seven, offload="optimizer", device_bytes=h200, host_bytes=host,
                  **KNOBS) == p


@pytest.mark.parametrize("change,message", [
    (dict(host_bytes=int(40 * GIB)), r"offload optimizer needs .* pinned host memory"),
    (dict(offload="all"), r"offload all needs .* set \[loop\] offload = optimizer"),
    (dict(recompute=False), r"train phase needs .* lower \[train\] max_tokens_per_microbatch "
                            r'or set \[train\] recompute = "full"'),
    (dict(offload="optimizer", kv_tokens=2_000_000),
     r"rollout phase needs .* set \[loop\] offload = all or lower \[loop\] min_kv_tokens"),
    (dict(offload="auto-ish"), r"unknown offload 'auto-ish'; choose auto, all, optimizer, none"),
])
def test_a_plan_that_does_not_fit_is_refused_naming_the_knob(change, message):
    seven = Shape.of(PRESETS["qwen2.5-7b"], arch="qwen2")
    args = dict(KNOBS, device_bytes=int(139.8 * GIB), host_bytes=int(120 * GIB)) | change
    with pytest.raises(ConfigError, match=message):
        choose(seven, **args)


def test_shapes_it_does_not_cover():
    with pytest.raises(ConfigError, match="names no vocab_size"):
        Shape.of(PRESETS["tiny"], arch="qwen2")
    with pytest.raises(ConfigError, match="covers dense models .* not 'qwen3_moe'"):
        Shape.of({"model_type": "qwen3_moe"})


def test_host_memory_available_is_capped_by_the_cgroup(tmp_path):
    from rltool.train.memplan import host_available

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       134217728 kB\nMemAvailable:   125829120 kB\n")
    assert host_available(str(meminfo), str(tmp_path / "none")) == 120 * 2**30
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(f"{40 * 2**30}\n")
    (cgroup / "memory.stat").write_text(f"anon {30 * 2**30}\nactive_file {4 * 2**30}\n"
                                        f"inactive_file {6 * 2**30}\n")
    assert host_available(str(meminfo), str(cgroup)) == 120 * 2**30  # no limit
    (cgroup / "memory.max").write_text(f"{100 * 2**30}\n")
    # The limit less what the cgroup uses besides its page cache: 100 - (40 - 10).
    assert host_available(str(meminfo), str(cgroup)) == 70 * 2**30
