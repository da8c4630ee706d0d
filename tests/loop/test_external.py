"""External engines in the loop: builtin engines started outside it (with API and admin keys),
driven directly (`engine_urls`) and behind the real smg gateway (`router_url`); the loop syncs
them, leaves them running, and refuses engines that lack a route the run needs."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from rltool.data.tasks import make_rows, write_prompts
from rltool.errors import BadInputError, ConfigError, EngineError
from rltool.loop import runner
from rltool.loop.config import LoopSettings
from rltool.loop.external import check_engines
from rltool.rollout.launch import start_engine
from rltool.rundir import RunDir, read_metrics
from rltool.supervisor import free_port, start

API_KEY, ADMIN_KEY = "user-key", "admin-key"


def tables(model: Path, root: Path, **loop) -> dict:
    write_prompts(make_rows("reverse", num=8, seed=1), root / "rl.jsonl")
    return {"model": {"path": str(model)},
            "rollout": {"prompts": str(root / "rl.jsonl"), "reward": "reverse:partial",
                        "n_samples_per_prompt": 2, "rollout_batch_size": 2,
                        "max_response_len": 4},
            "train": {"lr": 1e-2, "global_batch_size": 4},
            "sync": {"sync": "full"},
            "loop": {"num_steps": 1, **loop}}


@pytest.mark.parametrize(("loop", "sync", "message"), [
    ({"engine_urls": ["http://a:1"], "router_url": "http://g:1"}, "full", "not both"),
    ({"engine_urls": ["http://a:1"], "num_engines": 2}, "full", "num_engines"),
    ({"router_url": "http://g:1", "engine_args": ["--dtype", "bf16"]}, "full", "engine_args"),
    ({"engine_urls": ["http://a:1"]}, "tensor", "external engines take"),
])
def test_external_engines_config_is_refused_when_inconsistent(tiny_model_dir, tmp_path, loop,
                                                              sync, message):
    data = tables(tiny_model_dir, tmp_path, **loop)
    data["sync"]["sync"] = sync
    with pytest.raises(ConfigError, match=message):
        LoopSettings.from_tables(data)


def test_ray_launcher_refuses_in_memory_sync_and_external_engines(tiny_model_dir, tmp_path):
    data = tables(tiny_model_dir, tmp_path, launcher="ray")
    data["sync"]["sync"] = "tensor"
    with pytest.raises(ConfigError, match="not available with --launcher ray"):
        LoopSettings.from_tables(data)
    with pytest.raises(ConfigError, match="take --launcher local"):
        LoopSettings.from_tables(tables(tiny_model_dir, tmp_path, launcher="ray",
                                        engine_urls=["http://a:1"]))


def test_saved_config_keeps_no_keys_and_round_trips(tiny_model_dir, tmp_path):
    data = tables(tiny_model_dir, tmp_path, engine_urls="http://a:1, http://b:2/",
                  api_key="k", admin_api_key="a")
    settings = LoopSettings.from_tables(data)
    saved = settings.to_tables()["loop"]
    assert saved["engine_urls"] == ["http://a:1", "http://b:2"]
    assert not {"api_key", "admin_api_key", "num_engines", "engine_args"} & set(saved)
    again = LoopSettings.from_tables({**data, "loop": saved})
    assert again.loop.engine_urls == settings.loop.engine_urls
    cfg = settings.rollout_config(RunDir(tmp_path / "run"), step=0, urls=["http://a:1"])
    assert cfg.api_key == "k"  # the rollout carries the engines' key
    router = LoopSettings.from_tables(tables(tiny_model_dir, tmp_path, router_url="http://g:1"))
    cfg = router.rollout_config(RunDir(tmp_path / "run"), step=0, urls=["http://worker:1"])
    assert (cfg.router, cfg.engines) == ("http://g:1", None)


class _NoPullEngine(BaseHTTPRequestHandler):
    """An engine that serves every route but /pull_weights (OPTIONS: 405 or 404)."""

    def do_GET(self):  # /health and /get_server_info
        self._answer(200, {"dtype": "float32"})

    def do_OPTIONS(self):
        self._answer(404 if self.path == "/pull_weights" else 405, {"detail": "x"})

    def _answer(self, status, body):
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


def test_delta_sync_to_an_engine_without_pull_weights_is_refused(tiny_model_dir, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoPullEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        data = tables(tiny_model_dir, tmp_path, engine_urls=[url])
        data["sync"]["sync"] = "delta"
        with pytest.raises(BadInputError, match=r"does not serve /pull_weights.*--sync delta"):
            runner.start(LoopSettings.from_tables(data), tmp_path / "run")
        assert not (tmp_path / "run").exists()  # refused before anything was written
        data["sync"]["sync"] = "full"  # what it serves is enough for full versions
        assert check_engines(RunDir(tmp_path / "run"), LoopSettings.from_tables(data),
                             mode="disk") == [url]
    finally:
        server.shutdown()


class _GatewayWithoutRl(_NoPullEngine):
    """A gateway started without --enable-rl: /health answers, /v1/rl/workers is 404."""

    def do_GET(self):
        self._answer(404 if self.path == "/v1/rl/workers" else 200, {})


def test_a_gateway_that_lists_no_workers_names_enable_rl(tiny_model_dir, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GatewayWithoutRl)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        settings = LoopSettings.from_tables(tables(tiny_model_dir, tmp_path, router_url=url))
        with pytest.raises(EngineError, match="--enable-rl"):
            runner.start(settings, tmp_path / "run")
    finally:
        server.shutdown()
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def outside_engines(tiny_model_dir, tmp_path_factory):
    """Two builtin engines started outside the loop, with keys, allowed to read the runs."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("external")

    def engine(i: int):
        return start_engine(["--engine", "builtin", "--model", str(tiny_model_dir),
                             "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
                             "--allowed-weight-root", str(root),
                             "--local-checkpoint-dir", str(root / "local"),
                             "--num-threads", "1"],
                            log_path=root / f"engine-{i}.log", ready_timeout_s=180)

    with ThreadPoolExecutor(2) as pool:  # both start at once
        futures = [pool.submit(engine, i) for i in range(2)]
    procs = [f.result() for f in futures if f.exception() is None]
    if len(procs) < len(futures):
        for proc in procs:
            proc.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    yield root, procs
    for proc in procs:
        proc.stop()


def served_version(url: str) -> str:
    return httpx.get(url + "/get_weight_version", timeout=30,
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()["weight_version"]


@pytest.mark.slow
def test_loop_drives_engines_it_did_not_start(outside_engines, tiny_model_dir):
    root, procs = outside_engines
    urls = [p.url for p in procs]
    run = root / "direct"
    data = tables(tiny_model_dir, root, engine_urls=urls, api_key=API_KEY,
                  admin_api_key=ADMIN_KEY, engine_local_dir=str(root / "local"))
    # colocated: the engines release their memory while the resident trainer trains
    data["sync"]["sync"] = "delta"
    result = runner.start(LoopSettings.from_tables(data), run)
    rows = read_metrics(RunDir(run).metrics_file("loop"))
    assert [r["step"] for r in rows] == [0] and rows[-1]["sync/mode"] == "delta"
    assert all(p.alive() for p in procs)  # not the loop's to stop
    assert RunDir(run).read_engines() == []  # never recorded as the loop's children
    assert {served_version(u) for u in urls} == {str(result["policy_version"])}


@pytest.mark.slow
def test_loop_drives_engines_behind_the_smg_gateway(outside_engines, tiny_model_dir):
    root, procs = outside_engines
    smg = shutil.which("smg", path=str(Path(sys.executable).parent))
    assert smg is not None, "the smg package (dev extra) must be installed"
    port = free_port()
    gateway = start([smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--enable-rl",
                     "--worker-urls", *[p.url for p in procs], "--api-key", API_KEY,
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                     "--log-level", "warn"], log_path=root / "smg.log", name="smg gateway")
    try:
        url = f"http://127.0.0.1:{port}"
        gateway.wait_until(lambda: _lists_workers(url, len(procs)), timeout_s=60,
                           what="listing its workers", poll_s=0.5)
        run = root / "gateway"
        data = tables(tiny_model_dir, root, router_url=url, api_key=API_KEY,
                      admin_api_key=ADMIN_KEY, admin_key_hosts=["127.0.0.1"])
        data["sync"]["sync"] = "distributed"  # the workers join the loop's gloo broadcast
        result = runner.start(LoopSettings.from_tables(data), run)
    finally:
        gateway.stop()
    rows = read_metrics(RunDir(run).metrics_file("loop"))
    assert [r["step"] for r in rows] == [0] and rows[-1]["sync/mode"] == "distributed"
    assert rows[-1]["rollout/num_samples"] == 4
    assert {served_version(p.url) for p in procs} == {str(result["policy_version"])}
    assert all(p.alive() for p in procs)


def _lists_workers(url: str, n: int) -> bool:
    try:
        r = httpx.get(url + "/v1/rl/workers", timeout=5,
                      headers={"Authorization": f"Bearer {API_KEY}"})
        return r.status_code == 200 and len(r.json()["workers"]) == n
    except httpx.HTTPError:
        return False
