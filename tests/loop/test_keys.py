"""Which server gets which key: teachers never get the engines' keys, a gateway and the workers it
names never get the admin key unless allowed, and the run's config.toml keeps no key."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer

import httpx
import pytest

from rltool.data.tasks import make_rows, write_prompts
from rltool.errors import BadInputError, ConfigError
from rltool.loop import runner
from rltool.loop.config import LoopSettings
from rltool.loop.external import check_engines
from rltool.rollout import stage
from rltool.rundir import RunDir
from tests.loop.test_config import tables
from tests.loop.test_external import _NoPullEngine

USER, ADMIN, TEACHER = "user-key-5e1f", "admin-key-9c2d", "teacher-key-77ab"


class _Recorder(_NoPullEngine):
    """Records every request's Authorization header; forwards it, without the header, to
    `self.server.upstream` when set (a teacher in front of a real engine), else answers like a
    healthy engine or gateway from `self.server.answers` (path -> JSON)."""

    def _handle(self) -> None:
        server = self.server
        server.seen.append((self.command, self.path, self.headers.get("Authorization")))
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if server.upstream is not None:
            r = httpx.request(self.command, server.upstream + self.path, content=body,
                              headers={"content-type": "application/json"}, timeout=120)
            self._answer(r.status_code, r.json())
        elif self.command == "OPTIONS":
            self._answer(405, {})  # every route exists
        else:
            self._answer(200, server.answers.get(self.path, {}))

    do_GET = do_POST = do_OPTIONS = _handle


@contextmanager
def recorder(upstream: str | None = None, answers: dict | None = None) -> Iterator:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen, server.upstream, server.answers = [], upstream, answers or {}
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _keys(server) -> set:
    return {auth for _, _, auth in server.seen}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(make_rows("reverse", num=4, seed=0),
                         tmp_path_factory.mktemp("keys") / "prompts.jsonl")


@pytest.mark.parametrize("teacher_key", [TEACHER, None])
def test_a_teacher_never_receives_the_engines_keys(builtin_engine, tiny_model_dir, prompts,
                                                   tmp_path, teacher_key):
    """Bug: the rollout's key was [loop] api_key, else admin_api_key, and every --opd-teacher
    engine got it, so a teacher received `Bearer <admin key>`. Teachers now get
    opd_teacher_api_key (or no key) and nothing else."""
    with recorder(upstream=builtin_engine.url) as teacher:
        data = tables(tiny_model_dir, rollout__prompts=str(prompts), rollout__opd_teacher=[
            teacher.url], rollout__max_response_len=4, loop__admin_api_key=ADMIN,
            loop__opd_teacher_api_key=teacher_key)
        settings = LoopSettings.from_tables(data)
        cfg = settings.rollout_config(RunDir(tmp_path / "run"), step=0,
                                      urls=[builtin_engine.url])
        assert cfg.api_key == ADMIN  # the loop's engines may get it: they are listed
        result = stage.run(cfg)
    assert result["rows"] == 8 and "opd/reverse_kl" in result["metrics"]
    assert {p for _, p, _ in teacher.seen} >= {"/get_model_info", "/generate"}
    assert _keys(teacher) == {f"Bearer {teacher_key}" if teacher_key else None}


def test_rollout_command_sends_its_api_key_to_the_engines_only(builtin_engine, prompts, tmp_path,
                                                               monkeypatch):
    """`rltool rollout --opd-teacher`: the engines' RLTOOL_API_KEY does not reach the teacher,
    RLTOOL_OPD_TEACHER_API_KEY does, and neither is in the shard's resolved config."""
    from click.testing import CliRunner

    from rltool.cli import main

    out = tmp_path / "rollouts" / "step-000000"
    with recorder(upstream=builtin_engine.url) as teacher:
        result = CliRunner(env={"RLTOOL_API_KEY": USER, "RLTOOL_OPD_TEACHER_API_KEY": TEACHER}
                           ).invoke(main, [
                               "rollout", "--engines", builtin_engine.url, "--prompts",
                               str(prompts), "--reward", "reverse", "--n-samples-per-prompt", "2",
                               "--rollout-batch-size", "2", "--max-response-len", "4",
                               "--out", str(out), "-q", "--opd-teacher", teacher.url])
    assert result.exit_code == 0, result.output
    assert _keys(teacher) == {f"Bearer {TEACHER}"}
    for path in out.rglob("*"):
        if path.is_file():
            raw = path.read_bytes()
            assert USER.encode() not in raw and TEACHER.encode() not in raw, path


def test_gateway_worker_off_the_allow_list_never_receives_the_admin_key(tiny_model_dir,
                                                                         tmp_path):
    """Bug: the workers an smg gateway lists at /v1/rl/workers were trusted, so a gateway trusted
    with the ordinary key could name any server and the loop sent it the admin key. A worker on
    a host [loop] admin_key_hosts does not name is now refused before any request reaches it,
    and nothing is written; the gateway itself never gets the admin key."""
    with recorder() as worker, recorder() as gateway:
        gateway.answers = {"/v1/rl/workers": {"workers": [{"url": worker.url}]}}
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"prompt": "q", "label": "a"}\n')
        data = tables(tiny_model_dir, rollout__prompts=str(prompts),
                      loop__router_url=gateway.url, loop__api_key=USER,
                      loop__admin_api_key=ADMIN)
        with pytest.raises(BadInputError, match=r"admin_key_hosts does not name.*add \"127"):
            runner.start(LoopSettings.from_tables(data), tmp_path / "run")
        assert not (tmp_path / "run").exists()
        assert worker.seen == []
        assert _keys(gateway) == {f"Bearer {USER}"}
        cfg = LoopSettings.from_tables(data).rollout_config(RunDir(tmp_path / "run"), step=0,
                                                           urls=[worker.url])
        assert cfg.router == gateway.url and cfg.api_key == USER
        del data["loop"]["api_key"]  # a gateway never gets the admin key in its place
        cfg = LoopSettings.from_tables(data).rollout_config(RunDir(tmp_path / "run"), step=0,
                                                           urls=[worker.url])
        assert cfg.api_key is None

        # Listed, the worker is the loop's to drive: it gets the admin key (the check can see it).
        port = worker.url.rsplit(":", 1)[1]
        for allowed in (["127.0.0.1"], [f"127.0.0.1:{port}"]):
            data["loop"]["admin_key_hosts"] = allowed
            urls = check_engines(RunDir(tmp_path / "run"), LoopSettings.from_tables(data),
                                 mode="disk")
            assert urls == [worker.url] and _keys(worker) == {f"Bearer {ADMIN}"}
        data["loop"]["admin_key_hosts"] = ["127.0.0.1:1"]  # another port of the host
        with pytest.raises(BadInputError, match="admin_key_hosts"):
            check_engines(RunDir(tmp_path / "run"), LoopSettings.from_tables(data), mode="disk")
        assert not (tmp_path / "run").exists()


def test_engine_args_keys_move_into_the_loop_and_stay_out_of_the_saved_config(tiny_model_dir):
    """Bug: RUN/config.toml kept [rollout] api_key and the keys inside engine_args verbatim.
    Keys in engine_args now become the loop's engine keys (handed over by environment), and no
    table of the saved config keeps a key."""
    data = tables(tiny_model_dir, rollout__api_key=USER, rollout__opd_teacher_api_key=TEACHER,
                  eval__prompts="e.jsonl", eval__api_key=USER,
                  loop__engine_args=["--max-running-requests", "8", "--api-key", USER,
                                     f"--admin-api-key={ADMIN}"])
    settings = LoopSettings.from_tables(data)
    assert (settings.loop.api_key, settings.loop.admin_api_key) == (USER, ADMIN)
    assert settings.loop.engine_args == ["--max-running-requests", "8"]
    saved = settings.to_tables()
    text = json.dumps(saved)
    assert USER not in text and ADMIN not in text and TEACHER not in text
    assert "api_key" not in text and "api-key" not in text
    again = LoopSettings.from_tables(saved)  # the saved config is a valid config
    assert again.loop.engine_args == settings.loop.engine_args


@pytest.mark.parametrize(("loop", "message"), [
    ({"engine_args": ["--api-key", "a"], "api_key": "b"}, "two different keys"),
    ({"engine_args": ["--api-key"]}, "needs a value"),
    ({"engine_args": ["--engine", "sglang", "--sglang-api-key", "a"]}, "on a command line"),
    ({"admin_key_hosts": ["127.0.0.1"]}, "needs router_url"),
])
def test_key_settings_that_would_leak_or_clash_are_refused(tiny_model_dir, loop, message):
    data = tables(tiny_model_dir)
    data["loop"].update(loop)
    with pytest.raises(ConfigError, match=message) as err:
        LoopSettings.from_tables(data)
    assert "\n" not in str(err.value)  # one line
