"""`rltool serve --engine sglang` and `--engine external`.

sglang: build `python -m sglang.launch_server` from rltool's flags (mapping below) plus every
`--sglang-<opt> [value]` passed through untouched as `--<opt> [value]`, start it in its own process
group with its output in a log file, wait for `/health` (timeout), write the ready file with
{url, pid} (pid = this supervising process), and end SGLang when this process gets SIGTERM/SIGINT
or SGLang exits on its own (then exit with an error). With `--port 0` a free port is picked here
and passed on (SGLang needs an explicit port).

Keys never go on SGLang's command line (readable by every local user in /proc/PID/cmdline, and
logged): SGLang reads no environment variable for them, so `--api-key`/`--admin-api-key` go into
a YAML file of mode 0600 in a private temporary directory, passed as SGLang's `--config` (its
launch_server merges the file into its arguments in-process), removed once SGLang is healthy.

external: wait until `--url` answers `/health`, write the ready file ({url, pid: null}) and return.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from rltool.config import torch_dtype_name
from rltool.engine import api
from rltool.engine.config import ServeConfig
from rltool.errors import BadInputError, EngineError
from rltool.supervisor import announce_ready, free_port, start, wait_healthy, withdraw_ready

log = logging.getLogger(__name__)
POLL_S = 0.25
SGLANG_STOP_TIMEOUT_S = 15.0


def sglang_command(cfg: ServeConfig, *, port: int, key_file: Path | None = None) -> list[str]:
    """The launch_server command line. rltool flag -> SGLang flag:
    --model -> --model-path, --host, --port, --dtype fp32|bf16 -> float32|bfloat16,
    --max-queued-requests, --max-running-requests (when given), --num-continuous-decode-steps
    (when not 1), --deterministic -> --enable-deterministic-inference, --weight-version,
    --served-model-name, --log-level; --api-key and --admin-api-key in `key_file` (`write_key_file`) -> --config;
    then the --sglang-* options as given."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(cfg.model),
           "--host", cfg.host, "--port", str(port), "--dtype", torch_dtype_name(cfg.dtype),
           "--max-queued-requests", str(cfg.max_queued_requests),
           "--weight-version", cfg.weight_version, "--log-level", cfg.log_level]
    if cfg.max_running_requests is not None:
        cmd += ["--max-running-requests", str(cfg.max_running_requests)]
    if cfg.num_continuous_decode_steps != 1:
        cmd += ["--num-continuous-decode-steps", str(cfg.num_continuous_decode_steps)]
    if cfg.deterministic:
        cmd.append("--enable-deterministic-inference")
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    if key_file is not None:
        cmd += ["--config", str(key_file)]
    return cmd + passthrough(cfg.sglang_args)


def write_key_file(cfg: ServeConfig, directory: Path) -> Path | None:
    """SGLang's keys as `--config` YAML, mode 0600 from creation (None without keys).
    Double-quoted JSON strings are YAML scalars of the same value, whatever the key holds."""
    keys = {"api-key": cfg.api_key, "admin-api-key": cfg.admin_api_key}
    lines = [f"{name}: {json.dumps(value)}\n" for name, value in keys.items() if value]
    if not lines:
        return None
    if "--sglang-config" in cfg.sglang_args:
        raise BadInputError("--sglang-config with --api-key/--admin-api-key: rltool hands SGLang "
                            "its keys in a --config file of its own; put api-key and "
                            "admin-api-key in your file instead of passing them to rltool")
    path = directory / "sglang-keys.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(lines))
    return path


def passthrough(args: list[str]) -> list[str]:
    """`--sglang-foo v --sglang-bar` -> `--foo v --bar` (values and order untouched)."""
    out = []
    for arg in args:
        if arg.split("=", 1)[0] in ("--sglang-api-key", "--sglang-admin-api-key"):
            raise BadInputError(f"{arg.split('=', 1)[0]} would put the key on SGLang's command "
                                "line; use --api-key/--admin-api-key (or RLTOOL_API_KEY, "
                                "RLTOOL_ADMIN_API_KEY), which reach SGLang in a 0600 file")
        if arg.startswith("--sglang-"):
            out.append("--" + arg[len("--sglang-"):])
        elif arg.startswith("--"):
            raise BadInputError(f"unknown option {arg}; pass SGLang's options as --sglang-<name>")
        else:
            out.append(arg)
    return out


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
    if log_path is None:
        log_path = Path(cfg.ready_file).with_suffix(".sglang.log") if cfg.ready_file else \
            Path(f"sglang-{port}.log")
    key_dir = Path(tempfile.mkdtemp(prefix="rltool-sglang-"))  # mode 0700
    try:
        cmd = sglang_command(cfg, port=port, key_file=write_key_file(cfg, key_dir))
        _supervise(cfg, cmd, url=api.url_of(cfg.host, port), log_path=log_path,
                   on_healthy=lambda: shutil.rmtree(key_dir, ignore_errors=True))
    finally:
        shutil.rmtree(key_dir, ignore_errors=True)


def _supervise(cfg: ServeConfig, cmd: list[str], *, url: str, log_path: Path,
               on_healthy: Callable[[], None]) -> None:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    log.info("starting %s (log %s)", " ".join(cmd), log_path)
    # SGLang forks its scheduler and detokenizer processes: stop ends the whole group.
    child = start(cmd, log_path=log_path, name="sglang server", term_group=True)
    try:
        child.wait_healthy(url, api.HEALTH, timeout_s=cfg.health_timeout_s, api_key=cfg.api_key)
        on_healthy()  # SGLang has read its key file at start-up
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
