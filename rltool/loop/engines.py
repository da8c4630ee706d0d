"""The loop's child processes: builtin engines (and the disaggregated trainer), recorded in
engines.json so that cleanup and `--resume` end them by PID, never by name.

Every child the loop starts is recorded as {role, url, pid, cmdline} before the loop relies on it;
`end_orphans` ends a recorded PID only when psutil shows the same command line (a recycled PID
belongs to someone else and is left alone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rltool import trace
from rltool.errors import EngineError
from rltool.loop.keys import engine_env
from rltool.rollout.launch import EngineProcess, start_engine
from rltool.rundir import RunDir
from rltool.supervisor import free_port, start

log = logging.getLogger(__name__)


class ChildRegistry:
    """engines.json: the children this run has alive, rewritten atomically on every change."""

    def __init__(self, run: RunDir):
        self.run = run
        self.entries: list[dict[str, Any]] = []

    def add(self, *, role: str, pid: int, cmdline: list[str], url: str | None = None) -> None:
        self.entries.append({"role": role, "pid": pid, "cmdline": list(cmdline), "url": url})
        self.run.write_engines(self.entries)

    def remove(self, pid: int) -> None:
        self.entries = [e for e in self.entries if e["pid"] != pid]
        self.run.write_engines(self.entries)


def end_orphans(run: RunDir, *, timeout_s: float = 10.0) -> list[int]:
    """End the children a killed loop left behind (from engines.json); returns the PIDs ended."""
    import psutil

    ended = []
    for entry in run.read_engines():
        pid, cmdline = entry.get("pid"), entry.get("cmdline")
        if not isinstance(pid, int) or not isinstance(cmdline, list):
            continue
        try:
            proc = psutil.Process(pid)
            if proc.cmdline() != cmdline:
                log.info("pid %d is not our %s any more (command line differs); left alone",
                         pid, entry.get("role"))
                continue
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except psutil.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)
            ended.append(pid)
            log.info("ended orphaned %s pid %d", entry.get("role"), pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    run.write_engines([])
    return ended


class EngineSet:
    """The loop's engines: start, weight updates, memory release/resume, stop."""

    def __init__(self, run: RunDir, registry: ChildRegistry, *, num_engines: int,
                 engine_args: list[str], deterministic: bool, ready_timeout_s: float,
                 log_prefix: str = "engine", api_key: str | None = None,
                 admin_api_key: str | None = None, local_weights: Path | None = None):
        self.run = run
        self.log_prefix = log_prefix
        self.registry = registry
        self.num_engines = num_engines
        self.engine_args = list(engine_args)
        self.deterministic = deterministic
        self.ready_timeout_s = ready_timeout_s
        self.procs: list[EngineProcess] = []
        self._group: Any = None  # the weight-update process group (distributed sync)
        # The keys the engines serve with (rltool.loop.keys: by environment, never argv), and
        # the one of their control routes.
        self.serve_keys = {"api_key": api_key, "admin_api_key": admin_api_key}
        self.api_key: str | None = admin_api_key or api_key
        # Where /pull_weights rebuilds a delta version: one directory per engine set, since a
        # pull rewrites it and the engines load from it after the pull's lock is released.
        self.local_weights = local_weights or run.local_weights
        self.master_address = "127.0.0.1"  # the broadcast's rank 0 (this process)

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    @property
    def clients(self) -> dict[str, Any] | None:
        """Engine clients the stages should use instead of opening HTTP clients (none here)."""
        return None

    def start(self, model_dir: Path) -> None:
        # Weight paths the engines accept: the run's weights/ (the model's parent) and the
        # host-local directory /pull_weights rebuilds delta versions in.
        args = ["--engine", "builtin", "--model", str(model_dir), "--local-checkpoint-dir",
                str(self.local_weights), *self.engine_args]
        if self.deterministic and "--deterministic" not in args:
            args.append("--deterministic")
        for i in range(self.num_engines):
            with trace.span("engine_start", cat="wait", engine=i):
                proc = start_engine(args, log_path=self.run.log_file(f"{self.log_prefix}-{i}"),
                                    ready_timeout_s=self.ready_timeout_s,
                                    env=engine_env(**self.serve_keys))
            self.procs.append(proc)
            self.registry.add(role="engine", pid=proc.pid, cmdline=proc.cmdline, url=proc.url)

    def check_alive(self) -> None:
        dead = [p.url for p in self.procs if not p.alive()]
        if dead:
            raise EngineError(f"engine(s) {dead} exited; see {self.run.logs}/engine-*.log, then "
                              f"`rltool loop --resume {self.run.root}`")

    def stop(self) -> None:
        self._group = None
        for proc in self.procs:
            proc.stop()
            self.registry.remove(proc.pid)
        self.procs = []

    def client(self, url: str) -> Any:
        """An EngineClient for the control routes of the engine at `url`."""
        from rltool.rollout.client import EngineClient

        return EngineClient(url, api_key=self.api_key, timeout_s=600.0)

    def _each(self, call: Callable[[Any], Awaitable[Any]]) -> list[Any]:
        async def run_all() -> list[Any]:
            clients = [self.client(url) for url in self.urls]
            try:
                return list(await asyncio.gather(*(call(c) for c in clients)))
            finally:
                for c in clients:
                    await c.aclose()

        self.check_alive()
        return asyncio.run(run_all())

    def release_memory(self) -> None:
        with trace.span("offload", cat="memory"):
            self._each(lambda c: c.release_memory_occupation())

    def resume_memory(self) -> None:
        with trace.span("reload", cat="memory"):
            self._each(lambda c: c.resume_memory_occupation())

    def pause(self, mode: str) -> None:
        """/pause_generation on every engine: abort, retract or in_place (docs/engine-api.md)."""
        with trace.span("pause", cat="weights", mode=mode):
            self._each(lambda c: c.pause_generation(mode))

    def continue_generation(self) -> None:
        self._each(lambda c: c.continue_generation())

    def load_version(self, version: int, *, delta: bool) -> float:
        """Make every engine serve `version`; returns the seconds it took.

        A delta version is first rebuilt in the host-local directory (`/pull_weights`, shared by
        the engines of this host under its file lock), then loaded from there.
        """
        t0 = time.perf_counter()
        path = self.run.weight_version(version)
        if delta:
            local = self.local_weights
            self._each(lambda c: c.pull_weights(local_checkpoint_dir=str(local),
                                                source_dir=str(self.run.weights),
                                                target_version=version))
            path = local
        with trace.span("weight_load", cat="weights", version=version, delta=delta):
            self._each(lambda c: c.update_weights_from_disk(str(path), weight_version=str(version)))
        return time.perf_counter() - t0


    @property
    def dtype(self) -> Any:
        """The dtype the engines serve (their --dtype; fp32 by default)."""
        import torch

        args = self.engine_args
        name = args[args.index("--dtype") + 1] if "--dtype" in args[:-1] else "fp32"
        return {"fp32": torch.float32, "bf16": torch.bfloat16}.get(name, torch.float32)

    @property
    def device(self) -> str:
        """Where the engines serve (their --device, resolved; auto: CUDA when torch sees one)."""
        from rltool.engine.config import resolve_device

        args = self.engine_args
        return resolve_device(args[args.index("--device") + 1] if "--device" in args[:-1]
                              else "auto")

    def load_tensors(self, named: list[tuple[str, Any]], *, version: int,
                     bucket_bytes: int, block: tuple[int, int] | None = None,
                     lora_config: dict[str, Any] | None = None) -> float:
        """Hand the weights to every engine a bucket at a time (/update_weights_from_tensor)
        through one buffer: a CUDA IPC device buffer when the engines serve on CUDA, else a
        shared-memory segment; the last bucket sets the version. `block`: `named` is block FP8
        (rltool.delta.tensor_sync.quantize_named), sent as it is. `lora_config`: sent with each
        bucket of LoRA tensors (rltool.loop.lora_sync.tensor_config). Returns the seconds."""
        import json

        from rltool.delta import tensor_sync
        from rltool.engine import api

        t0 = time.perf_counter()
        groups = tensor_sync.buckets(named, bucket_bytes=bucket_bytes)
        size = tensor_sync.segment_bytes(named, bucket_bytes=bucket_bytes)
        cuda = self.device == "cuda"
        fmt = api.CUDA_IPC_FORMAT if cuda else api.SHM_FORMAT
        buffer = (tensor_sync.CudaIpcBuffer(size, device="cuda") if cuda
                  else tensor_sync.ShmSegment(size))
        with buffer as buf:
            for i, bucket in enumerate(groups):
                message = buf.write(bucket, dtype=None if block else self.dtype)
                if block:
                    message["weight_block_size"] = list(block)
                message = json.dumps(message)
                tag = str(version) if i == len(groups) - 1 else None
                self._each(lambda c: c.update_weights_from_tensor(
                    [message], load_format=fmt, weight_version=tag, lora_config=lora_config))
        return time.perf_counter() - t0

    def load_distributed(self, named: list[tuple[str, Any]], *, version: int,
                         bucket_bytes: int, lora_config: dict[str, Any] | None = None) -> float:
        """Broadcast the weights to every engine over a gloo process group (rank 0 is this
        process, joined on first use), a bucket per /update_weights_from_distributed call
        (with `lora_config`, as load_tensors)."""
        from rltool.delta import sync_group, tensor_sync

        t0 = time.perf_counter()
        self.check_alive()
        dtype = self.dtype
        address = self.master_address

        async def run_all() -> None:
            clients = [self.client(url) for url in self.urls]
            try:
                if self._group is None:
                    port = free_port(address)
                    joins = asyncio.gather(*(c.init_weights_update_group(
                        master_address=address, master_port=port, rank_offset=i + 1,
                        world_size=len(clients) + 1, backend="gloo")
                        for i, c in enumerate(clients)))
                    self._group = await asyncio.to_thread(
                        sync_group.join_group, master_address=address, master_port=port,
                        rank=0, world_size=len(clients) + 1)
                    await joins
                groups = tensor_sync.buckets(named, bucket_bytes=bucket_bytes)
                for i, bucket in enumerate(groups):
                    bucket = [(n, t.detach().to(dtype)) for n, t in bucket]
                    tag = str(version) if i == len(groups) - 1 else None
                    updates = asyncio.gather(*(c.update_weights_from_distributed(
                        **tensor_sync.describe(bucket), weight_version=tag,
                        lora_config=lora_config) for c in clients))
                    await asyncio.to_thread(tensor_sync.broadcast, self._group,
                                            [t for _, t in bucket])
                    await updates
            finally:
                for c in clients:
                    await c.aclose()

        asyncio.run(run_all())
        return time.perf_counter() - t0


class TrainerProcess:
    """`rltool train --config FILE` as a recorded child (disaggregated placement), run by
    `launcher` (the command before the module name: this Python's `-m`, or torchrun's)."""

    def __init__(self, registry: ChildRegistry, *, config_file: Path, log_path: Path,
                 launcher: list[str] | None = None):
        import sys

        self.registry = registry
        self.cmdline = [*(launcher or [sys.executable, "-m"]), "rltool", "train", "--config",
                        str(config_file), "--json"]
        self.log_path = log_path

    def run(self) -> tuple[int, str]:
        """Run to completion; returns (exit code, stdout). Ends the child on any interruption."""
        child = start(self.cmdline, log_path=self.log_path, name="trainer", capture_stdout=True)
        self.registry.add(role="trainer", pid=child.pid, cmdline=self.cmdline)
        try:
            out, _ = child.popen.communicate()
        except BaseException:
            child.stop()
            raise
        finally:
            self.registry.remove(child.pid)
        return child.popen.returncode, out.decode(errors="replace")
