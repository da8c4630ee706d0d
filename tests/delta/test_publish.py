"""Trainer-side publishing: full / delta / auto by the cost model, --full-every, metrics."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rltool.io.checkpoint import is_delta_dir
from rltool.delta.config import SyncConfig
from rltool.delta.cost import breakeven_bandwidth, decide, link_bandwidth_Bps, predict_times
from rltool.delta.publish import decide_transport, publish_version
from rltool.delta.pull import pull_weights
from rltool.errors import BadInputError
from tests.helpers.checkpoints import load_all, same_bits, write_checkpoint

METRICS = ("perf/update_weights_density", "perf/update_weights_wire_bytes",
           "perf/update_weights_time")


def test_cost_model_by_hand():
    t_full, t_delta = predict_times(full_bytes=1000, wire_bytes=10, link_Bps=100.0,
                                    decode_Bps=500.0, t0_s=0.5)
    assert t_full == pytest.approx(1000 / 100 + 0.5)
    assert t_delta == pytest.approx(10 / 100 + 0.5 + 1000 / 500)
    # delta wins iff S/B > W/B + process: B < (S - W) / process
    assert breakeven_bandwidth(full_bytes=1000, wire_bytes=10, process_s=2.0) == pytest.approx(495)


def test_decide_is_the_cost_model_and_gbps_is_converted_once():
    """train and loop share one SyncConfig-to-cost-model mapping (the Gb/s -> bytes/s conversion
    was copied in both)."""
    stats = {"decode_Bps": 500.0, "link_Bps": 1.0}
    assert link_bandwidth_Bps(SyncConfig(link_bandwidth_gbps=8.0), stats) == pytest.approx(1e9)
    assert link_bandwidth_Bps(SyncConfig(), stats) == 1.0  # measured when not given
    auto = SyncConfig(sync="auto", link_bandwidth_gbps=100 * 8 / 1e9)  # 100 B/s
    d = decide(auto, version=3, chain_length=1, full_bytes=1000, stats=stats, wire_bytes=10)
    assert d.delta and d.predicted_full_s == pytest.approx(1000 / 100)
    assert d.predicted_delta_s == pytest.approx(10 / 100 + 1000 / 500)
    assert not decide(auto, version=3, chain_length=0, full_bytes=1000, stats=stats,
                      wire_bytes=900).delta
    assert decide(SyncConfig(sync="delta"), version=3, chain_length=0, full_bytes=1000,
                  stats=stats, wire_bytes=900).delta
    assert "--full-every" in decide(SyncConfig(sync="delta", full_every=2), version=3,
                                    chain_length=1, full_bytes=1000, stats=stats).reason
    assert not decide(SyncConfig(), version=3, chain_length=0, full_bytes=1000, stats=stats).delta


@pytest.mark.parametrize("mode, in_memory, expected", [
    ("tensor", "tensor", "tensor"), ("auto", "tensor", "tensor"), ("distributed", "tensor",
    "distributed"), ("full", "tensor", None), ("delta", "tensor", None), ("auto", None, None),
    ("tensor", None, None), ("tensor", "distributed", None)])
def test_decide_picks_the_in_memory_transport_only_where_an_engine_can_take_it(mode, in_memory,
                                                                               expected):
    decision = decide_transport(SyncConfig(sync=mode), in_memory=in_memory)
    assert (decision.in_memory if decision else None) == expected


def test_in_memory_versions_reach_disk_only_when_asked(tiny_model_dir, tmp_path):
    state = load_all(tiny_model_dir)
    for version, to_disk in ((1, False), (2, True)):
        result = publish_version(state, SyncConfig(sync="tensor"), publish_dir=tmp_path,
                                 version=version, source_model_dir=tiny_model_dir,
                                 in_memory="tensor", to_disk=to_disk)
        assert result["sync/mode"] == "tensor"
        assert (tmp_path / f"weight_v{version:06d}").exists() == to_disk
    assert same_bits(load_all(tmp_path / "weight_v000002"), state)
    # Without an engine that takes tensors, --sync tensor publishes a full version.
    result = publish_version(state, SyncConfig(sync="tensor"), publish_dir=tmp_path, version=3,
                             source_model_dir=tiny_model_dir)
    assert result["sync/mode"] == "full" and (tmp_path / "weight_v000003").exists()


def test_publish_sequence(tiny_model_dir, tmp_path):
    base_state = load_file(str(tiny_model_dir / "model.safetensors"))
    publish = tmp_path / "weights"
    states = [base_state]
    common = dict(publish_dir=publish, base_model_path=tiny_model_dir,
                  source_model_dir=tiny_model_dir)

    def sync(mode, link_Bps=None):
        return SyncConfig(sync=mode, full_every=3,
                          link_bandwidth_gbps=link_Bps * 8 / 1e9 if link_Bps else None)

    def step(seed):
        g = torch.Generator().manual_seed(seed)
        # sparse update: a few entries of each tensor move
        new = {}
        for k, v in states[-1].items():
            mask = torch.rand(v.shape, generator=g) < 0.05
            new[k] = torch.where(mask, v + 1e-3, v)
        states.append(new)
        return new

    m1 = publish_version(step(1), sync("delta"), version=1, **common)
    assert m1["sync/mode"] == "delta" and is_delta_dir(publish / "weight_v000001")
    assert 0 < m1["perf/update_weights_density"] < 0.2
    assert all(k in m1 for k in METRICS)
    m2 = publish_version(step(2), sync("auto", 1e3), version=2, **common)
    assert m2["sync/mode"] == "delta" and m2["sync/reason"] == "cost model: delta faster"
    assert m2["perf/update_weights_wire_bytes"] < m2["sync/full_bytes"]
    m3 = publish_version(step(3), sync("delta"), version=3, **common)  # chain v1, v2 is 2 long
    assert m3["sync/mode"] == "full" and "--full-every" in m3["sync/reason"]
    assert not is_delta_dir(publish / "weight_v000003")
    m4 = publish_version(step(4), sync("auto", 1e15), version=4, **common)
    assert m4["sync/mode"] == "full" and m4["sync/reason"] == "cost model: full faster"
    assert m4["perf/update_weights_density"] == 1.0
    m5 = publish_version(step(5), sync("delta"), version=5, **common)  # a new chain after v4
    assert m5["sync/mode"] == "delta"
    for v in (2, 5):
        local = tmp_path / f"engine{v}"
        pull_weights(local_checkpoint_dir=local, source_dir=publish, target_version=v,
                     base_model_path=tiny_model_dir)
        assert same_bits(load_all(local), states[v])
    with pytest.raises(BadInputError, match="already exists"):
        publish_version(states[5], sync("full"), version=5, **common)


def test_publish_from_directory(tmp_path):
    g = torch.Generator().manual_seed(0)
    w0 = {"a": torch.randn(64, 8, generator=g).to(torch.bfloat16)}
    w1 = {"a": w0["a"].clone()}
    w1["a"][0, 0] = 3.0
    publish = tmp_path / "weights"
    publish_version(write_checkpoint(tmp_path / "w0", w0), SyncConfig(), publish_dir=publish,
                    version=0)
    m = publish_version(write_checkpoint(tmp_path / "w1", w1), SyncConfig(sync="delta"),
                        publish_dir=publish, version=1)
    assert m["sync/mode"] == "delta"
    assert m["perf/update_weights_density"] == pytest.approx(1 / 512)
    pull_weights(local_checkpoint_dir=tmp_path / "local", source_dir=publish, target_version=1)
    assert same_bits(load_all(tmp_path / "local"), w1)


def test_auto_skips_encoding_mid_chain_when_history_says_full(tmp_path):
    g = torch.Generator().manual_seed(1)
    weights = [{"a": torch.randn(256, 8, generator=g).to(torch.bfloat16)}]
    for _ in range(2):
        weights.append({"a": (weights[-1]["a"].float() * 1.01).to(torch.bfloat16)})
    publish = tmp_path / "weights"
    publish_version(write_checkpoint(tmp_path / "w0", weights[0]), SyncConfig(),
                    publish_dir=publish, version=0)
    m1 = publish_version(write_checkpoint(tmp_path / "w1", weights[1]),
                         SyncConfig(sync="delta"), publish_dir=publish, version=1)
    assert m1["sync/mode"] == "delta"  # measures wire ratio and encode throughput
    m2 = publish_version(write_checkpoint(tmp_path / "w2", weights[2]),
                         SyncConfig(sync="auto", link_bandwidth_gbps=8e6),
                         publish_dir=publish, version=2)
    assert m2["sync/mode"] == "full" and "history" in m2["sync/reason"]
    assert not (publish / ".candidate-weight_v000002").exists()
    pull_weights(local_checkpoint_dir=tmp_path / "local", source_dir=publish, target_version=2)
    assert same_bits(load_all(tmp_path / "local"), weights[2])
