"""The asynchronous loop's rollout worker: the RolloutStream in a process of its own.

In the loop's process the rollout client (HTTP, JSON, rewards) would share the trainer's core and
its GIL, and slow every training step; as a child process it runs beside the engines instead
(pinned to `engine_cores` when given). `python -m rltool.loop.async_worker REPLY_FD` reads one JSON
command per line on stdin and answers each with one JSON line on the inherited descriptor
REPLY_FD (stdout and stderr go to RUN/logs/rollout.log):

  {"op": "init", "rollout": {...RolloutConfig...}, "gate": {...StalenessGate...},
   "engine_version": V, "trainer_version": V, "next_position": N, "redo": [...],
   "cores": [...] | null}
  {"op": "take", "rollout": {...the step's RolloutConfig...}, "train_version": V,
   "next": {"rollout": {...}, "train_version": V'} | null}
      -> the step's batch written as its shard (async_batch.write_batch); {"seconds": s}, the
         seconds the caller waited for it. With "next", the worker then prepares the next step's
         batch and shard on a thread of its own while the caller trains (async_batch.Prepared);
         the next take of that step only waits for it to be written.
  {"op": "set_versions", "trainer_version": V, "engine_version": V} -> {"requeued": n}, the
      aborted samples requeued since the last set_versions
  {"op": "in_flight"} -> {"samples": n}
Every answer is {"ok": true, ...} or {"ok": false, "error": "..."}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any, NoReturn

from rltool.errors import EngineError
from rltool.loop.engines import ChildRegistry
from rltool.supervisor import Child, log_tail


class RolloutWorker:
    """The coordinator's handle on the worker process (recorded in engines.json)."""

    def __init__(self, registry: ChildRegistry, *, log_path: Path, init: dict[str, Any]):
        read_fd, write_fd = os.pipe()
        self.cmdline = [sys.executable, "-m", "rltool.loop.async_worker", str(write_fd)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(self.cmdline, stdin=subprocess.PIPE, stdout=log, stderr=log,
                                     pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        self.child = Child(popen=popen, cmdline=self.cmdline, log_path=log_path,
                           name="rollout worker")
        self.replies = os.fdopen(read_fd, "rb")
        self.sent: deque[str] = deque()  # the ops whose answers are still to be read
        self.prepared_step: int | None = None  # the step whose batch the worker prepares
        self.registry = registry
        registry.add(role="rollout", pid=popen.pid, cmdline=self.cmdline)
        try:
            self.call({"op": "init", **init})
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.child.pid

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.send(message)
        return self.receive()

    def send(self, message: dict[str, Any]) -> None:
        """Write one command without waiting for its answer (`receive` reads the answers in the
        order the commands were sent), so the caller can work meanwhile."""
        popen = self.child.popen
        try:
            assert popen.stdin is not None
            popen.stdin.write((json.dumps(message) + "\n").encode())
            popen.stdin.flush()
        except (BrokenPipeError, OSError):
            self._exited()
        self.sent.append(message["op"])

    def receive(self) -> dict[str, Any]:
        """The answer to the oldest command sent and not yet received."""
        op = self.sent.popleft()
        try:
            line = self.replies.readline()
        except OSError:
            line = b""
        if not line:
            self._exited()
        answer = json.loads(line)
        if not answer.get("ok"):
            raise EngineError(f"the rollout worker failed on {op}: {answer.get('error')}")
        return answer

    def _exited(self) -> NoReturn:
        raise EngineError(f"the rollout worker exited; {self.child.log_path} ends with:\n"
                          f"{log_tail(self.child.log_path)}")

    def stop(self) -> None:
        """End the worker by its PID (SIGTERM, then SIGKILL): what it holds in flight is never
        written, and a resume regenerates it from the newest shard's held positions."""
        self.child.stop()
        self.replies.close()
        self.registry.remove(self.child.pid)


def serve(reply_fd: int) -> None:
    """The worker's command loop (see the module docstring)."""
    from rltool.loop.async_batch import Prepared
    from rltool.loop.async_rollout import RolloutStream
    from rltool.loop.async_staleness import StalenessGate
    from rltool.rollout.stage import RolloutConfig

    replies = os.fdopen(reply_fd, "wb", buffering=0)
    stream: RolloutStream | None = None
    prepared: Prepared | None = None
    for line in sys.stdin:
        message = json.loads(line)
        op = message["op"]
        try:
            answer: dict[str, Any] = {}
            if op == "init":
                if message.get("cores"):
                    os.sched_setaffinity(0, set(message["cores"]))
                stream = RolloutStream(RolloutConfig(**message["rollout"]),
                                       gate=StalenessGate(**message["gate"]),
                                       engine_version=message["engine_version"],
                                       next_position=message["next_position"],
                                       redo=message["redo"])
                stream.trainer_version = message["trainer_version"]
                stream.start()
            elif stream is None:
                raise EngineError(f"{op} before init")
            elif op == "take":
                cfg = RolloutConfig(**message["rollout"])
                if prepared is not None and prepared.out != cfg.out:
                    raise EngineError(f"take of {cfg.out} while {prepared.out} is prepared")
                if prepared is None:
                    prepared = Prepared(stream, cfg, train_version=message["train_version"])
                answer["seconds"] = prepared.wait()
                following = message.get("next")
                prepared = None if following is None else Prepared(
                    stream, RolloutConfig(**following["rollout"]),
                    train_version=following["train_version"])
            elif op == "set_versions":
                stream.set_versions(trainer_version=message["trainer_version"],
                                    engine_version=message["engine_version"])
                answer["requeued"] = stream.requeued_since_last_call()
            elif op == "in_flight":
                answer["samples"] = stream.in_flight_samples()
            else:
                raise EngineError(f"unknown op {op!r}")
            replies.write((json.dumps({"ok": True, **answer}) + "\n").encode())
        except Exception as e:  # noqa: BLE001 - reported to the coordinator, which raises it
            replies.write((json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"})
                           + "\n").encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
