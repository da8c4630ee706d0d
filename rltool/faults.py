"""Deterministic kill points for the fault tests: `RLTOOL_KILL_AT=NAME:N` makes a process SIGKILL
itself at the N-th time it reaches `kill_point(NAME)` (several: `NAME:N,NAME2:M`).

Points are timing-free (the N-th file about to be published, the N-th tensor copied), so a
kill schedule reproduces exactly. Every process started with the variable counts its own calls;
children inherit it. Unset, `kill_point` is one global lookup and a return. The points and what
they interrupt are listed in docs/reliability.md ("Fault matrix").
"""

from __future__ import annotations

import os
import signal

ENV = "RLTOOL_KILL_AT"


def _parse(spec: str | None) -> dict[str, int] | None:
    if not spec:
        return None
    plan: dict[str, int] = {}
    for item in spec.split(","):
        name, _, nth = item.strip().rpartition(":")
        if not name or not nth.isdigit() or int(nth) < 1:
            raise ValueError(f"{ENV}={spec!r}: each item must be NAME:N with N >= 1")
        plan[name] = int(nth)
    return plan


_PLAN = _parse(os.environ.get(ENV))
_COUNTS: dict[str, int] = {}


def kill_point(name: str) -> None:
    """SIGKILL this process if `name` has now been reached as often as RLTOOL_KILL_AT says."""
    if _PLAN is None:
        return
    nth = _PLAN.get(name)
    if nth is None:
        return
    _COUNTS[name] = seen = _COUNTS.get(name, 0) + 1
    if seen == nth:
        os.kill(os.getpid(), signal.SIGKILL)
