"""Async HTTP client for rollout engines (builtin or SGLang, directly or behind the smg gateway).

Every call has a timeout, so a dead engine gives an error, never a hang. Transient failures
(connection errors, 429, 502, 503, 504) are retried with exponential backoff up to `max_retries`
times; any other error status raises `EngineError` with the status code; a read timeout raises
`EngineTimeoutError` (not retried: the engine may still be working on the request). The
collective weight-sync calls (`init_weights_update_group`, `update_weights_from_distributed`)
are retried only when no connection was made: a repeat after rank 0 began would wait on a
broadcast that never comes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from pathlib import Path
from typing import Any

import httpx

from rltool import trace
from rltool.engine import api
from rltool.errors import BadInputError, EngineError, EngineTimeoutError

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 502, 503, 504})
BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 4.0


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """One TLS context per process, with httpx's defaults (certifi's CA bundle, SSL_CERT_FILE /
    SSL_CERT_DIR honoured). A client built without one loads the CA bundle itself, 40-110 ms on
    the 2-core box, which the loop paid for every client of every phase of every step."""
    create = getattr(httpx, "create_ssl_context", None)
    if create is not None:
        return create()
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


class EngineClient:
    """One engine (or gateway) URL. Use as `async with EngineClient(url) as c: ...`.

    One connection pool for all its requests: `keepalive` connections stay open between
    requests (the caller's concurrency, so a steady stream of requests never reconnects; httpx
    keeps 20 by default and closes the rest), and no cap on open ones, so a control request
    such as /abort_request is never queued behind the generations it is meant to stop."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, max_retries: int = 3, keepalive: int = 20):
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=api.bearer(api_key), verify=_ssl_context(),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=keepalive))

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, json: Any = None,
                       params: dict[str, Any] | None = None,
                       headers: dict[str, str] | None = None,
                       timeout_s: float | None = None, once: bool = False) -> httpx.Response:
        """`once`: the request must not reach the engine twice (a collective call: a repeat after
        rank 0 began would wait on a broadcast that never comes): retried only when the
        connection could not be made, never after an answer or a dropped connection."""
        extra: dict[str, Any] = {}
        if timeout_s is not None:
            extra["timeout"] = timeout_s
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, path, json=json, params=params,
                                                     headers=headers, **extra)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
                sent = isinstance(e, httpx.RemoteProtocolError)
                if attempt >= self.max_retries or (once and sent):
                    raise EngineError(f"{method} {self.url}{path}: cannot reach the engine "
                                      f"({type(e).__name__}: {e})") from e
                reason = type(e).__name__
            except httpx.TimeoutException as e:
                raise EngineTimeoutError(f"{method} {self.url}{path}: no answer within the "
                                         f"timeout ({type(e).__name__})") from e
            except httpx.HTTPError as e:
                raise EngineError(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from e
            else:
                if response.status_code < 400:
                    return response
                if (response.status_code not in RETRY_STATUS or attempt >= self.max_retries
                        or once):
                    raise EngineError(f"{method} {self.url}{path} answered "
                                      f"{response.status_code}: {_error_message(response)}",
                                      status_code=response.status_code)
                reason = f"HTTP {response.status_code}"
            delay = min(BACKOFF_BASE_S * 2 ** attempt, BACKOFF_MAX_S)
            log.warning("%s %s%s failed (%s); retry %d/%d in %.2fs", method, self.url, path,
                        reason, attempt + 1, self.max_retries, delay)
            attempt += 1
            await asyncio.sleep(delay)

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self._request(method, path, **kwargs)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    # ----- generation --------------------------------------------------------------------

    async def generate(self, payload: dict[str, Any], *,
                       routing_key: str | None = None) -> dict[str, Any] | list[dict[str, Any]]:
        """POST /generate. A batch or n > 1 returns a list (SGLang's shape)."""
        headers = {api.ROUTING_KEY_HEADER: routing_key} if routing_key else None
        with trace.span("generate", cat="request", engine=self.url) as event:
            out = await self._json("POST", api.GENERATE, json=payload, headers=headers)
            event.update(token_counts(out))
            return out

    # ----- health and info ---------------------------------------------------------------

    async def health(self) -> bool:
        """True when /health answers 2xx; False when it answers otherwise or cannot be reached."""
        try:
            await self._request("GET", api.HEALTH)
        except EngineError:
            return False
        return True

    async def health_generate(self) -> None:
        """GET /health_generate (really generates one token); raises EngineError if unhealthy."""
        await self._request("GET", api.HEALTH_GENERATE)

    async def has_route(self, path: str) -> bool:
        """Whether the engine serves `path`, asked without side effects: an OPTIONS request is
        405 on a route that exists (no route handles OPTIONS) and 404 on one that does not."""
        try:
            await self._request("OPTIONS", path)
        except EngineError as e:
            if e.status_code == 404:
                return False
            if e.status_code != 405:
                raise
        return True

    async def get_json(self, path: str) -> Any:
        """GET a path outside the engine API (a gateway's own routes); the decoded answer."""
        return await self._json("GET", path)

    async def get_model_info(self) -> dict[str, Any]:
        return await self._json("GET", api.MODEL_INFO)

    async def get_server_info(self) -> dict[str, Any]:
        return await self._json("GET", api.SERVER_INFO)

    # ----- scheduling and cache ----------------------------------------------------------

    async def flush_cache(self) -> None:
        await self._request("POST", api.FLUSH_CACHE)

    async def abort_request(self, *, rid: str = "", abort_all: bool = False) -> None:
        await self._request("POST", api.ABORT_REQUEST,
                            json=api.AbortInput(rid=rid, abort_all=abort_all).body())

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._request("POST", api.PAUSE_GENERATION, json=api.PauseInput(mode=mode).body())

    async def continue_generation(self) -> None:
        await self._request("POST", api.CONTINUE_GENERATION, json=api.ContinueInput().body())

    # ----- weights and memory ------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> dict[str, Any]:
        """Load a HF checkpoint directory; raises EngineError (status 400) when the engine refuses.
        Returns the answer as a dict (`api.UpdateWeightsResult`'s fields)."""
        body = api.UpdateWeightsFromDiskInput(model_path=model_path, weight_version=weight_version,
                                              abort_all_requests=abort_all_requests,
                                              flush_cache=flush_cache)
        answer = await self._json("POST", api.UPDATE_WEIGHTS_FROM_DISK, json=body.body())
        return api.UpdateWeightsResult.model_validate(answer).model_dump()

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], *,
                                         load_format: str | None = api.SHM_FORMAT,
                                         weight_version: str | None = None,
                                         abort_all_requests: bool = False,
                                         flush_cache: bool = True,
                                         lora_config: dict[str, Any] | None = None
                                         ) -> dict[str, Any]:
        """Load named tensors handed over in memory (for the builtin engine: one JSON
        `api.TensorMessage` per rank, rltool.delta.tensor_sync); raises EngineError (400) when
        the engine refuses them. `lora_config`: LoRA tensors' adapter config (its scale)."""
        body = api.UpdateWeightsFromTensorInput(
            serialized_named_tensors=serialized_named_tensors, load_format=load_format,
            weight_version=weight_version, abort_all_requests=abort_all_requests,
            flush_cache=flush_cache, lora_config=lora_config)
        answer = await self._json("POST", api.UPDATE_WEIGHTS_FROM_TENSOR, json=body.body())
        return api.UpdateWeightsResult.model_validate(answer).model_dump()

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group",
                                        backend: str = "gloo",
                                        timeout_s: float = api.DEFAULT_SYNC_TIMEOUT_S
                                        ) -> dict[str, Any]:
        """Make the engine join a process group as rank `rank_offset`; the trainer (rank 0) must
        join at the same time (the call returns once everyone has). The builtin engine answers
        504 once `timeout_s` has passed; it is sent only when it is not the default, so the
        body stays SGLang's."""
        body = api.InitWeightsUpdateGroupInput(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend, timeout_s=timeout_s)
        answer = await self._json("POST", api.INIT_WEIGHTS_UPDATE_GROUP, json=body.body(),
                                  once=True)
        return api.UpdateWeightsResult.model_validate(answer).model_dump()

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: str | None = None,
                                              abort_all_requests: bool = False,
                                              flush_cache: bool = True,
                                              lora_config: dict[str, Any] | None = None
                                              ) -> dict[str, Any]:
        """Announce the tensors rank 0 broadcasts next over `group_name` (in this order); the
        caller broadcasts them while this call is in flight."""
        body = api.UpdateWeightsFromDistributedInput(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
            weight_version=weight_version, abort_all_requests=abort_all_requests,
            flush_cache=flush_cache, lora_config=lora_config)
        answer = await self._json("POST", api.UPDATE_WEIGHTS_FROM_DISTRIBUTED, json=body.body(),
                                  once=True)
        return api.UpdateWeightsResult.model_validate(answer).model_dump()

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._request("POST", api.RELEASE_MEMORY, json=api.MemoryInput(tags=tags).body())

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._request("POST", api.RESUME_MEMORY, json=api.MemoryInput(tags=tags).body())

    async def pull_weights(self, *, local_checkpoint_dir: str, source_dir: str,
                           target_version: int) -> dict[str, Any]:
        """slime's /pull_weights: sync a version's files; follow with update_weights_from_disk.
        Returns the answer as a dict (`api.PullWeightsResult`'s fields)."""
        body = api.PullWeightsInput(local_checkpoint_dir=local_checkpoint_dir,
                                    source_dir=source_dir, target_version=target_version)
        answer = await self._json("POST", api.PULL_WEIGHTS, json=body.body())
        return api.PullWeightsResult.model_validate(answer).model_dump(exclude_none=True)


def token_counts(response: Any) -> dict[str, int]:
    """Prompt, completion and cached tokens of a /generate response (summed over a batch), for
    the request's trace event."""
    counts = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for item in response if isinstance(response, list) else [response]:
        meta = item.get("meta_info", {}) if isinstance(item, dict) else {}
        for key in counts:
            value = meta.get(key)
            counts[key] += value if isinstance(value, int) else 0
    return counts


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("message"))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(body)[:500]


def engine_model_infos(urls: list[str], *, api_key: str | None, clients: dict[str, Any] | None
                       ) -> dict[str, dict[str, Any] | Exception]:
    """Each engine's /get_model_info (or the exception asking raised), by URL; `clients`: the
    caller's open clients by URL instead of new HTTP clients."""
    async def ask(url: str) -> dict[str, Any]:
        if clients is not None:
            return await clients[url].get_model_info()
        client = EngineClient(url, api_key=api_key, timeout_s=30.0)
        try:
            return await client.get_model_info()
        finally:
            await client.aclose()

    async def ask_all() -> list[dict[str, Any] | Exception]:
        return await asyncio.gather(*(ask(url) for url in urls), return_exceptions=True)

    return dict(zip(urls, asyncio.run(ask_all())))


def tokenizer_path_of(infos: dict[str, dict[str, Any] | Exception]) -> str:
    """The tokenizer directory the first engine that answered reports."""
    answered = [(url, info) for url, info in infos.items() if not isinstance(info, Exception)]
    if not answered:
        raise next(iter(infos.values()))
    url, info = answered[0]
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path or not Path(path).is_dir():
        raise BadInputError(f"engine {url} reports tokenizer_path {path!r}, which is not a local "
                            "directory; pass --tokenizer DIR")
    return str(path)
