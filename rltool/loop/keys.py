"""The loop's keys: which server gets which key, and where keys are never written.

| key ([loop], env var) | sent to |
|---|---|
| `api_key` (RLTOOL_API_KEY) | the engines' generation routes, a gateway's |
| `admin_api_key` (RLTOOL_ADMIN_API_KEY) | the engines the loop started, the `engine_urls` it was given, and gateway workers on hosts `admin_key_hosts` names; never a gateway, a teacher or a reward server |
| `opd_teacher_api_key` (RLTOOL_OPD_TEACHER_API_KEY) | the `--opd-teacher` engines only |

The engines the loop starts serve with `api_key` and `admin_api_key`, handed over in their
environment: a command line is readable by every local user (/proc/PID/cmdline) and is recorded
in engines.json and logs. `--api-key`/`--admin-api-key` in `engine_args` are taken out of them
into `[loop]` when the config is read. The run's config.toml and the stages' resolved configs
keep no key, so a resumed run takes its keys from the environment (or flags) again.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from rltool.errors import BadInputError

# engine_args flag -> the [loop] key it sets.
ENGINE_KEY_FLAGS = {"--api-key": "api_key", "--admin-api-key": "admin_api_key"}
# The environment variables `rltool serve` reads its keys from (rltool.engine.config).
ENGINE_KEY_ENV = {"api_key": "RLTOOL_API_KEY", "admin_api_key": "RLTOOL_ADMIN_API_KEY"}


def take_engine_keys(data: Any) -> Any:
    """LoopConfig input with `--api-key K`/`--admin-api-key K` (or `--api-key=K`) moved out of
    `engine_args` into `api_key`/`admin_api_key`. A key given in both places with two values, or
    a key flag SGLang would get on its command line (`--sglang-api-key`), is refused."""
    if not isinstance(data, dict) or not isinstance(data.get("engine_args"), list):
        return data
    data = dict(data)
    args, kept = [str(a) for a in data["engine_args"]], []
    while args:
        arg = args.pop(0)
        flag, eq, value = arg.partition("=")
        if flag in ENGINE_KEY_FLAGS:
            if not eq:
                if not args:
                    raise ValueError(f"engine_args: {flag} needs a value")
                value = args.pop(0)
            field = ENGINE_KEY_FLAGS[flag]
            if data.get(field) not in (None, value):
                raise ValueError(f"engine_args {flag} and [loop] {field} give two different "
                                 f"keys; give the engines' key once, as [loop] {field} (or "
                                 f"{ENGINE_KEY_ENV[field]})")
            data[field] = value
        elif flag.endswith("api-key"):
            raise ValueError(f"engine_args: {flag} would put a key on a command line; give the "
                             "engines' keys as [loop] api_key/admin_api_key (RLTOOL_API_KEY, "
                             "RLTOOL_ADMIN_API_KEY), which reach them by environment")
        else:
            kept.append(arg)
    data["engine_args"] = kept
    return data


def engine_env(*, api_key: str | None, admin_api_key: str | None) -> dict[str, str]:
    """The environment of an engine the loop starts: this process's, with the engine's keys set,
    or unset so that a key the loop itself was given by environment does not leak into an
    engine that should serve without one."""
    env = dict(os.environ)
    for field, value in (("api_key", api_key), ("admin_api_key", admin_api_key)):
        if value:
            env[ENGINE_KEY_ENV[field]] = value
        else:
            env.pop(ENGINE_KEY_ENV[field], None)
    return env


def host_port(url: str) -> tuple[str, str]:
    """(host, "host:port") of a URL, lower-cased; the port defaults by scheme."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return host, f"{host}:{port}"


def check_admin_key_hosts(workers: list[str], *, allowed: list[str], gateway: str) -> None:
    """Refuse gateway workers the admin key may not go to (BadInputError naming the first).

    A gateway is trusted with the ordinary key only; the workers it lists are its word. A worker
    receives the admin key when `allowed` (`[loop] admin_key_hosts`) names its host (any port)
    or its host:port."""
    names = {a.strip().lower() for a in allowed}
    for url in workers:
        host, both = host_port(url)
        if host not in names and both not in names:
            raise BadInputError(
                f"the gateway {gateway} lists worker {url}, which [loop] admin_key_hosts does "
                "not name, and the loop sends the admin key only to engines it was told of; if "
                f"that worker is yours, add \"{both}\" to [loop] admin_key_hosts")
