"""Engine side of disk-delta sync: bring a host-local checkpoint to a target version (slime's
`/pull_weights` semantics).

The target is rebuilt from the newest full version at or below it (version 0 is the engine's own
model path when the source has no `weight_v000000`) plus the deltas after it, in order, or from the
local directory itself when its state marker names a version on that chain. Everything is built
in `<local>/.weight_sync/staging` and every checksum verified before the files are swapped in, so
a wrong base, a missing link or a checksum mismatch leaves the local directory as it was. A per-host
`fcntl` lock serialises engines sharing the directory; `state.json` ({"version": "000042", "files":
[...]}) makes a repeated pull a no-op and is the manifest of the files pulls wrote: the only files a
pull deletes, so a local directory that also holds other files keeps them. It only syncs files:
the caller then reloads the engine from the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from rltool import atomic
from rltool.delta.apply import apply_chain
from rltool.delta.deltadir import DeltaDir, format_version, open_delta, parse_version
from rltool.errors import CheckpointError, DeltaChainError
from rltool.faults import kill_point
from rltool.io.checkpoint import Checkpoint, check_name, is_delta_dir, open_checkpoint
from rltool.rundir import weight_dir_name

SYNC_DIR = ".weight_sync"
STATE_FILE = f"{SYNC_DIR}/state.json"  # {"version": "000042", "files": [...]}: the manifest


@contextlib.contextmanager
def host_lock(path: Path, *, timeout_s: float) -> Iterator[None]:
    """Exclusive advisory lock on `path` (one per host-local directory), polled until timeout_s."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # held: poll again until the deadline
                if time.monotonic() > deadline:
                    raise DeltaChainError(f"{path} is held by another pull for over "
                                          f"{timeout_s:.0f}s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _read_state(local: Path) -> dict:
    try:
        state = json.loads((local / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def owned_files(local_checkpoint_dir: str | os.PathLike) -> frozenset[str]:
    """The files pulls wrote into the local directory (the manifest in its state file); the only
    files a pull ever replaces or deletes there. Empty when the directory was never synced."""
    local = Path(local_checkpoint_dir)
    files = _read_state(local).get("files")
    if not isinstance(files, list):
        return frozenset()
    return frozenset(check_name(local, f, what=str(local / STATE_FILE)) for f in files)


def read_local_version(local_checkpoint_dir: str | os.PathLike) -> int | None:
    """The complete version the local directory holds, or None when unknown (never synced, a
    swap was interrupted, or no manifest says which files are the version's)."""
    state = _read_state(Path(local_checkpoint_dir))
    version = state.get("version")
    if version is None or not isinstance(state.get("files"), list):
        return None
    return parse_version(version)


def open_cached(local_checkpoint_dir: str | os.PathLike) -> Checkpoint:
    """The version a local directory holds, made of the files its manifest lists only."""
    return open_checkpoint(local_checkpoint_dir, members=owned_files(local_checkpoint_dir))


def plan_chain(source_dir: Path, target: int, *, base_model_path: Path | None,
               local_dir: Path, local_version: int | None) -> tuple[Path, int, list[DeltaDir]]:
    """(seed directory, seed version, deltas to apply in order) to reach `target`."""
    chain: list[DeltaDir] = []
    v = target
    while True:
        if v == local_version:
            seed = local_dir
            break
        d = source_dir / weight_dir_name(v)
        try:
            delta_version = d.is_dir() and is_delta_dir(d)
        except CheckpointError as e:
            raise DeltaChainError(f"{d}: version index unreadable: {e}") from e
        if d.is_dir() and not delta_version:
            seed = d
            break
        if d.is_dir():
            delta = open_delta(d)
            if delta.version != v or delta.base_version >= v:
                raise DeltaChainError(f"{d} declares version {delta.version} on base "
                                      f"{delta.base_version}; expected version {v} on an older base")
            chain.append(delta)
            v = delta.base_version
            continue
        if v == 0 and base_model_path is not None:
            seed = base_model_path
            break
        raise DeltaChainError(f"missing link: {d} does not exist, and version {target} needs it "
                              f"(no full version or delta chain reaches {target} from {source_dir})")
    chain.reverse()
    return seed, v, chain


def swap_in(staging: Path, local: Path, *, version: int) -> None:
    """Move the verified staging files into `local` and delete the files of the previous version
    that the new one lacks: only files the manifest lists (pulls wrote them), never others. The
    state is marked pending first, owning both versions' files, so a crash in the middle leaves
    'unknown' and the next pull rebuilds from a full version and still cleans up."""
    state = local / STATE_FILE
    old_files = owned_files(local)
    new_files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*")
                       if p.is_file())
    for rel in new_files:  # a link planted in `local` must not redirect a write out of it
        check_name(local, rel, what=str(local))
    atomic.write_json(state, {"version": None, "pending": format_version(version),
                              "files": sorted(old_files | set(new_files))})
    for rel in new_files:
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, local / rel)
        kill_point("pull.swap")
    for rel in sorted(old_files - set(new_files), reverse=True):
        path = local / rel
        if path.is_file() or path.is_symlink():
            path.unlink()
        parent = path.parent
        while parent != local and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent
    atomic.fsync_dir(local)
    atomic.write_json(state, {"version": format_version(version), "files": new_files})


def pull_weights(*, local_checkpoint_dir: str | os.PathLike, source_dir: str | os.PathLike,
                 target_version: int | str, base_model_path: str | os.PathLike | None = None,
                 workers: int | None = None, lock_timeout_s: float = 600.0) -> dict:
    """Make `local_checkpoint_dir` hold exactly version `target_version` of `source_dir`.

    Returns {"version", "changed", "seed", "seed_version", "deltas_applied", "time_s"}. Raises
    DeltaChainError (local directory untouched) on a wrong base, missing link or checksum mismatch;
    one no chain reaches (a missing link, a declared wrong base) creates nothing on disk.
    """
    t0 = time.perf_counter()
    local, source = Path(local_checkpoint_dir), Path(source_dir)
    target = parse_version(target_version)
    base = Path(base_model_path) if base_model_path is not None else None
    if not source.is_dir():
        raise DeltaChainError(f"source directory {source} does not exist")
    # A target no chain reaches is refused before the lock creates anything on disk; planned
    # again under the lock, as another pull may change the local version meanwhile.
    current = read_local_version(local)
    if current != target:
        plan_chain(source, target, base_model_path=base, local_dir=local, local_version=current)
    sync = local / SYNC_DIR
    with host_lock(sync / "lock", timeout_s=lock_timeout_s):
        current = read_local_version(local)
        if current == target:
            return {"version": target, "changed": False, "seed": str(local), "seed_version": target,
                    "deltas_applied": [], "time_s": time.perf_counter() - t0}
        seed, seed_version, chain = plan_chain(source, target, base_model_path=base,
                                               local_dir=local, local_version=current)
        staging = sync / "staging"
        shutil.rmtree(staging, ignore_errors=True)  # a crashed pull's leftovers (we hold the lock)
        try:
            seed_ckpt = open_cached(local) if seed == local else open_checkpoint(seed)
            stats = apply_chain(seed_ckpt, chain, staging, base_version=seed_version,
                                workers=workers)
            swap_in(staging, local, version=target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return {"version": target, "changed": True, "seed": str(seed), "seed_version": seed_version,
            "deltas_applied": [d.version for d in chain], "tensors_changed": stats["tensors_changed"],
            "time_s": time.perf_counter() - t0}
