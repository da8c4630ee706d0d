"""Chains of deltas, pulls into a host-local directory, and every kind of corruption refused with
the local directory left as it was."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from rltool.io.checkpoint import open_checkpoint
from rltool.delta.diff import write_delta
from rltool.delta.pull import pull_weights, read_local_version
from rltool.errors import DeltaChainError
from tests.helpers.checkpoints import load_all, make_weights, perturb, same_bits, write_checkpoint

NUM_VERSIONS = 5


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Base model (version 0, outside the source dir) and weight_v000001..5 as deltas, formats
    alternating rltool / slime xor / slime overwrite; also the full weights of each version."""
    root = tmp_path_factory.mktemp("chain")
    weights = [make_weights("bf16", seed=0)]
    fulls = [write_checkpoint(root / "full/v0", weights[0], version=0)]
    source = root / "weights"
    source.mkdir()
    formats = [("rltool", "xor"), ("slime", "xor"), ("slime", "overwrite")]
    for v in range(1, NUM_VERSIONS + 1):
        weights.append(perturb(weights[-1], lr=1e-3, seed=v))
        fulls.append(write_checkpoint(root / f"full/v{v}", weights[-1], version=v))
        fmt, enc = formats[(v - 1) % 3]
        write_delta(open_checkpoint(fulls[v - 1]), open_checkpoint(fulls[v]),
                    source / f"weight_v{v:06d}", version=v, base_version=v - 1, fmt=fmt,
                    encoding=enc)
    return {"root": root, "source": source, "base": fulls[0], "weights": weights, "fulls": fulls}


def snapshot(local):
    return {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*")
            if p.is_file() and ".weight_sync" not in p.parts}


def test_chain_of_five_then_noop(chain, tmp_path):
    local = tmp_path / "local"
    result = pull_weights(local_checkpoint_dir=local, source_dir=chain["source"],
                          target_version=NUM_VERSIONS, base_model_path=chain["base"])
    assert result["changed"] and result["deltas_applied"] == [1, 2, 3, 4, 5]
    assert result["seed_version"] == 0
    assert same_bits(load_all(local), chain["weights"][NUM_VERSIONS])
    assert json.loads((local / ".weight_sync/state.json").read_text()) == {
        "version": "000005", "files": ["config.json", "model.safetensors", "rltool_version.json"]}
    assert json.loads((local / "rltool_version.json").read_text()) == {"version": 5}
    before = snapshot(local)
    again = pull_weights(local_checkpoint_dir=local, source_dir=chain["source"],
                         target_version="000005", base_model_path=chain["base"])
    assert not again["changed"] and snapshot(local) == before


def test_incremental_pulls_start_from_local(chain, tmp_path):
    local = tmp_path / "local"
    for v in (2, 3, 5):
        r = pull_weights(local_checkpoint_dir=local, source_dir=chain["source"], target_version=v,
                         base_model_path=chain["base"])
        assert same_bits(load_all(local), chain["weights"][v])
    assert r["seed"] == str(local) and r["deltas_applied"] == [4, 5]


def test_full_version_resets_chain(chain, tmp_path):
    source = tmp_path / "weights"
    shutil.copytree(chain["source"], source)
    shutil.rmtree(source / "weight_v000003")
    shutil.copytree(chain["fulls"][3], source / "weight_v000003")
    shutil.rmtree(source / "weight_v000001")  # not needed any more: the full v3 resets the chain
    r = pull_weights(local_checkpoint_dir=tmp_path / "local", source_dir=source, target_version=5)
    assert r["seed_version"] == 3 and r["deltas_applied"] == [4, 5]
    assert same_bits(load_all(tmp_path / "local"), chain["weights"][5])


def corrupt_blob(d):
    f = d / "model-00001-of-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF  # inside the last blob
    f.write_bytes(bytes(data))


def corrupt_index(d):
    p = d / "model.safetensors.index.json"
    p.write_text(p.read_text()[:-20])


def corrupt_checksum(d):
    p = d / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    name = next(iter(index["rltool_delta"]["checksums"]))
    index["rltool_delta"]["checksums"][name] = "0" * 32
    p.write_text(json.dumps(index))


def wrong_base(d):
    """v4 claims to apply on v0: the links look fine, the content does not."""
    p = d / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    index["metadata"]["base_version"] = "000000"
    p.write_text(json.dumps(index))


def missing_link(d):
    shutil.rmtree(d)


@pytest.mark.parametrize("damage,match", [
    (corrupt_blob, "corrupt|checksum|payload"), (corrupt_index, "index"),
    (corrupt_checksum, "checksum mismatch"), (wrong_base, "checksum mismatch.*wrong base"),
    (missing_link, "missing link")])
def test_corruption_refused_local_kept(chain, tmp_path, damage, match):
    source = tmp_path / "weights"
    shutil.copytree(chain["source"], source)
    local = tmp_path / "local"
    pull_weights(local_checkpoint_dir=local, source_dir=source, target_version=3,
                 base_model_path=chain["base"])
    before = snapshot(local)
    damage(source / "weight_v000004")  # v4 is an rltool-format delta
    with pytest.raises(DeltaChainError, match=match):
        pull_weights(local_checkpoint_dir=local, source_dir=source, target_version=5,
                     base_model_path=chain["base"])
    assert snapshot(local) == before and read_local_version(local) == 3
    assert not (local / ".weight_sync/staging").exists()


def test_unreachable_target_creates_nothing(chain, tmp_path):
    """Bug: a pull refused for a missing link still created the local directory and its
    .weight_sync/lock."""
    local = tmp_path / "a/b/c"
    with pytest.raises(DeltaChainError, match="missing link"):
        pull_weights(local_checkpoint_dir=local, source_dir=chain["source"],
                     target_version=NUM_VERSIONS + 2, base_model_path=chain["base"])
    assert not (tmp_path / "a").exists()


def test_slime_blob_corruption_detected(chain, tmp_path):
    """v2 is slime xor: a flipped payload byte fails zstd's frame or the new-bytes checksum."""
    source = tmp_path / "weights"
    shutil.copytree(chain["source"], source)
    corrupt_blob(source / "weight_v000002")
    with pytest.raises(DeltaChainError):
        pull_weights(local_checkpoint_dir=tmp_path / "local", source_dir=source, target_version=2,
                     base_model_path=chain["base"])
    assert read_local_version(tmp_path / "local") is None


def test_two_processes_pull_the_same_local_dir(chain, tmp_path):
    local = tmp_path / "local"
    cmd = [sys.executable, "-m", "rltool", "delta", "pull", "--local", str(local), "--source",
           str(chain["source"]), "--version", str(NUM_VERSIONS), "--base-model",
           str(chain["base"]), "--json"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [o[1].decode()[-500:] for o in outs]
    results = [json.loads(o[0]) for o in outs]
    assert sorted(r["changed"] for r in results) == [False, True]  # the second found it done
    assert same_bits(load_all(local), chain["weights"][NUM_VERSIONS])
    assert read_local_version(local) == NUM_VERSIONS


def test_declared_wrong_base_refused(chain, tmp_path):
    from rltool.delta.apply import apply_chain
    from rltool.delta.deltadir import open_delta

    with pytest.raises(DeltaChainError, match="wrong base"):
        apply_chain(open_checkpoint(chain["fulls"][1]), [open_delta(chain["source"] / "weight_v000004")],
                    tmp_path / "out", base_version=1)
    with pytest.raises(DeltaChainError, match="wrong base"):  # a chain with a gap
        apply_chain(open_checkpoint(chain["fulls"][0]),
                    [open_delta(chain["source"] / f"weight_v{v:06d}") for v in (1, 3)],
                    tmp_path / "out", base_version=0)
    assert not (tmp_path / "out").exists()
