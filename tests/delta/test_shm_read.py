"""The receiver's read of a shared-memory segment (rltool.delta.shm_read): anything but a regular
file of the engine's user, at least as long as the message says, is refused in one line before a
byte is read, and a file that shrinks during the copy is a BadInputError, never a signal."""

from __future__ import annotations

import os

import pytest
import torch

from rltool.delta import shm_read, tensor_sync
from rltool.engine import api
from rltool.errors import BadInputError

pytestmark = pytest.mark.timeout(60)


def segment(tmp_path, data: bytes, name: str = "rltool-test") -> str:
    (tmp_path / name).write_bytes(data)
    return name


def test_a_regular_segment_is_copied_into_a_private_buffer(tmp_path):
    data = bytes(range(256)) * 8
    name = segment(tmp_path, data)
    out = shm_read.read_segment(name, len(data), shm_dir=tmp_path)
    assert bytes(out.numpy()) == data
    (tmp_path / name).write_bytes(b"\0" * len(data))  # the sender reuses its segment
    assert bytes(out.numpy()) == data  # the engine's copy is its own


def test_a_fifo_named_like_a_segment_is_refused_without_blocking(tmp_path):
    """A FIFO under a segment's name blocked the reader (and the scheduler) until something
    opened it for writing; now it is refused at once: nothing ever writes to this one."""
    os.mkfifo(tmp_path / "rltool-fifo")
    with pytest.raises(BadInputError, match="not a regular file"):
        shm_read.read_segment("rltool-fifo", 64, shm_dir=tmp_path)


def test_a_symlink_named_like_a_segment_is_refused(tmp_path):
    """A segment name was followed through a symlink to whatever file it pointed at."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 128)
    os.symlink(target, tmp_path / "rltool-link")
    with pytest.raises(BadInputError, match="symbolic link"):
        shm_read.read_segment("rltool-link", 64, shm_dir=tmp_path)


def test_a_segment_shorter_than_the_message_says_is_refused(tmp_path):
    name = segment(tmp_path, b"x" * 100)
    with pytest.raises(BadInputError, match="holds 100 bytes, the message says 4096"):
        shm_read.read_segment(name, 4096, shm_dir=tmp_path)
    with pytest.raises(BadInputError, match="nbytes must be positive"):
        shm_read.read_segment(name, 0, shm_dir=tmp_path)


def test_a_segment_of_another_user_is_refused(tmp_path, monkeypatch):
    """A segment another local user planted under the sender's name was read as the sender's
    weights; files of any uid but the engine's are refused (another uid simulated: making one
    needs root)."""
    name = segment(tmp_path, b"x" * 128)
    monkeypatch.setattr(shm_read, "engine_uid", lambda: os.geteuid() + 1)
    with pytest.raises(BadInputError, match=f"belongs to uid {os.geteuid()}"):
        shm_read.read_segment(name, 64, shm_dir=tmp_path)


def truncate_after_fstat(monkeypatch, path, size: int) -> None:
    """Shrink `path` right after the reader has checked its size: a sender truncating its segment
    between the engine's check and its copy, made deterministic."""
    real_fstat = os.fstat

    def fstat(fd):
        st = real_fstat(fd)
        if isinstance(fd, int) and os.path.realpath(f"/proc/self/fd/{fd}") == str(path):
            os.truncate(path, size)
        return st

    monkeypatch.setattr(os, "fstat", fstat)


def test_a_segment_truncated_during_the_copy_is_refused(tmp_path, monkeypatch):
    """A sender truncating its segment while the engine copied from a mapping of it killed the
    engine with SIGBUS; the copy reads the file, so it comes back short and is refused."""
    name = segment(tmp_path, b"x" * 8192)
    truncate_after_fstat(monkeypatch, tmp_path / name, 1000)
    with pytest.raises(BadInputError, match="ended after 1000 of 8192 bytes"):
        shm_read.read_segment(name, 8192, shm_dir=tmp_path)


def test_open_message_reads_the_checked_copy(tmp_path):
    named = [("a", torch.arange(10, dtype=torch.float32)), ("b", torch.ones(3, 5))]
    with tensor_sync.ShmSegment(tensor_sync.segment_bytes(named, bucket_bytes=1 << 20),
                                shm_dir=tmp_path) as seg:
        message = api.TensorMessage.model_validate(seg.write(named))
        with tensor_sync.open_message(message, shm_dir=tmp_path) as got:
            assert [n for n, _ in got] == ["a", "b"]
            assert all(t.equal(x) for (_, t), (_, x) in zip(got, named))
