"""`rltool serve --engine sglang` hands SGLang its keys in a 0600 `--config` file, never on its
command line or in a log."""

from __future__ import annotations

import json
import os
import stat
import textwrap

import httpx
import pytest
import yaml

from rltool.engine.config import ServeConfig
from rltool.errors import BadInputError
from rltool.rollout.launch import start_engine
from rltool.rollout.sglang_server import sglang_command, write_key_file
from tests.rollout.test_sglang_server import SGLANG_OPTIONS_FILE

USER, ADMIN = 'user "key" \\ 1: #x', "admin-key-6d1f0b"

# A stand-in sglang.launch_server that reads its --config file as SGLang does (YAML, keys as
# option names) and records what it got, then serves the builtin engine.
STANDIN = textwrap.dedent("""
    import json, os, sys
    import yaml
    from rltool.cli import main
    args = sys.argv[1:]
    get = lambda flag: args[args.index(flag) + 1]
    with open(get("--config")) as f:
        config = yaml.safe_load(f)
    with open(os.environ["STANDIN_RECORD"], "w") as f:
        json.dump({"argv": args, "config": config, "config_file": get("--config")}, f)
    os.environ["RLTOOL_API_KEY"] = config["api-key"]
    os.environ["RLTOOL_ADMIN_API_KEY"] = config["admin-api-key"]
    main(["serve", "--engine", "builtin", "--model", get("--model-path"), "--host", get("--host"),
          "--port", get("--port"), "--log-level", "debug"])
""")


def test_keys_go_in_a_0600_file_not_on_the_command_line(tiny_model_dir, tmp_path):
    """Bug: the launcher put --api-key/--admin-api-key on SGLang's command line (readable in
    /proc/PID/cmdline by every local user) and logged that command line."""
    cfg = ServeConfig(engine="sglang", model=tiny_model_dir, api_key=USER, admin_api_key=ADMIN)
    path = write_key_file(cfg, tmp_path)
    assert path is not None and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {"api-key": USER, "admin-api-key": ADMIN}
    cmd = sglang_command(cfg, port=30000, key_file=path)
    assert cmd[cmd.index("--config") + 1] == str(path)
    assert not any(USER in a or ADMIN in a for a in cmd)
    assert "--config" in json.loads(SGLANG_OPTIONS_FILE.read_text())["options"]
    assert write_key_file(ServeConfig(engine="sglang", model=tiny_model_dir), tmp_path) is None


@pytest.mark.parametrize(("args", "message"), [
    (["--sglang-api-key", "k"], "on SGLang's command line"),
    (["--sglang-admin-api-key=k"], "on SGLang's command line"),
])
def test_a_key_passed_through_to_sglang_is_refused(tiny_model_dir, args, message):
    cfg = ServeConfig(engine="sglang", model=tiny_model_dir, sglang_args=args)
    with pytest.raises(BadInputError, match=message):
        sglang_command(cfg, port=30000)


def test_own_sglang_config_with_rltool_keys_is_refused(tiny_model_dir, tmp_path):
    cfg = ServeConfig(engine="sglang", model=tiny_model_dir, api_key=USER,
                      sglang_args=["--sglang-config", "mine.yaml"])
    with pytest.raises(BadInputError, match="put api-key and admin-api-key in your file"):
        write_key_file(cfg, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_sglang_gets_its_keys_from_the_file_and_no_log_holds_them(tiny_model_dir, tmp_path):
    pkg = tmp_path / "standin" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(STANDIN)
    record = tmp_path / "record.json"
    env = dict(os.environ, RLTOOL_API_KEY=USER, RLTOOL_ADMIN_API_KEY=ADMIN,
               STANDIN_RECORD=str(record),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "standin"),
                                           os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "serve.log"
    proc = start_engine(["--engine", "sglang", "--model", str(tiny_model_dir),
                         "--health-timeout-s", "120", "--log-level", "debug"],
                        log_path=log, env=env, ready_timeout_s=180)
    try:
        got = json.loads(record.read_text())
        assert got["config"] == {"api-key": USER, "admin-api-key": ADMIN}
        assert not os.path.exists(got["config_file"])  # removed once SGLang was healthy
        assert httpx.get(proc.url + "/get_model_info", timeout=30).status_code == 401
        assert httpx.get(proc.url + "/get_model_info", timeout=30, headers={
            "Authorization": f"Bearer {USER}"}).status_code == 200
    finally:
        proc.stop(15)
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
    assert "sglang.launch_server" in logs  # the launcher logged SGLang's command line
    assert USER not in logs and ADMIN not in logs
    assert not any(USER in a or ADMIN in a for a in got["argv"] + proc.cmdline)
