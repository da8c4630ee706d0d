"""`rltool serve --engine sglang` and `--engine external`.

sglang: build `python -m sglang.launch_server` from rltool's flags (mapping below) plus every
`--sglang-<opt> [value]` passed through untouched as `--<opt> [value]`, start it in its own process
group with its output in a log file, wait for `/health` (timeout), write the ready file with
{url, pid} (pid = this supervising process), and end SGLang when this process gets SIGTERM/SIGINT
or SGLang exits on its own (then exit with an error). With `--port 0` a free port is picked here
and passed on (SGLang needs an explicit port).

external: wait until `--url` answers `/health`, write the ready file ({url, pid: null}) and return.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from rltool.config import torch_dtype_name
from rltool.engine import api
from rltool.engine.config import ServeConfig
from rltool.errors import BadInputError, EngineError
from rltool.supervisor import announce_ready, start, wait_healthy, withdraw_ready

log = logging.getLogger(__name__)
POLL_S = 0.25
SGLANG_STOP_TIMEOUT_S = 15.0


def sglang_command(cfg: ServeConfig, *, port: int) -> list[str]:
    """The launch_server command line. rltool flag -> SGLang flag:
    --model -> --model-path, --host, --port, --dtype fp32|bf16 -> float32|bfloat16,
    --max-running-requests, --max-queued-requests, --num-continuous-decode-steps (when not 1),
    --deterministic -> --enable-deterministic-inference, --weight-version, --served-model-name,
    --api-key, --admin-api-key, --log-level; then the --sglang-* options as given."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(cfg.model),
           "--host", cfg.host, "--port", str(port), "--dtype", torch_dtype_name(cfg.dtype),
           "--max-running-requests", str(cfg.max_running_requests),
           "--max-queued-requests", str(cfg.max_queued_requests),
           "--weight-version", cfg.weight_version, "--log-level", cfg.log_level]
    if cfg.num_continuous_decode_steps != 1:
        cmd += ["--num-continuous-decode-steps", str(cfg.num_continuous_decode_steps)]
    if cfg.deterministic:
        cmd.append("--enable-deterministic-inference")
    for flag, value in (("--served-model-name", cfg.served_model_name),
                        ("--api-key", cfg.api_key), ("--admin-api-key", cfg.admin_api_key)):
        if value:
            cmd += [flag, value]
    return cmd + passthrough(cfg.sglang_args)


def passthrough(args: list[str]) -> list[str]:
    """`--sglang-foo v --sglang-bar` -> `--foo v --bar` (values and order untouched)."""
    out = []
    for arg in args:
        if arg.startswith("--sglang-"):
            out.append("--" + arg[len("--sglang-"):])
        elif arg.startswith("--"):
            raise BadInputError(f"unknown option {arg}; pass SGLang's options as --sglang-<name>")
        else:
            out.append(arg)
    return out


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def attach_external(cfg: ServeConfig) -> str:
    assert cfg.url is not None
    url = cfg.url.rstrip("/")
    wait_healthy(url, api.HEALTH, timeout_s=cfg.health_timeout_s, api_key=cfg.api_key)
    announce_ready(cfg.ready_file, url=url, pid=None)
    return url


def serve_sglang(cfg: ServeConfig, *, log_path: Path | None = None) -> None:
    """Run SGLang until SIGTERM/SIGINT; raise EngineError if it dies or never gets healthy."""

    if importlib.util.find_spec("sglang") is None:
        raise EngineError("--engine sglang needs the sglang package (pip install "
                          "'rltool[sglang]', a CUDA machine); use --engine builtin on CPU")
    port = cfg.port or free_port(cfg.host)
    url = api.url_of(cfg.host, port)
    cmd = sglang_command(cfg, port=port)
    if log_path is None:
        log_path = Path(cfg.ready_file).with_suffix(".sglang.log") if cfg.ready_file else \
            Path(f"sglang-{port}.log")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info("starting %s (log %s)", " ".join(cmd), log_path)
    # SGLang forks its scheduler and detokenizer processes: stop ends the whole group.
    child = start(cmd, log_path=log_path, name="sglang server", term_group=True)
    try:
        child.wait_healthy(url, api.HEALTH, timeout_s=cfg.health_timeout_s, api_key=cfg.api_key)
        announce_ready(cfg.ready_file, url=url, pid=os.getpid())
        log.info("sglang ready at %s (pid %d)", url, child.pid)
        while not stop.is_set():
            if not child.alive():
                raise EngineError(child.with_log(f"sglang exited with code "
                                                 f"{child.popen.returncode}"))
            stop.wait(POLL_S)
    finally:
        child.stop(SGLANG_STOP_TIMEOUT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        withdraw_ready(cfg.ready_file)
