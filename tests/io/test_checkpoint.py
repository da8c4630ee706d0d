"""The one index reader and file-name check: names an index carries stay inside their directory,
and files written from a source directory get the published mode whatever the source's."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from rltool import atomic
from rltool.cli import main
from rltool.errors import BadInputError, CheckpointError
from rltool.io.checkpoint import check_name, open_checkpoint
from rltool.io.hf_dir import copy_side_files, write_hf_dir


@pytest.mark.parametrize("name", ["/etc/passwd", "../x.safetensors", "a/../../x", "./a", "a//b",
                                  "", "..", None, 3])
def test_check_name_refuses_names_that_are_not_plain(tmp_path, name):
    with pytest.raises(CheckpointError, match="file name"):
        check_name(tmp_path, name, what="index")


def test_check_name_refuses_links_out_and_accepts_plain_names(tmp_path):
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "out.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (root / "in.safetensors").symlink_to(root / "sub")
    with pytest.raises(CheckpointError, match="link leading out"):
        check_name(root, "out.safetensors", what="index")
    assert check_name(root, "in.safetensors", what="index") == "in.safetensors"
    assert check_name(root, "sub/model.safetensors", what="index") == "sub/model.safetensors"


def _sharded(path, weight_map_text):
    path.mkdir()
    save_file({"a": torch.ones(4)}, str(path / "model-00001-of-00001.safetensors"))
    (path / "config.json").write_text("{}")
    (path / "model.safetensors.index.json").write_text(weight_map_text)
    return path


@pytest.mark.parametrize("weight_map", [
    '{"a": "../victim/model.safetensors"}',
    '{"a": "/tmp/model.safetensors"}',
    '{"a": "model-00001-of-00001.safetensors", "a": "model-00001-of-00001.safetensors"}',
])
def test_full_checkpoint_index_names_refused_nothing_written(tmp_path, weight_map):
    """Bug: a full checkpoint's weight_map names were joined to the directory unchecked, so a
    delta apply wrote its rebuilt shard at `../victim/model.safetensors` (outside its output) and
    duplicate tensor entries were silently merged."""
    victim = tmp_path / "victim"
    victim.mkdir()
    save_file({"a": torch.zeros(4)}, str(victim / "model.safetensors"))
    base = _sharded(tmp_path / "base", '{"weight_map": %s}' % weight_map)
    with pytest.raises(BadInputError):
        open_checkpoint(base)
    r = CliRunner().invoke(main, ["delta", "diff", "--base", str(base), "--new", str(base),
                                  "--out", str(tmp_path / "d"), "--version", "1",
                                  "--base-version", "0"])
    assert r.exit_code == 2, r.output
    assert not (tmp_path / "d").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "victim"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dist_metadata_file_names_refused(tmp_path):
    """Bug: torch_dist metadata file names were read as given, so a checkpoint could make
    dist-to-hf read (and publish) any file the user can read."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from rltool.convert.torch_dist import iteration_dir

    it = tmp_path / "iter_0000000"
    dcp.save({"a": torch.ones(2)}, checkpoint_id=str(it))
    assert iteration_dir(it) == it  # the genuine checkpoint passes
    metadata = dcp.FileSystemReader(str(it)).read_metadata()
    metadata.storage_data = {k: dataclasses.replace(v, relative_path="../secret.distcp")
                             for k, v in metadata.storage_data.items()}
    with open(it / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match="secret.distcp"):
        iteration_dir(it)


def test_written_hf_dirs_are_readable_by_others(tmp_path):
    """Bug: side files were copied with copy2, so a source readable only by its owner made the
    published version (and HF exports) unreadable to an engine running as another user."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "test"}))
    (source / "tokenizer.json").write_text("{}")
    for p in source.iterdir():
        p.chmod(0o600)
    out = tmp_path / "out"
    with atomic.publish_dir(out) as tmp:
        write_hf_dir(tmp, {"w": torch.ones(3)}, source_model_dir=source, dtype="bf16")
    conv = tmp_path / "conv"
    conv.mkdir()
    copy_side_files(source, conv)
    files = [p for d in (out, conv) for p in d.iterdir()]
    assert {p.name for p in files} == {"config.json", "tokenizer.json", "model.safetensors"}
    assert {os.stat(p).st_mode & 0o777 for p in files} == {atomic.FILE_MODE}
