"""External engines: running engines the loop drives but neither starts nor stops.

`[loop] engine_urls = [...]` names the engines; `[loop] router_url = URL` names an smg gateway
(started with `--enable-rl`) whose workers the loop reads from `/v1/rl/workers`: rollouts go
through the gateway, weight updates straight to each worker. At start the loop waits for every
engine's `/health`, asks each whether it serves the routes the run needs (an OPTIONS request:
405 on a route that exists, 404 on one that does not, no side effect) and refuses to start,
naming the engine, the route and the fix, when one is missing. It then loads version 0 from the
shared run directory, so every engine serves the run's initial weights whatever it was started
with. The admin key goes only to the listed `engine_urls`, and to gateway workers on the hosts
`[loop] admin_key_hosts` names (a worker elsewhere is refused before any request reaches it:
the gateway is trusted with the ordinary key, not with choosing who gets the admin key).
Weight updates run between `/pause_generation` (retract: other clients' requests wait
and continue on the new weights) and `/continue_generation`. The engines are never recorded in
engines.json, so neither cleanup nor `--resume` ends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rltool.engine import api
from rltool.errors import BadInputError, EngineError
from rltool.loop import lora_sync
from rltool.loop.config import LoopSettings
from rltool.loop.engines import ChildRegistry, EngineSet
from rltool.loop.keys import check_admin_key_hosts
from rltool.rollout.client import EngineClient
from rltool.rundir import RunDir

log = logging.getLogger(__name__)
PAUSE_MODE = "retract"
SMG_RL_WORKERS = "/v1/rl/workers"  # the smg gateway's worker list (its RL control plane)
HEALTH_POLL_S = 0.5


def required_routes(settings: LoopSettings, mode: str) -> dict[str, str]:
    """The routes the run needs from every engine -> what for. `mode`: the in-memory transport
    ("distributed") or "disk"."""
    routes = {api.UPDATE_WEIGHTS_FROM_DISK: "loading the run's version 0 and disk versions",
              api.PAUSE_GENERATION: "pausing generation around weight updates",
              api.CONTINUE_GENERATION: "resuming generation after weight updates"}
    if mode == "distributed":
        routes[api.INIT_WEIGHTS_UPDATE_GROUP] = "--sync distributed"
        routes[api.UPDATE_WEIGHTS_FROM_DISTRIBUTED] = "--sync distributed"
    elif settings.sync.sync in ("delta", "auto"):
        routes[api.PULL_WEIGHTS] = f"--sync {settings.sync.sync} (delta versions)"
    if settings.loop.placement == "colocated" and mode == "disk":
        routes[api.RELEASE_MEMORY] = "--placement colocated (memory released while training)"
        routes[api.RESUME_MEMORY] = "--placement colocated (memory resumed after training)"
    return routes


def _dtype(info: dict[str, Any]) -> Any:
    """The dtype an engine serves, from its /get_server_info `dtype` (fp32 when it names none)."""
    import torch

    name = str(info.get("dtype") or "").lower()
    if name in ("bf16", "bfloat16"):
        return torch.bfloat16
    if name in ("fp16", "float16", "half"):
        return torch.float16
    return torch.float32


class ExternalEngines(EngineSet):
    """EngineSet over engines the loop does not own (see the module docstring)."""

    def __init__(self, run: RunDir, registry: ChildRegistry, settings: LoopSettings, *,
                 mode: str):
        loop = settings.loop
        super().__init__(run, registry, num_engines=0, engine_args=[],
                         deterministic=loop.deterministic,
                         ready_timeout_s=loop.engine_ready_timeout_s)
        self.engine_urls = list(loop.engine_urls or [])
        self.router_url = loop.router_url
        self.api_key = loop.admin_api_key or loop.api_key
        self.gateway_key = loop.api_key  # never the admin key: see rltool.loop.keys
        self.admin_key_hosts = list(loop.admin_key_hosts)
        self.sends_admin_key = loop.admin_api_key is not None
        self.master_address = loop.sync_master_address
        if loop.engine_local_dir:
            self.local_weights = Path(loop.engine_local_dir)
        self.needs = required_routes(settings, mode)
        # LoRA adapters the engines must serve (rltool.loop.lora_sync), 0: none
        self.lora_rank = settings.train.lora_rank if lora_sync.is_adapter_run(settings) else 0
        self.control_urls: list[str] = []
        self._dtype: Any = None

    @property
    def urls(self) -> list[str]:
        return list(self.control_urls)

    @property
    def dtype(self) -> Any:
        return self._dtype

    def start(self, model_dir: Path) -> None:
        """Find and check the engines, then make them serve version 0 (`model_dir`)."""
        asyncio.run(self._connect())
        log.info("external engines %s: health and routes checked", self.control_urls)
        self.load_version(0, delta=False)

    async def _connect(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        if self.router_url is not None:
            gateway = EngineClient(self.router_url, api_key=self.gateway_key, timeout_s=60.0)
            try:
                await _wait_healthy(gateway, deadline)
                self.control_urls = await _gateway_workers(gateway)
            finally:
                await gateway.aclose()
            if not self.control_urls:
                raise EngineError(f"the gateway {self.router_url} lists no workers; add engines "
                                  "to it (smg --worker-urls) before starting the loop")
            if self.sends_admin_key:  # before any request reaches a worker
                check_admin_key_hosts(self.control_urls, allowed=self.admin_key_hosts,
                                      gateway=self.router_url)
        else:
            self.control_urls = list(self.engine_urls)
        clients = [self.client(url) for url in self.control_urls]
        try:
            await asyncio.gather(*(_wait_healthy(c, deadline) for c in clients))
            for c in clients:
                present = await asyncio.gather(*(c.has_route(r) for r in self.needs))
                missing = [r for r, ok in zip(self.needs, present) if not ok]
                if missing:
                    route = missing[0]
                    raise BadInputError(
                        f"engine {c.url} does not serve {route}, which {self.needs[route]} "
                        "needs; choose a --sync/--placement it supports (docs/loop.md, "
                        "\"External engines\") or an engine that serves it")
            infos = await asyncio.gather(*(c.get_server_info() for c in clients))
        finally:
            for c in clients:
                await c.aclose()
        if self.lora_rank:
            for c, info in zip(clients, infos):
                lora_sync.check_server_info(c.url, info, rank=self.lora_rank)
        dtypes = {_dtype(info) for info in infos}
        if len(dtypes) > 1:
            raise BadInputError("the external engines serve different dtypes "
                                f"{sorted(map(str, dtypes))}; start them with the same --dtype")
        self._dtype = dtypes.pop()

    def check_alive(self) -> None:
        async def probe() -> list[str]:
            clients = [self.client(url) for url in self.control_urls]
            try:
                ok = await asyncio.gather(*(c.health() for c in clients))
            finally:
                for c in clients:
                    await c.aclose()
            return [c.url for c, alive in zip(clients, ok) if not alive]

        dead = asyncio.run(probe())
        if dead:
            raise EngineError(f"external engine(s) {dead} do not answer /health; restart them, "
                              f"then `rltool loop --resume {self.run.root}`")

    def stop(self) -> None:
        """The engines are not the loop's: they keep running (and serving the last version)."""
        self._group = None

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        self._each(lambda c: c.pause_generation(PAUSE_MODE))
        try:
            yield
        finally:
            self._each(lambda c: c.continue_generation())

    def load_version(self, version: int, *, delta: bool) -> float:
        with self._paused():
            return super().load_version(version, delta=delta)

    def load_distributed(self, named: list[tuple[str, Any]], *, version: int,
                         bucket_bytes: int, lora_config: dict[str, Any] | None = None) -> float:
        with self._paused():
            return super().load_distributed(named, version=version, bucket_bytes=bucket_bytes,
                                            lora_config=lora_config)


async def _gateway_workers(gateway: EngineClient) -> list[str]:
    """The control URLs of the workers behind an smg gateway (`GET /v1/rl/workers`, served
    when smg runs with --enable-rl)."""
    try:
        answer = await gateway.get_json(SMG_RL_WORKERS)
    except EngineError as e:
        if e.status_code != 404:
            raise
        raise EngineError(f"{gateway.url} does not list its workers at {SMG_RL_WORKERS}; start "
                          "the smg gateway with --enable-rl, or give the engines' URLs as "
                          "[loop] engine_urls instead") from e
    workers = answer.get("workers") if isinstance(answer, dict) else None
    if not isinstance(workers, list):
        raise EngineError(f"{gateway.url}{SMG_RL_WORKERS} answered {str(answer)[:200]!r}, not "
                          "{\"workers\": [...]}")
    return [str(w.get("control_url") or w["url"]).rstrip("/") for w in workers]


def check_engines(run: RunDir, settings: LoopSettings, *, mode: str) -> list[str]:
    """Health and routes of the external engines, before the run writes anything; returns their
    control URLs."""
    engines = ExternalEngines(run, ChildRegistry(run), settings, mode=mode)
    asyncio.run(engines._connect())
    return engines.urls


async def _wait_healthy(client: Any, deadline: float) -> None:
    while not await client.health():
        if time.monotonic() > deadline:
            raise EngineError(f"{client.url} does not answer /health; start the engine (or "
                              "gateway) first, or raise [loop] engine_ready_timeout_s")
        await asyncio.sleep(HEALTH_POLL_S)
