"""A sandbox for untrusted code: one subprocess per call, limited and isolated.

What the child gets, set up between fork and exec (`_child_setup`):
- its own network namespace when the kernel lets us (`unshare(CLONE_NEWNET)`: only a loopback
  interface, down, so every connection fails); else the host's network, said in the result's
  `isolation["network"]`;
- its own mount namespace when possible: the call's private directory is bind-mounted on /tmp
  (its working directory and HOME), /var/tmp and /dev/shm become empty read-only tmpfs, and the
  Python installation is bind-mounted read-only inside the directory so the unprivileged user can
  run it even when it lives under a directory only root may enter (pyenv under /root);
- when rltool runs as root, the unprivileged uid/gid 65534 (nobody; no supplementary groups),
  so the process limit binds (the kernel does not apply RLIMIT_NPROC to root) and the file
  system's permissions keep it out of everything not world-writable;
- a pids cgroup of its own when one can be made (rltool.env.pids): the call's process limit,
  and every process it started killed at the end, even one that left the group with setsid;
- rlimits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), processes (RLIMIT_NPROC; only a
  backstop when the cgroup holds the limit), file size (RLIMIT_FSIZE), open files, no core dumps;
- its own session and process group, killed as a group at the wall-time limit, when its output
  passes the output limit, and when the call ends (without the cgroup, a process that left the
  group with setsid outlives the call, still carrying every rlimit above).

Every limit that is hit is reported in words the model sees (`SandboxResult.killed`):
"killed: CPU time limit 2 s", "killed: wall time limit 5 s", "killed: output limit 16384 bytes",
"memory limit 256 MiB hit (MemoryError)", "process limit 16 hit (fork failed)".
Without the cgroup, RLIMIT_NPROC, which counts every process of the uid, is the process limit:
sandboxes running at once share it. Without root none of the namespaces, the cgroup, the uid
switch or the bind mounts are possible: the call still runs with the rlimits and the private
directory, and `isolation` says what is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rltool.env.pids import PidsCgroup

NOBODY = 65534
NPROC_BACKSTOP = 64  # RLIMIT_NPROC = this x max_processes when a pids cgroup holds the call
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
POLL_S = 0.05  # how often the reader checks whether the main process has exited
EXIT_DRAIN_S = 0.1  # after it exited, how long output still in the pipes is read
INSIDE_DIR = "/tmp"  # where the private directory appears inside the mount namespace
PYTHON_DIR = ".python"  # the interpreter's bind mount, inside the private directory
# Loaded once here: dlopen between fork and exec could deadlock on a lock another thread held.
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Limits:
    """What one call may use."""

    cpu_time_s: int = 2
    wall_time_s: float = 5.0
    memory_bytes: int = 256 << 20
    max_processes: int = 16
    max_output_bytes: int = 16384
    max_file_bytes: int = 4 << 20
    max_open_files: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"sandbox limit {name} must be positive, got {value}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed by a signal (see `signal`)
    signal: int | None = None
    killed: str | None = None  # the limit hit, in words for the model
    duration_s: float = 0.0
    isolation: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def report(self) -> str:
        """The text the model sees: output, then the limit that was hit or the exit status."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.killed:
            parts.append(self.killed)
        elif self.exit_code:
            parts.append(f"exit code {self.exit_code}")
        return "\n".join(parts)


def run_python(code: str, *, limits: Limits = Limits()) -> SandboxResult:
    """Run Python source in a fresh sandboxed interpreter (`python -I -S main.py`)."""
    work = Path(tempfile.mkdtemp(prefix="rltool-sandbox-"))
    try:
        (work / "main.py").write_text(code)
        (work / PYTHON_DIR).mkdir()
        root = os.geteuid() == 0
        if root:
            for p in (work, work / "main.py"):
                os.chown(p, NOBODY, NOBODY)
        os.chmod(work, 0o700)
        cgroup, pids_how = PidsCgroup.create(limits.max_processes)
        report_r, report_w = os.pipe()
        plan = _Plan(work=str(work), root=root, limits=limits, report_fd=report_w,
                     prefix=sys.base_prefix, cgroup=cgroup)
        python_rel = os.path.relpath(os.path.realpath(sys.executable), sys.base_prefix)
        argv = [sys.executable, "-I", "-S", "main.py"]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.Popen(
                argv, executable=_executable(plan, python_rel), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, close_fds=True,
                pass_fds=(report_w,), start_new_session=True,
                preexec_fn=lambda: _child_setup(plan, env))
        finally:
            os.close(report_w)
        with os.fdopen(report_r, "rb") as f:
            isolation_lines = f.read().decode(errors="replace").splitlines()
        result = _collect(proc, limits)
        if cgroup is not None:  # what left the process group (setsid) is still in the cgroup
            cgroup.destroy()
            cgroup = None
        result.isolation = _isolation(isolation_lines, root=root)
        result.isolation.setdefault("pids", f"rlimit, shared by the uid ({pids_how})")
        if result.isolation.get("setup_error"):
            result.killed = f"sandbox setup failed: {result.isolation['setup_error']}"
        return result
    finally:
        if cgroup is not None:
            cgroup.destroy()
        shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class _Plan:
    work: str
    root: bool
    limits: Limits
    report_fd: int
    prefix: str
    cgroup: PidsCgroup | None = None


def _executable(plan: _Plan, python_rel: str) -> str:
    # Inside the mount namespace the interpreter is reached through its bind mount; the path is
    # only valid in the child, after _child_setup.
    if plan.root:
        return os.path.join(INSIDE_DIR, PYTHON_DIR, python_rel)
    return sys.executable


def _child_setup(plan: _Plan, env: dict[str, str]) -> None:
    """Runs in the child between fork and exec: namespaces, mounts, rlimits, uid. Reports what it
    achieved as lines on `plan.report_fd`; a step that must hold and fails exits the child 126."""
    def report(line: str) -> None:
        os.write(plan.report_fd, (line + "\n").encode())

    try:
        libc = _LIBC
        home = plan.work
        if plan.root:
            if libc.unshare(CLONE_NEWNET) == 0:
                report("network=none")
            else:
                report(f"network=shared (unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())})")
            if libc.unshare(CLONE_NEWNS) != 0:
                report(f"setup_error=unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
                os._exit(126)
            _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
            python_dir = os.path.join(plan.work, PYTHON_DIR)
            _mount(libc, plan.prefix, python_dir, None, MS_BIND | MS_REC)
            _mount(libc, None, python_dir, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            _mount(libc, plan.work, INSIDE_DIR, None, MS_BIND | MS_REC)
            for shared in ("/var/tmp", "/dev/shm"):
                if os.path.isdir(shared):
                    _mount(libc, "tmpfs", shared, "tmpfs", MS_RDONLY, b"size=4k")
            report("tmp=private")
            home = INSIDE_DIR
            env["LD_LIBRARY_PATH"] = os.path.join(INSIDE_DIR, PYTHON_DIR, "lib")
        else:
            report("network=shared (not root: no network namespace)")
        if plan.cgroup is not None:
            plan.cgroup.join()
            report("pids=cgroup")
        os.chdir(home)
        lim = plan.limits
        cpu = int(lim.cpu_time_s)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.max_file_bytes, lim.max_file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim.max_open_files, lim.max_open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # With the call's own pids cgroup the uid-wide limit is only a backstop, loose enough
        # that sandboxes running at once do not share one call's allowance.
        nproc = lim.max_processes * (NPROC_BACKSTOP if plan.cgroup is not None else 1)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        if plan.root:
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            report(f"uid={NOBODY}")
        else:
            report(f"uid={os.getuid()} (not root: cannot switch to an unprivileged uid)")
        env["HOME"] = env["TMPDIR"] = home
        os.environ.clear()
        os.environ.update(env)
    except OSError as e:
        report(f"setup_error={e}")
        os._exit(126)
    finally:
        os.close(plan.report_fd)


def _mount(libc: Any, source: str | None, target: str, fstype: str | None, flags: int,
           data: bytes | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _collect(proc: subprocess.Popen, limits: Limits) -> SandboxResult:
    """Read stdout/stderr until exit, the wall-time limit or the output limit; kill the group."""
    start = time.monotonic()
    deadline = start + limits.wall_time_s
    chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    total, killed = 0, None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    try:
        exited_at = None
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                killed = f"killed: wall time limit {limits.wall_time_s:g} s"
                break
            # Children that outlive the main process keep the pipes open: once it has exited,
            # read what is already there and stop (the group is killed below).
            if exited_at is None and proc.poll() is not None:
                exited_at = time.monotonic()
            elif exited_at is not None and time.monotonic() - exited_at > EXIT_DRAIN_S:
                break
            for key, _ in sel.select(timeout=min(left, POLL_S)):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                room = limits.max_output_bytes - total
                chunks[key.data].append(data[:max(room, 0)])
                total += len(data)
                if total > limits.max_output_bytes:
                    killed = f"killed: output limit {limits.max_output_bytes} bytes"
                    break
            if killed:
                break
    finally:
        sel.close()
        _kill_group(proc.pid)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    stdout = b"".join(chunks["stdout"]).decode(errors="replace")
    stderr = b"".join(chunks["stderr"]).decode(errors="replace")
    code = proc.returncode
    sig = -code if code is not None and code < 0 else None
    if killed is None:
        killed = _limit_hit(sig, stderr, limits)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=None if sig else code, signal=sig,
                         killed=killed, duration_s=time.monotonic() - start)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _limit_hit(sig: int | None, stderr: str, limits: Limits) -> str | None:
    """Which limit a finished process ran into, from its signal and its error output."""
    if sig in (signal.SIGXCPU, signal.SIGKILL) and sig is not None:
        # The kernel sends SIGXCPU at the soft CPU limit and SIGKILL at the hard one.
        return f"killed: CPU time limit {limits.cpu_time_s} s"
    if sig == signal.SIGXFSZ:
        return f"killed: file size limit {limits.max_file_bytes} bytes"
    tail = stderr[-2000:]
    if "MemoryError" in tail or (sig in (signal.SIGSEGV, signal.SIGABRT) and sig is not None):
        return f"memory limit {limits.memory_bytes >> 20} MiB hit (MemoryError)"
    if "BlockingIOError" in tail or "Resource temporarily unavailable" in tail:
        return f"process limit {limits.max_processes} hit (fork failed)"
    if sig is not None:
        return f"killed by signal {signal.Signals(sig).name}"
    return None


def _isolation(lines: list[str], *, root: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"network": "unknown", "tmp": "shared", "uid": None}
    for line in lines:
        key, _, value = line.partition("=")
        out[key] = int(value) if key == "uid" and value.isdigit() else value
    return out


