"""The receiver's read of a shared-memory segment: a sender-named file in `/dev/shm`, which any
local user can create, so it is opened and checked before a byte is read, and copied into a
private buffer.

- Opened O_NOFOLLOW (a symlink planted under the segment's name is refused, not followed) and
  O_NONBLOCK (opening a FIFO under that name returns at once instead of waiting for a writer).
- fstat'd: a regular file owned by the engine's user, at least as long as the message says.
- Copied with `readinto` into memory the engine owns, never mapped: a sender that truncates its
  file during the copy makes the read come back short (a 400), where a mapping of the file would
  take SIGBUS on the first page past the new end and kill the engine.

Extra memory on the engine: one bucket while it is applied.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import torch

from rltool.errors import BadInputError

SHM_DIR = Path("/dev/shm")
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 64 << 20  # a readinto this large returns within milliseconds from tmpfs


def engine_uid() -> int:
    """The user a segment must belong to: the one this process creates files as."""
    return os.geteuid()


def open_checked(path: Path, *, nbytes: int, what: str) -> int:
    """A read-only descriptor of `path`, a regular file of this user of at least `nbytes` bytes;
    BadInputError (naming `what`) otherwise. The caller closes it."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        reason = "is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise BadInputError(f"{what}: {reason}; the sender must create it (not link it) and "
                            "keep it until the answer arrives") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInputError(f"{what} is not a regular file; send the name of a segment "
                                "the sender created with ShmSegment")
        if st.st_uid != engine_uid():
            raise BadInputError(f"{what} belongs to uid {st.st_uid}, not this engine's "
                                f"{engine_uid()}; run the sender as the engine's user")
        if st.st_size < nbytes:
            raise BadInputError(f"{what} holds {st.st_size} bytes, the message says {nbytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_segment(segment: str, nbytes: int, *, shm_dir: Path = SHM_DIR) -> torch.Tensor:
    """The first `nbytes` bytes of `shm_dir/segment` as a uint8 tensor the engine owns."""
    what = f"shared-memory segment {segment!r}"
    if nbytes <= 0:
        raise BadInputError(f"{what}: nbytes must be positive, got {nbytes}")
    fd = open_checked(shm_dir / segment, nbytes=nbytes, what=what)
    try:
        out = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        done = 0
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            while done < nbytes:
                n = f.readinto(view[done:done + _CHUNK])
                if not n:
                    raise BadInputError(f"{what} ended after {done} of {nbytes} bytes: the "
                                        "sender changed it during the copy; keep it unchanged "
                                        "until the answer arrives")
                done += n
        return out
    finally:
        os.close(fd)
