"""A pids cgroup per sandbox call: a process limit of its own (RLIMIT_NPROC counts every process
of the uid, so sandboxes running at once would share it) and a way to find and kill every process
the call started, including those that left its process group with setsid.

cgroup v1 (`/sys/fs/cgroup/pids`) and v2 (`/sys/fs/cgroup` with the pids controller enabled for
its children) are tried; both need root. `PidsCgroup.create` answers None (and why) where
neither works, and the sandbox falls back to RLIMIT_NPROC alone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup/pids")
V2 = Path("/sys/fs/cgroup")
KILL_ROUNDS = 50  # rounds of SIGKILL to every member, 10 ms apart, before giving up the rmdir


class PidsCgroup:
    """One call's cgroup: created before the child starts, joined by the child between fork and
    exec (`join`), emptied and removed by `destroy`."""

    def __init__(self, path: Path):
        self.path = path
        self.procs = str(path / "cgroup.procs")

    @classmethod
    def create(cls, max_pids: int) -> tuple["PidsCgroup | None", str]:
        """(the cgroup, "cgroup") or (None, why not)."""
        if os.geteuid() != 0:
            return None, "not root"
        name = f"rltool-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        for base in _bases():
            path = base / name
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                (path / "pids.max").write_text(str(max_pids))
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            return cls(path), "cgroup"
        return None, "no writable pids cgroup"

    def join(self) -> None:
        """Called in the child: move this process into the cgroup (raises OSError)."""
        fd = os.open(self.procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def members(self) -> list[int]:
        try:
            return [int(x) for x in Path(self.procs).read_text().split()]
        except (OSError, ValueError):
            return []

    def destroy(self) -> None:
        """SIGKILL every member until none is left, then remove the cgroup."""
        for _ in range(KILL_ROUNDS):
            pids = self.members()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _bases() -> list[Path]:
    bases = []
    if (V1 / "cgroup.procs").exists():
        bases.append(V1)
    controllers = V2 / "cgroup.subtree_control"
    with contextlib.suppress(OSError):
        if "pids" in controllers.read_text().split():
            bases.append(V2)
    return bases
