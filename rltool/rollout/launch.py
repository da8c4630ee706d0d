"""Start `rltool serve` as a child process and wait until it is ready.

The child runs with `--port 0 --ready-file <tmp>` under rltool.supervisor: readiness is the ready
file ({url, pid}) appearing, failure is the process exiting first (the error carries the log tail)
or the timeout. `Child.stop` ends exactly the process it started: SIGTERM, then SIGKILL to its
process group (never by name).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

from rltool.supervisor import Child, start

# The handle start_engine returns: a supervised child with its `url`.
EngineProcess = Child


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def start_engine(args: list[str], *, log_path: Path, ready_timeout_s: float = 180.0,
                 env: dict[str, str] | None = None,
                 die_with_parent: bool = False) -> EngineProcess:
    """Run `python -m rltool serve *args` and return once it serves (see module docstring).
    `env` replaces the child's environment when given; `die_with_parent`: see
    rltool.supervisor.start."""
    ready_dir = Path(tempfile.mkdtemp(prefix="rltool-engine-"))
    ready_file = ready_dir / "ready.json"
    cmdline = [sys.executable, "-m", "rltool", "serve", *args]
    if not _has_flag(args, "--port"):
        cmdline += ["--port", "0"]
    cmdline += ["--ready-file", str(ready_file)]
    child = start(cmdline, log_path=log_path, name="engine", env=env,
                  die_with_parent=die_with_parent)
    try:
        child.url = child.wait_ready_file(ready_file, timeout_s=ready_timeout_s)["url"]
        return child
    except BaseException:
        child.stop()
        raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(ready_dir)
