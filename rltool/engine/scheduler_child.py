"""Starting and stopping the scheduler process of the two-process layout (docs/serve.md "Process
layout"). Imports nothing heavy (no torch, no web stack): the front end starts the process first,
so the scheduler loads the model while the front end imports its own modules."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from rltool.engine import ipc
from rltool.engine.config import ServeConfig
from rltool.errors import EngineError
from rltool.supervisor import _parent_death_signal

if TYPE_CHECKING:
    from rltool.engine.link import EngineInfo
    from rltool.engine.remote_link import RemoteLink

STOP_TIMEOUT_S = 15.0  # how long a stopping scheduler process may take before it is killed


class SchedulerChild:
    """The scheduler process: started with one end of a socket pair, stopped in order."""

    def __init__(self, cfg: ServeConfig):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        self.connected = False
        try:
            # Killed with the front end (SIGKILL included), which holds the channel and the port.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rltool.engine.scheduler_process", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], preexec_fn=_parent_death_signal)
        finally:
            theirs.close()
        # The config holds the API keys: it goes over the private socket, never argv or env.
        ours.sendall(ipc.frame({"t": "config",
                                "cfg": cfg.model_dump(mode="json", exclude_unset=True)}))

    async def connect(self, tokenizer: Awaitable[tuple[str, Any]] | None = None
                      ) -> tuple[RemoteLink, EngineInfo]:
        """Wait until the scheduler process has built the engine; its link and facts.
        `tokenizer`: (path, tokenizer) loaded meanwhile, used if the engine's is that path."""
        from rltool.engine.link import EngineInfo
        from rltool.engine.remote_link import RemoteLink

        reader, writer = await asyncio.open_unix_connection(sock=self.sock)
        try:
            hello = await ipc.read_message(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            raise EngineError(f"the scheduler process exited (code {self.proc.wait()}) before "
                              "the engine was ready; its error is in the log above") from None
        if hello["t"] == "fail":  # raised as one process raises it (a bad checkpoint: exit 2)
            error = ipc.error_from(hello["err"])
            if isinstance(error, RuntimeError):
                raise EngineError(f"the scheduler process could not start the engine: {error}")
            raise error
        facts, preloaded = hello["facts"], None
        if tokenizer is not None:
            path, loaded = await tokenizer
            preloaded = loaded if path == facts["tokenizer_path"] else None
        info = EngineInfo.from_facts(facts, tokenizer=preloaded)
        link = RemoteLink(reader, writer, proc=self.proc, info=info,
                          weight_version=hello["weight_version"])
        link.start()
        self.connected = True
        return link, info

    def stop(self) -> int:
        """Wait for the process to end (it was told to stop, or lost its channel); SIGTERM, then
        SIGKILL past STOP_TIMEOUT_S. One still loading the model (it reads the channel only once
        it serves) gets SIGTERM at once. Its exit status."""
        self.sock.close()  # its reader sees the end of the channel
        steps = (None, self.proc.terminate, self.proc.kill)
        for signal_it in steps if self.connected else steps[1:]:
            if signal_it is not None:
                signal_it()
            try:
                return self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.wait()
