"""`rltool env serve`'s app: the episode protocol, its limits and guards, and the remote client
driving a live server."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from rltool.env.config import EnvServeConfig
from rltool.env.server import EnvService, build_app

KEY = {"Authorization": "Bearer k"}
pytestmark = pytest.mark.timeout(60)


def client(env="guess", **kw):
    cfg = EnvServeConfig(env=env, api_key="k", **kw)
    service = EnvService(cfg)
    return TestClient(build_app(service), base_url="http://127.0.0.1"), service


def test_an_episode_of_guess_over_http():
    c, _ = client()
    opened = c.post("/episodes", json={"seed": 3, "task": {"label": "10"}}, headers=KEY).json()
    assert opened["messages"][0]["role"] == "user"
    eid = opened["episode_id"]
    step = lambda text: c.post(f"/episodes/{eid}/step", headers=KEY,
                               json={"action": {"role": "assistant", "content": text}}).json()
    assert step("32") == {"observation": [{"role": "user", "content": "lower."}], "reward": 0.1,
                          "done": False, "info": {}}
    assert step("40")["reward"] == 0.0  # outside the range the hints allow
    assert step("10")["done"] is True
    assert c.post(f"/episodes/{eid}/verify", headers=KEY).json() == {"reward": None}
    assert c.delete(f"/episodes/{eid}", headers=KEY).json() == {"closed": True}
    assert c.delete(f"/episodes/{eid}", headers=KEY).status_code == 404


def test_key_host_and_body_are_checked():
    c, _ = client()
    assert c.get("/health").status_code == 200  # open, like the engine's
    assert c.get("/info").status_code == 401
    assert c.post("/episodes", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/info", headers={**KEY, "Host": "evil.example"}).status_code == 421
    assert c.post("/episodes", content="{}", headers={**KEY, "Content-Type": "text/plain"}
                  ).status_code == 415
    r = c.post("/episodes", content="not json", headers={**KEY, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert c.post("/episodes", json={"seed": "x"}, headers=KEY).status_code == 400
    assert c.post("/episodes/nope/step", json={"action": {"content": "1"}},
                  headers=KEY).status_code == 404


def test_episode_limit_answers_429_until_one_closes():
    c, service = client(max_episodes=2)
    ids = [c.post("/episodes", json={}, headers=KEY).json()["episode_id"] for _ in range(2)]
    r = c.post("/episodes", json={}, headers=KEY)
    assert r.status_code == 429 and "--max-episodes" in r.json()["error"]["message"]
    c.delete(f"/episodes/{ids[0]}", headers=KEY)
    assert c.post("/episodes", json={}, headers=KEY).status_code == 200
    assert service.info()["open_episodes"] == 2


@pytest.mark.parametrize("env, status, words", [("tests.env.envs:Slow", 504, "took more than"),
                                                ("tests.env.envs:Crashing", 500, "boom")])
def test_a_slow_or_crashing_step_closes_its_episode(env, status, words):
    c, service = client(env, step_timeout_s=0.3)
    eid = c.post("/episodes", json={}, headers=KEY).json()["episode_id"]
    r = c.post(f"/episodes/{eid}/step", json={"action": {"content": "x"}}, headers=KEY)
    assert r.status_code == status and words in r.json()["error"]["message"]
    assert service.info()["open_episodes"] == 0
    assert c.post(f"/episodes/{eid}/step", json={"action": {"content": "x"}},
                  headers=KEY).status_code == 404


def test_remote_environment_drives_a_live_server(tmp_path):
    from rltool.env.base import EnvError
    from rltool.env.remote import RemoteEnvClient
    from rltool.supervisor import start

    ready = tmp_path / "ready.json"
    import sys

    child = start([sys.executable, "-m", "rltool", "env", "serve", "--env", "guess", "--port",
                   "0", "--api-key", "k", "--ready-file", str(ready)],
                  log_path=tmp_path / "env.log", name="env")
    try:
        url = child.wait_ready_file(ready, timeout_s=60)["url"]
        remote = RemoteEnvClient(url, api_key="k", timeout_s=5)
        assert remote.info()["env"] == "guess"
        env = remote.episode()
        env.reset(seed=0, task={"label": "5"})
        assert env.step({"content": "9"}).observation == [{"role": "user", "content": "lower."}]
        assert env.step({"content": "5"}).done
        env.close()
        with pytest.raises(EnvError, match="401"):
            RemoteEnvClient(url, api_key="wrong").info()
    finally:
        child.stop()
    assert not ready.exists()  # withdrawn on SIGTERM
