"""Atomic file writes and directory publishes leave either the whole result or nothing."""

from __future__ import annotations

import os
import stat

import pytest

from rltool import atomic


def _entries(path):
    return sorted(p.name for p in path.iterdir())


def test_write_json_and_text(tmp_path):
    atomic.write_json(tmp_path / "sub" / "a.json", {"b": 1, "a": [1, 2]})
    assert (tmp_path / "sub" / "a.json").read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    atomic.write_text(tmp_path / "sub" / "a.json", "replaced")
    assert (tmp_path / "sub" / "a.json").read_text() == "replaced"
    assert _entries(tmp_path / "sub") == ["a.json"]


def test_published_files_and_dirs_follow_the_umask(tmp_path):
    """Bug: mkstemp/mkdtemp made published files 0600 and directories 0700 whatever the umask, so
    an engine running as another user on a shared filesystem could not read weights or shards."""
    umask = os.umask(0o022)
    os.umask(umask)
    atomic.write_text(tmp_path / "f.txt", "x")
    with atomic.atomic_path(tmp_path / "g.bin") as p:
        p.write_bytes(b"x")
    with atomic.publish_dir(tmp_path / "d") as d:
        (d / "x").write_text("x")
    assert stat.S_IMODE(os.stat(tmp_path / "f.txt").st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(tmp_path / "g.bin").st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o777 & ~umask


def test_failed_write_leaves_old_content_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    atomic.write_json(target, {"step": 1})

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_json(target, {"step": 2})
    monkeypatch.undo()
    assert target.read_text() == '{\n  "step": 1\n}\n'
    assert _entries(tmp_path) == ["state.json"]


def test_atomic_path_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic.atomic_path(tmp_path / "model.safetensors") as p:
            p.write_bytes(b"half")
            raise RuntimeError("writer crashed")
    assert _entries(tmp_path) == []
    with atomic.atomic_path(tmp_path / "model.safetensors") as p:
        p.write_bytes(b"whole")
    assert _entries(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"whole"


def test_publish_dir_success_writes_marker_last(tmp_path):
    final = tmp_path / "weights" / "weight_v000001"
    with atomic.publish_dir(final, marker="rltool_version.json",
                            marker_content={"version": 1}) as tmp:
        assert not final.exists() and tmp.parent == final.parent
        (tmp / "config.json").write_text("{}")
    assert _entries(final) == ["config.json", "rltool_version.json"]
    assert (final / "rltool_version.json").read_text() == '{\n  "version": 1\n}\n'
    assert _entries(final.parent) == ["weight_v000001"]


def test_publish_dir_failure_leaves_nothing(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(ValueError):
        with atomic.publish_dir(final, marker="_SUCCESS") as tmp:
            (tmp / "part-00000.parquet").write_bytes(b"x" * 100)
            raise ValueError("producer failed")
    assert _entries(tmp_path) == []


def test_publish_dir_refuses_existing(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        with atomic.publish_dir(tmp_path / "out"):
            pytest.fail("the block must not run")
    assert _entries(tmp_path) == ["out"]


def test_remove_stale_temporaries(tmp_path):
    (tmp_path / ".weight_v000003.abc.tmp").mkdir()
    (tmp_path / ".weight_v000003.abc.tmp" / "x").write_text("partial")
    (tmp_path / ".state.json.xyz.tmp").write_text("partial")
    (tmp_path / "weight_v000002").mkdir()
    assert atomic.remove_stale_temporaries(tmp_path) == 2
    assert _entries(tmp_path) == ["weight_v000002"]
    assert atomic.remove_stale_temporaries(tmp_path / "missing") == 0


def test_a_file_write_onto_a_directory_names_the_directory(tmp_path):
    """Not the temporary file the rename would have failed on; nothing is left behind."""
    from rltool.errors import BadInputError

    target = tmp_path / "metrics.jsonl"
    target.mkdir()
    with pytest.raises(BadInputError, match=f"{target} is a directory; pass a file path"):
        atomic.write_text(target, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert list(target.iterdir()) == []
