"""Weight sync touches only what it owns: a pull deletes only files it wrote, names from a delta
index stay inside the delta, every checksum is present, and every artifact is readable by
others (the mode rltool.atomic gives published files)."""

from __future__ import annotations

import json
import os

import pytest

from rltool import atomic
from rltool.delta.config import SyncConfig
from rltool.delta.diff import write_delta
from rltool.delta.publish import publish_version
from rltool.delta.pull import pull_weights
from rltool.errors import BadInputError
from rltool.io.checkpoint import open_checkpoint
from tests.helpers.checkpoints import load_all, make_weights, perturb, same_bits, write_checkpoint

INDEX = "model.safetensors.index.json"


def tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and ".weight_sync" not in p.parts and ".publish" not in p.name}


def test_pull_into_the_publish_dir_deletes_only_its_own_files(tmp_path):
    """Bug: pull_weights(local_checkpoint_dir=RUN/weights) deleted weight_v000000/,
    weight_v000001/ and every other file there that the pulled version lacked."""
    weights = tmp_path / "RUN" / "weights"
    w = [make_weights("bf16", seed=0)]
    w.append(perturb(w[0], lr=1e-3, seed=1))
    w.append(perturb(w[1], lr=1e-3, seed=2))
    src = [write_checkpoint(tmp_path / f"w{v}", w[v], extra={"extra.txt": f"v{v}"} if v < 2
                            else None) for v in range(3)]
    for v in range(3):
        publish_version(src[v], SyncConfig(sync="delta"), publish_dir=weights, version=v)
    (weights / "notes.txt").write_text("mine")
    published = tree(weights)
    pull_weights(local_checkpoint_dir=weights, source_dir=weights, target_version=1)
    assert same_bits(load_all(weights), w[1])
    assert (weights / "extra.txt").read_text() == "v1"
    after = tree(weights)
    assert {k: after[k] for k in published} == published  # versions and notes.txt intact
    pull_weights(local_checkpoint_dir=weights, source_dir=weights, target_version=2)
    assert same_bits(load_all(weights), w[2])
    assert not (weights / "extra.txt").exists()  # pulled for v1, dropped by v2: pull's own file
    after = tree(weights)
    assert {k: after[k] for k in published} == published
    for v in range(3):
        assert (weights / f"weight_v{v:06d}" / INDEX).exists() or v == 0


@pytest.fixture
def delta_pair(tmp_path):
    w0 = make_weights("bf16", seed=0)
    w1 = perturb(w0, lr=1e-3, seed=1)
    base = write_checkpoint(tmp_path / "base", w0, extra={"tok.txt": "a"})
    new = write_checkpoint(tmp_path / "new", w1, extra={"tok.txt": "b"})
    return base, new


def _delta(tmp_path, base, new, fmt):
    out = tmp_path / "src" / "weight_v000001"
    write_delta(open_checkpoint(base), open_checkpoint(new), out, version=1, base_version=0,
                fmt=fmt, encoding="xor")
    return out


def _edit_index(delta, change):
    index = json.loads((delta / INDEX).read_text())
    change(index)
    (delta / INDEX).write_text(json.dumps(index))


def _files(name):
    def change(index):
        index["rltool_delta"]["files"] = {name: index["rltool_delta"]["files"]["tok.txt"]}
    return change


def _removed(name):
    def change(index):
        index["rltool_delta"]["removed_files"] = [name]
    return change


def _weight_file(name):
    def change(index):
        index["weight_map"] = {k: name for k in index["weight_map"]}
    return change


@pytest.mark.parametrize("fmt,change,match", [
    ("rltool", _files("../../outside.txt"), "plain relative name"),
    ("rltool", _files("/etc/hostname"), "plain relative name"),
    ("rltool", _removed("../base/config.json"), "plain relative name"),
    ("rltool", _files("model.safetensors"), "named twice"),
    ("rltool", _removed("tok.txt"), "named twice"),
    ("slime", _weight_file("../../base/model.safetensors"), "plain relative name"),
    ("slime", _weight_file("/tmp/x.safetensors"), "plain relative name"),
    ("rltool", lambda i: i["rltool_delta"]["files"].update({"tok.txt": ""}), "empty checksum"),
    ("rltool", lambda i: i["rltool_delta"]["checksums"].update({"norm": ""}), "empty checksum"),
])
def test_bad_delta_index_refused_nothing_written(tmp_path, delta_pair, fmt, change, match):
    """Bug: names in a delta index (rltool_delta.files, removed_files, slime's weight_map) were
    joined to directories unchecked, so a delta could make a pull write or read outside its
    directories; an empty checksum skipped verification of the extra file it named."""
    base, new = delta_pair
    delta = _delta(tmp_path, base, new, fmt)
    _edit_index(delta, change)
    local = tmp_path / "local"
    before = {d: tree(tmp_path / d) for d in ("base", "new")}
    with pytest.raises(BadInputError, match=match):
        pull_weights(local_checkpoint_dir=local, source_dir=delta.parent, target_version=1,
                     base_model_path=base)
    assert tree(local) == {}
    assert {d: tree(tmp_path / d) for d in ("base", "new")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "new", "src"]  # no "local"


def test_slime_tensor_with_empty_checksum_refused(tmp_path, delta_pair):
    """Bug: an empty checksum in a slime delta's __metadata__ was accepted at open."""
    from safetensors.numpy import load_file, save_file

    base, new = delta_pair
    delta = _delta(tmp_path, base, new, "slime")
    blob = delta / "model-00001-of-00001.safetensors"
    from safetensors import safe_open

    with safe_open(str(blob), framework="np") as f:
        meta = f.metadata()
    save_file(load_file(str(blob)), str(blob), metadata={k: "" for k in meta})
    with pytest.raises(BadInputError, match="empty one"):
        pull_weights(local_checkpoint_dir=tmp_path / "local", source_dir=delta.parent,
                     target_version=1, base_model_path=base)


def test_every_sync_artifact_is_readable_by_others(tmp_path, delta_pair):
    """Bug: delta blobs, rebuilt checkpoints and pulled files were created by mkstemp (0600), so
    an engine running as another user could not read them."""
    base, new = delta_pair
    delta = _delta(tmp_path, base, new, "rltool")
    publish = tmp_path / "weights"
    publish_version(base, SyncConfig(), publish_dir=publish, version=0)
    publish_version(new, SyncConfig(sync="delta"), publish_dir=publish, version=1)
    pull_weights(local_checkpoint_dir=tmp_path / "local", source_dir=publish, target_version=1)
    files = [p for d in (delta, publish, tmp_path / "local") for p in d.rglob("*")
             if p.is_file() and not p.name.startswith(".") and ".weight_sync" not in p.parts
             and ".publish_cache" not in p.parts]
    assert len(files) > 8
    assert {p.as_posix(): os.stat(p).st_mode & 0o777 for p in files} == {
        p.as_posix(): atomic.FILE_MODE for p in files}
