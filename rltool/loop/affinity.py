"""CPU pinning of the loop's processes (`[loop] engine_cores`, `trainer_cores`).

Linux keeps an affinity mask per thread, and `os.sched_setaffinity(pid)` sets only the thread
whose id is `pid`; a process that already runs threads (an engine's scheduler, torch's pool) is
pinned by setting every thread in /proc/PID/task. Threads and processes started later inherit
the mask of the thread that starts them. An engine is pinned with its descendants (`pin_tree`):
the builtin engine's two-process layout runs its scheduler in a child process.
"""

from __future__ import annotations

import os
from pathlib import Path

from rltool.errors import ConfigError


def check_cores(cores: list[int], *, option: str) -> None:
    """Config validation (before the loop pins itself): every core is one this process may use."""
    allowed = os.sched_getaffinity(0)
    wrong = sorted(set(cores) - allowed)
    if not cores or wrong:
        raise ConfigError(f"--{option} {cores}: cores {wrong or cores} are not available to this "
                          f"process; choose from {sorted(allowed)}")


def pin(pid: int, cores: list[int]) -> None:
    """Pin every thread of process `pid` to `cores`."""
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(p.name) for p in tasks.iterdir()] if tasks.is_dir() else [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, set(cores))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def pin_tree(pid: int, cores: list[int]) -> None:
    """Pin process `pid` and every process descended from it (`pin`)."""
    pin(pid, cores)
    for child in _children(pid):
        pin_tree(child, cores)


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (the children of each of its threads; none once it ended)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(c) for c in task.read_text().split()]
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return children
