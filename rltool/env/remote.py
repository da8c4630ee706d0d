"""The client of `rltool env serve`: a remote environment behind the Environment interface, so
the rollout drives it like a local one (`rltool rollout --env http://HOST:PORT`)."""

from __future__ import annotations

from typing import Any

from rltool.env.base import EnvError, EnvTimeoutError, Environment, Message, StepResult

# Beyond the server's own step timeout, how long the client waits for its answer.
GRACE_S = 5.0


class RemoteEnvClient:
    """One HTTP client (thread-safe, kept alive) for all episodes of a server."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s + GRACE_S)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            r = self.http.request(method, path, json=body)
        except httpx.TimeoutException as e:
            raise EnvTimeoutError(f"{self.url}{path} did not answer in time ({e})") from e
        except httpx.HTTPError as e:
            raise EnvError(f"cannot reach the environment server {self.url} ({e}); is "
                           "`rltool env serve` running there?") from e
        if r.status_code == 200:
            return r.json()
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        if r.status_code == 401:
            raise EnvError(f"{self.url} refused the key (401): pass the server's --api-key as "
                           "--env-api-key")
        error = EnvTimeoutError if r.status_code == 504 else EnvError
        raise error(f"{self.url}{path} answered {r.status_code}: {message}")

    def info(self) -> dict[str, Any]:
        return self.request("GET", "/info")

    def episode(self) -> "RemoteEnvironment":
        return RemoteEnvironment(self)

    def close(self) -> None:
        self.http.close()


class RemoteEnvironment(Environment):
    """One episode on the server: opened by reset, closed by close."""

    def __init__(self, client: RemoteEnvClient):
        self.client = client
        self.episode_id: str | None = None

    def reset(self, *, seed: int, task: dict[str, Any]) -> list[Message]:
        answer = self.client.request("POST", "/episodes", {"seed": seed, "task": task})
        self.episode_id = answer["episode_id"]
        return answer["messages"]

    def step(self, action: dict[str, Any]) -> StepResult:
        answer = self.client.request("POST", f"/episodes/{self._id()}/step", {"action": action})
        return StepResult.from_json(answer, where=f"{self.client.url} step")

    def verify(self) -> float | None:
        reward = self.client.request("POST", f"/episodes/{self._id()}/verify", {})["reward"]
        return None if reward is None else float(reward)

    def close(self) -> None:
        if self.episode_id is not None:
            eid, self.episode_id = self.episode_id, None
            try:
                self.client.request("DELETE", f"/episodes/{eid}")
            except EnvError:
                pass  # already closed by the server (a failed or timed-out call)

    def _id(self) -> str:
        if self.episode_id is None:
            raise EnvError("the remote episode is not open (reset first)")
        return self.episode_id
