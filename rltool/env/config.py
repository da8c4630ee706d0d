"""`rltool env serve`'s config."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, model_validator

from rltool.config import StageConfig, cli


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class EnvServeConfig(StageConfig):
    """Serve one environment over HTTP: an episode per client session."""

    env: str = Field(description="The environment: a built-in name (rltool env list) or "
                     "module:Class.")
    host: str = Field("127.0.0.1", description="Address to bind (loopback by default).")
    port: int = Field(8300, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    api_key: str | None = Field(None, description="Bearer key every route but /health needs.",
                                json_schema_extra=cli(envvar="RLTOOL_ENV_API_KEY"))
    max_episodes: int = Field(64, ge=1, description="Most episodes open at once; more get 429.")
    workers: int = Field(8, ge=1, description="Threads that run environment calls (reset, "
                         "step, verify) at once.")
    step_timeout_s: float = Field(60.0, gt=0, description="Timeout of one environment call; "
                                  "the episode is closed and the call answers 504.")
    episode_ttl_s: float = Field(900.0, gt=0, description="An episode idle this long is "
                                 "closed.")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest request body.")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names (besides "
                                     "the bound address and localhost) clients may use.")
    ready_file: Path | None = Field(None, description="Written atomically with {url, pid} once "
                                    "the server answers.")
    log_level: str = Field("warning", description="uvicorn's log level.")

    @model_validator(mode="after")
    def _key_off_loopback(self) -> "EnvServeConfig":
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"--host {self.host} accepts connections from other machines; "
                             "give --api-key KEY (or RLTOOL_ENV_API_KEY) so only your rollout "
                             "can open episodes, or bind 127.0.0.1")
        return self
