"""publish_version routes every request to one publisher (in-memory, full or delta) chosen by
decide_route, with no second pass through the entry point. Each case is checked against what
publishing has always produced: the kind of version on disk (a full checkpoint or a delta index),
sync/mode and sync/reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rltool.delta import publish
from rltool.delta.config import SyncConfig
from rltool.delta.publish import PublishRequest, decide_route, publish_version
from rltool.delta.pull import read_local_version
from rltool.io.checkpoint import is_delta_dir
from tests.helpers.checkpoints import load_all, same_bits, write_checkpoint

SLOW_LINK_GBPS = 1e3 * 8 / 1e9  # 1 kB/s: any delta wins
FAST_LINK_GBPS = 1e15 * 8 / 1e9  # 1 PB/s: decoding a delta always loses


def request(**fields) -> PublishRequest:
    defaults = dict(src={}, sync=SyncConfig(), publish_dir=Path("weights"), version=1,
                    base_version=None, source_model_dir=None, dtype="fp32", base_model_path=None,
                    t0_s=0.0, cache_dir=None, workers=None, in_memory=None, to_disk=True)
    return PublishRequest(**(defaults | fields))


@pytest.mark.parametrize("mode, in_memory, to_disk, publisher, reason, transport", [
    ("full", None, True, "full", "--sync full", None),
    ("delta", None, True, "delta", "--sync delta", None),
    ("auto", None, True, "delta", "--sync auto", None),
    # tensor/distributed with no engine that takes them in memory: published as --sync full
    ("tensor", None, True, "full", "--sync full", None),
    ("distributed", None, False, "full", "--sync full", None),
    ("tensor", "distributed", False, "full", "--sync full", None),
    ("tensor", "tensor", False, "in-memory", "--sync tensor", "tensor"),
    ("auto", "tensor", False, "in-memory", "auto: engines share the trainer's host and device",
     "tensor"),
    ("distributed", "distributed", False, "in-memory", "--sync distributed", "distributed"),
    # the disk copy of an in-memory version is full, also under auto
    ("tensor", "tensor", True, "full", "--sync tensor", "tensor"),
    ("auto", "tensor", True, "full", "auto: engines share the trainer's host and device",
     "tensor"),
    # disk modes ignore an in-memory engine
    ("delta", "tensor", False, "delta", "--sync delta", None),
    ("auto", "distributed", False, "delta", "--sync auto", None),
])
def test_decide_route(mode, in_memory, to_disk, publisher, reason, transport):
    route = decide_route(request(sync=SyncConfig(sync=mode), in_memory=in_memory,
                                 to_disk=to_disk))
    assert (route.publisher, route.reason, route.transport) == (publisher, reason, transport)


def weights(n: int) -> list[dict[str, torch.Tensor]]:
    """`n` bf16 versions, each a few entries away from the one before (a sparse update)."""
    g = torch.Generator().manual_seed(0)
    out = [{"a": torch.randn(256, 16, generator=g).to(torch.bfloat16)}]
    for _ in range(n - 1):
        a = out[-1]["a"].clone()
        a.view(-1)[torch.randint(0, a.numel(), (8,), generator=g)] += 1.0
        out.append({"a": a})
    return out


def is_full(path: Path) -> bool:
    return (path / "model.safetensors").is_file() and not is_delta_dir(path)


def test_first_version_under_delta_is_full_and_seeds_the_cache(tiny_model_dir, tmp_path):
    state = load_all(tiny_model_dir)
    pub = tmp_path / "weights"
    m = publish_version(state, SyncConfig(sync="delta"), publish_dir=pub, version=0,
                        source_model_dir=tiny_model_dir)
    assert (m["sync/mode"], m["sync/reason"]) == ("full", "version 0 has no base")
    assert is_full(pub / "weight_v000000")
    assert json.loads((pub / "weight_v000000" / "rltool_version.json").read_text()) == {
        "version": 0, "precision": "fp32"}
    # the delta publisher staged it: the cache is the next delta's base
    assert read_local_version(pub / ".publish_cache") == 0
    # --sync full writes the state dict in place and leaves the cache alone
    m = publish_version(state, SyncConfig(), publish_dir=tmp_path / "full", version=0,
                        source_model_dir=tiny_model_dir)
    assert (m["sync/mode"], m["sync/reason"], m["sync/link_Bps"]) == ("full", "--sync full", None)
    assert is_full(tmp_path / "full" / "weight_v000000")
    assert not (tmp_path / "full" / ".publish_cache").exists()


def test_base_missing_publishes_full(tmp_path):
    w = weights(3)
    pub = tmp_path / "weights"
    publish_version(write_checkpoint(tmp_path / "w0", w[0]), SyncConfig(), publish_dir=pub,
                    version=0)
    m = publish_version(write_checkpoint(tmp_path / "w2", w[2]), SyncConfig(sync="delta"),
                        publish_dir=pub, version=2, base_version=1)
    assert m["sync/mode"] == "full" and m["sync/reason"].startswith("no delta possible")
    assert is_full(pub / "weight_v000002")
    assert not (pub / ".candidate-weight_v000002").exists()
    assert same_bits(load_all(pub / "weight_v000002"), w[2])


def test_auto_keeps_a_cheaper_delta_and_drops_a_dearer_one(tmp_path):
    w = weights(4)
    pub = tmp_path / "weights"
    publish_version(write_checkpoint(tmp_path / "w0", w[0]), SyncConfig(), publish_dir=pub,
                    version=0)

    def auto(v: int, link_gbps: float, base: int) -> dict:
        return publish_version(write_checkpoint(tmp_path / f"w{v}", w[v]),
                               SyncConfig(sync="auto", link_bandwidth_gbps=link_gbps),
                               publish_dir=pub, version=v, base_version=base)

    m1 = auto(1, SLOW_LINK_GBPS, 0)
    assert (m1["sync/mode"], m1["sync/reason"]) == ("delta", "cost model: delta faster")
    assert is_delta_dir(pub / "weight_v000001")
    assert m1["sync/predicted_delta_s"] < m1["sync/predicted_full_s"]
    # on a full base auto encodes and measures, then drops the delta
    m2 = auto(2, FAST_LINK_GBPS, 0)
    assert (m2["sync/mode"], m2["sync/reason"]) == ("full", "cost model: full faster")
    assert m2["sync/predicted_delta_s"] >= m2["sync/predicted_full_s"]
    assert m2["perf/update_weights_density"] == 1.0
    assert is_full(pub / "weight_v000002")
    assert not (pub / ".candidate-weight_v000002").exists()
    # mid-chain (on the delta v1) the measured history says full before encoding
    m3 = auto(3, FAST_LINK_GBPS, 1)
    assert (m3["sync/mode"], m3["sync/reason"]) == (
        "full", "cost model (measured history): full faster")
    assert is_full(pub / "weight_v000003")
    assert same_bits(load_all(pub / "weight_v000003"), w[3])


def test_in_memory_writes_nothing(tmp_path):
    pub = tmp_path / "weights"
    m = publish_version({"a": torch.zeros(2)}, SyncConfig(sync="tensor"), publish_dir=pub,
                        version=3, in_memory="tensor", to_disk=False)
    assert m == {"sync/mode": "tensor", "sync/reason": "--sync tensor", "sync/version": 3,
                 "perf/update_weights_wire_bytes": 0, "sync/precision": "fp32"}
    assert not pub.exists()


def test_forced_full_is_one_pass_through_the_entry_point(tmp_path, monkeypatch):
    """The disk copy of an in-memory version is full even where auto would keep a delta, and
    publish_version runs once for it."""
    w = weights(2)
    pub = tmp_path / "weights"
    publish_version(write_checkpoint(tmp_path / "w0", w[0]), SyncConfig(), publish_dir=pub,
                    version=0)
    calls = []
    entry = publish.publish_version

    def counted(*args, **kwargs):
        calls.append(kwargs["version"])
        return entry(*args, **kwargs)

    monkeypatch.setattr(publish, "publish_version", counted)
    m = publish.publish_version(write_checkpoint(tmp_path / "w1", w[1]),
                                SyncConfig(sync="auto", link_bandwidth_gbps=SLOW_LINK_GBPS),
                                publish_dir=pub, version=1, in_memory="tensor", to_disk=True)
    assert calls == [1]
    assert (m["sync/mode"], m["sync/reason"]) == (
        "tensor", "auto: engines share the trainer's host and device")
    assert m["sync/predicted_full_s"] is None and m["perf/update_weights_density"] == 1.0
    assert is_full(pub / "weight_v000001")
    assert json.loads((pub / "weight_v000001" / "rltool_version.json").read_text()) == {
        "version": 1}
    # tensor without an engine that takes it in memory: reported as --sync full
    m = publish.publish_version(write_checkpoint(tmp_path / "w1b", w[1]),
                                SyncConfig(sync="tensor"), publish_dir=pub, version=2)
    assert calls == [1, 2]
    assert (m["sync/mode"], m["sync/reason"]) == ("full", "--sync full")
    assert is_full(pub / "weight_v000002")
