"""Run the builtin engine: load the model, start the scheduler, serve HTTP with uvicorn.

Two layouts (docs/serve.md "Process layout", --frontend-process): the scheduler thread in this
process beside uvicorn (`serve_one_process`), or the HTTP front end here and the scheduler in a
process of its own (`serve_two_processes`, rltool.engine.scheduler_process), reached through
rltool.engine.remote_link.

`--port 0` binds a free port (the socket is bound here, before uvicorn starts, so the real port is
known); once `/health_generate` answers, `--ready-file` is written atomically with {url, pid} (this
process's pid in either layout). On SIGTERM/SIGINT uvicorn stops accepting, the scheduler aborts
what is in flight, and the ready file is removed so nobody reads a stale URL. A scheduler process
that exits unasked ends the server too: requests waiting on it get 503, then serve raises
EngineError (exit 3).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

from rltool.engine import api
from rltool.errors import EngineError
from rltool.engine.config import ServeConfig
from rltool.supervisor import announce_ready, exit_now, withdraw_ready

if TYPE_CHECKING:
    from rltool.engine.app import EngineState
    from rltool.engine.paged_scheduler import PagedScheduler

log = logging.getLogger(__name__)
SELF_CHECK_TIMEOUT_S = 60.0
GIL_SWITCH_INTERVAL_S = 0.0005


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit this. With Nagle on, a keep-alive response's last segment waited
    # for the client's delayed ACK: ~44 ms per request with httpx (4.8 ms with it off).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EngineError(f"cannot bind {host}:{port}: {e}; pick another --port (0 = any free)") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """Aborts in-flight generations as soon as a shutdown signal arrives, so handlers answer
        at once and the graceful shutdown does not wait for long generations."""

        def __init__(self, link: Any, config: uvicorn.Config):
            super().__init__(config)
            self.link = link

        def handle_exit(self, sig: int, frame: object) -> None:
            self.link.request_stop()
            super().handle_exit(sig, frame)

    return Server


def process_age_s() -> float:
    """Seconds since this process started: its interpreter start and imports included."""
    import psutil

    return time.time() - psutil.Process().create_time()


def build_engine(cfg: ServeConfig) -> tuple[Any, PagedScheduler]:
    """The paged runner and scheduler on the configured device (one code path for CPU and CUDA)."""
    from rltool.engine.paged_runner import PagedRunner
    from rltool.engine.paged_scheduler import PagedScheduler

    imported_s = process_age_s()
    runner = PagedRunner(cfg.model, device=cfg.engine_device, dtype=cfg.dtype,
                         weight_version=cfg.weight_version,
                         max_running=cfg.max_running_requests, page_size=cfg.page_size,
                         mem_fraction_static=cfg.mem_fraction_static,
                         max_total_tokens=cfg.max_total_tokens,
                         cuda_graph_max_bs=cfg.cuda_graph_max_bs,
                         disable_cuda_graph=cfg.disable_cuda_graph,
                         prefix_cache=not cfg.disable_radix_cache,
                         deterministic=cfg.deterministic, kv_cache_dtype=cfg.kv_cache_dtype,
                         mamba_full_memory_ratio=cfg.mamba_full_memory_ratio,
                         mamba_ssm_dtype=cfg.mamba_ssm_dtype,
                         prefill_attention=cfg.prefill_attention,
                         hicache=cfg.enable_hierarchical_cache, hicache_ratio=cfg.hicache_ratio,
                         hicache_size_gb=cfg.hicache_size, enable_lora=cfg.enable_lora,
                         max_lora_rank=cfg.max_lora_rank)
    for name, path in cfg.lora_adapters().items():
        runner.lora.load(name, path)
    log.info("engine loaded %.2f s after its process started (modules imported after %.2f s)",
             process_age_s(), imported_s)
    return runner, PagedScheduler(runner, max_running=cfg.max_running_requests,
                                  max_queued=cfg.max_queued_requests,
                                  max_prefill_tokens=cfg.max_prefill_tokens,
                                  chunked_prefill_size=cfg.chunked_prefill_size,
                                  deterministic=cfg.deterministic,
                                  num_continuous_decode_steps=cfg.num_continuous_decode_steps,
                                  schedule_policy=cfg.schedule_policy,
                                  enable_mixed_chunk=cfg.enable_mixed_chunk)


def serve(cfg: ServeConfig) -> NoReturn:
    """Serve until SIGTERM/SIGINT (blocking), in the layout --frontend-process picks; once
    stopped cleanly the process ends at once (rltool.supervisor.exit_now: the seconds of Python's
    module teardown skipped). A failure raises."""
    if cfg.uses_frontend_process:
        serve_two_processes(cfg)
    else:
        serve_one_process(cfg)
    exit_now(0)


# An idle keep-alive connection is closed after this long. It must outlast the idle expiry of
# clients' connection pools (aiohttp keeps one 15 s, httpx 5 s): with uvicorn's default of 5 s, a
# client could send a request on a pooled connection in the moment the server closed it, and the
# request failed with "Server disconnected" (seen under load with 256 aiohttp connections).
KEEP_ALIVE_S = 75


def _uvicorn_server(state: EngineState) -> Any:
    import uvicorn

    from rltool.engine.app import build_app

    config = uvicorn.Config(build_app(state), log_level=state.cfg.log_level, lifespan="off",
                            timeout_graceful_shutdown=1, access_log=False,
                            timeout_keep_alive=KEEP_ALIVE_S)
    return _server_class()(state.link, config)


def serve_one_process(cfg: ServeConfig) -> None:
    if cfg.num_threads > 0:
        import torch

        torch.set_num_threads(cfg.num_threads)
    from rltool.engine.app import EngineState

    runner, scheduler = build_engine(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    url = api.url_of(cfg.host, sock.getsockname()[1])
    server = _uvicorn_server(EngineState(cfg=cfg, runner=runner, scheduler=scheduler,
                                         started=time.monotonic()))
    # The scheduler thread runs Python-heavy model code; a short GIL switch interval keeps the
    # event loop (HTTP parsing, SSE writes) responsive instead of waiting 5 ms per hand-over.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    scheduler.start()
    # uvicorn re-raises the SIGTERM/SIGINT it caught once it has shut down; with the default
    # handler that would kill the process before the cleanup below, so the re-raise lands here.
    previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner_:
            runner_.run(_run(server, sock, url, cfg))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        scheduler.stop()
        sock.close()
        withdraw_ready(cfg.ready_file)


def serve_two_processes(cfg: ServeConfig) -> None:
    """The front end here, the scheduler in its own process; both end on SIGTERM/SIGINT. The
    process starts first: it loads the model while this one imports the HTTP app."""
    from rltool.engine.scheduler_child import SchedulerChild

    sock = bind_socket(cfg.host, cfg.port)
    url = api.url_of(cfg.host, sock.getsockname()[1])
    child = SchedulerChild(cfg)
    previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    failure: str | None = None
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner_:
            failure = runner_.run(_run_front_end(cfg, child, sock, url))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        code = child.stop()
        sock.close()
        withdraw_ready(cfg.ready_file)
    if failure is not None:
        raise EngineError(f"{failure}; the front end stopped (scheduler exit status {code})")


async def _run_front_end(cfg: ServeConfig, child: Any, sock: socket.socket,
                         url: str) -> str | None:
    """Serve over `child` until a signal or its exit; why it exited unasked, or None."""
    loop = asyncio.get_running_loop()
    tokenizer: asyncio.Future = loop.create_future()
    tokenizer.add_done_callback(lambda f: f.cancelled() or f.exception())  # read if unused
    connecting = asyncio.ensure_future(child.connect(tokenizer))
    # While the scheduler process loads the model, a signal ends the wait (uvicorn's handlers
    # take over once it serves); one during the imports below is handled once they are done.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, connecting.cancel)
    # While the scheduler process loads the model: the HTTP app, and the tokenizer (loaded after
    # the model, it was the last step before serving: seconds where transformers imports slowly).
    from rltool.engine.app import EngineState
    try:
        tokenizer.set_result(_load_tokenizer(cfg.model))
    except Exception as e:  # noqa: BLE001 - raised once the scheduler is ready: its error first
        tokenizer.set_exception(e)
    log.info("front end loaded (HTTP app, tokenizer) %.2f s after the process started",
             process_age_s())

    try:
        link, info = await connecting
    except asyncio.CancelledError:
        return None
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
            signal.signal(sig, _note_signal)
    server = _uvicorn_server(EngineState(cfg=cfg, link=link, info=info,
                                         started=time.monotonic()))

    def on_exit() -> None:
        server.should_exit = True

    link.on_exit = on_exit
    await _run(server, sock, url, cfg)
    failure = link.exited if link.failed else None
    link.request_stop()
    return failure


def _load_tokenizer(model: str) -> tuple[str, Any]:
    from pathlib import Path

    from rltool.engine.loading import load_tokenizer

    return str(Path(model)), load_tokenizer(Path(model))


def _loop_factory() -> Any:
    """uvloop's event loop when it is installed (a dependency; absent on hosts that run rltool
    from a source tree), as uvicorn's own `loop="auto"` would pick: about 2x less event-loop CPU per
    request than asyncio's, which the scheduler thread gets back through the GIL."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _note_signal(signum: int, frame: object) -> None:
    log.info("received signal %d; shutting down", signum)


async def _run(server: object, sock: socket.socket, url: str, cfg: ServeConfig) -> None:
    import httpx

    task = asyncio.create_task(server.serve(sockets=[sock]))  # type: ignore[attr-defined]
    while not server.started and not task.done():  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
    if not task.done():
        async with httpx.AsyncClient(timeout=SELF_CHECK_TIMEOUT_S) as client:
            r = await client.get(url + api.HEALTH_GENERATE)
        if r.status_code != 200:
            server.should_exit = True  # type: ignore[attr-defined]
            await task
            raise EngineError(f"the engine's self-check /health_generate answered {r.status_code}")
        log.info("builtin engine ready at %s (pid %d)", url, os.getpid())
        announce_ready(cfg.ready_file, url=url, pid=os.getpid())
    await task
