"""Atomic writes: every file a reader may see appears whole or not at all.

Files are written to a temporary name in the same directory, fsynced and renamed with `os.replace`.
Directories are built under a temporary name, marked complete, and published with one rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rltool.errors import BadInputError
from rltool.faults import kill_point


def _umask() -> int:
    """The process umask, read without changing it (os.umask would race with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


# mkstemp/mkdtemp create 0600/0700 entries; published files and directories get the modes a plain
# open()/mkdir() would give, so engines and trainers running as other users on a shared
# filesystem can read them.
FILE_MODE = 0o666 & ~_umask()
DIR_MODE = 0o777 & ~_umask()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    path = Path(path)
    with _renamed_temp(path) as (fd, _):
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    if fsync:
        fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    write_bytes(path, text.encode(), fsync=fsync)


def write_json(path: str | os.PathLike, obj: Any, *, fsync: bool = True) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", fsync=fsync)


def create_temp(path: str | os.PathLike) -> tuple[int, Path]:
    """An open temporary file next to `path` with the published mode: (fd, its path). Publish it
    with `commit_temp`, or close and unlink it on failure (`discard_temp`)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, FILE_MODE)
    return fd, Path(tmp)


def commit_temp(fd: int, tmp: Path, path: str | os.PathLike) -> None:
    """fsync and close `fd`, rename `tmp` onto `path`, fsync the directory."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    kill_point("publish.file")
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def discard_temp(fd: int, tmp: Path) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


@contextlib.contextmanager
def _renamed_temp(path: str | os.PathLike) -> Iterator[tuple[int, Path]]:
    """`create_temp` for `path` (its directory made first): renamed onto `path` when the block
    succeeds, removed when it fails. The block owns the descriptor."""
    path = Path(path)
    if path.is_dir():  # the rename would fail naming the temporary file instead
        raise BadInputError(f"{path} is a directory; pass a file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp(path)
    try:
        yield fd, tmp
        kill_point("publish.file")
        os.replace(tmp, path)
    except BaseException:
        discard_temp(-1, tmp)
        raise


@contextlib.contextmanager
def atomic_fd(path: str | os.PathLike) -> Iterator[int]:
    """Yield a file descriptor of a temporary file next to `path` (published mode); on success it
    is fsynced and renamed onto `path`, on error removed."""
    fd, tmp = create_temp(path)
    try:
        yield fd
    except BaseException:
        discard_temp(fd, tmp)
        raise
    commit_temp(fd, tmp, path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file path next to `path`; rename it onto `path` if the block succeeds.

    For writers that insist on a filename (pyarrow, safetensors.save_file).
    """
    with _renamed_temp(path) as (fd, tmp):
        os.close(fd)
        yield tmp
        # Writers that replace the file (safetensors' save_file does) drop create_temp's mode.
        os.chmod(tmp, FILE_MODE)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())


@contextlib.contextmanager
def publish_dir(final: str | os.PathLike, *, marker: str | None = None,
                marker_content: Any = None) -> Iterator[Path]:
    """Build a directory under a temporary name and publish it with one rename.

    The block fills the yielded directory; on success the marker file (if any) is written last
    inside it, then the whole directory is renamed to `final`. On error the temporary directory is
    removed and `final` is untouched. Refuses to replace an existing `final`.
    """
    final = Path(final)
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    created = missing_dirs(final.parent)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        os.chmod(tmp, DIR_MODE)
        yield tmp
        if marker is not None:
            write_json(tmp / marker, marker_content if marker_content is not None else {})
        kill_point("publish.dir")
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(created)  # a failed publish leaves no directory it made
        raise


def missing_dirs(path: str | os.PathLike) -> list[Path]:
    """`path` and those of its ancestors that do not exist yet, deepest first: what a
    `mkdir(parents=True)` of `path` creates (for `remove_empty` to take back)."""
    path = Path(path)
    return [p for p in (path, *path.parents) if not p.exists()]


def remove_empty(dirs: list[Path]) -> None:
    """Remove each of `dirs` (deepest first) that is empty; leave the others."""
    for d in dirs:
        with contextlib.suppress(OSError):
            d.rmdir()


def check_output_path(path: str | os.PathLike, *, flag: str, directory: bool = False,
                      new: bool = False) -> Path:
    """BadInputError (naming `flag`) unless `path` is, or can be created as, a file (with
    `directory`: a directory): not an existing entry of the other kind, no existing ancestor a
    file; with `new`, not an existing entry at all (an output that is never replaced). Checked
    before any work, so a bad output path changes nothing on disk."""
    path = Path(path)
    want, other = ("directory", "file") if directory else ("file", "directory")
    if path.exists() and path.is_dir() != directory:
        raise BadInputError(f"{flag} {path} is a {other}; pass a {want} path")
    if new and path.exists():
        raise BadInputError(f"{flag} {path} already exists; choose a new {want} (an output is "
                            "never replaced)")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise BadInputError(f"{flag} {path}: {parent} is a file, not a directory; pass a path "
                            "under a directory")
    return path


def remove_stale_temporaries(parent: str | os.PathLike) -> int:
    """Delete leftovers of interrupted publishes (`.<name>.*.tmp`) under `parent`; return how many."""
    parent = Path(parent)
    if not parent.is_dir():
        return 0
    count = 0
    for entry in parent.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            count += 1
    return count
