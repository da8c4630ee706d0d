"""`rltool serve --engine sglang` against a stand-in `sglang.launch_server` (it refuses options
SGLang does not have, records its argv and runs the builtin engine), and `--engine external`."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from rltool.cli import main
from rltool.errors import EngineError
from rltool.rollout.client import EngineClient
from rltool.engine.config import ServeConfig
from rltool.rollout.launch import start_engine
from rltool.rollout.sglang_server import sglang_command

# The options SGLang's launch_server accepts, with the SGLang version they were read from.
SGLANG_OPTIONS_FILE = Path(__file__).parent / "data" / "sglang-0.5.15-server-args.json"

STANDIN = textwrap.dedent("""
    import json, os, sys
    from rltool.cli import main
    args = sys.argv[1:]
    with open(os.environ["STANDIN_OPTIONS"]) as f:
        known = set(json.load(f)["options"])
    unknown = [a for a in args if a.startswith("--") and a.split("=", 1)[0] not in known]
    if unknown:  # what SGLang's argparse does with an option it does not have
        print("stand-in sglang: unrecognized arguments: " + " ".join(unknown), flush=True)
        sys.exit(2)
    with open(os.environ["STANDIN_ARGV"], "w") as f:
        json.dump({"argv": args, "pid": os.getpid()}, f)
    get = lambda flag: args[args.index(flag) + 1]
    main(["serve", "--engine", "builtin", "--model", get("--model-path"), "--host", get("--host"),
          "--port", get("--port"), "--log-level", "warning"])
""")


@pytest.fixture
def standin_env(tmp_path):
    pkg = tmp_path / "standin" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(STANDIN)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "standin"), env.get("PYTHONPATH", "")])
    env["STANDIN_ARGV"] = str(tmp_path / "argv.json")
    env["STANDIN_OPTIONS"] = str(SGLANG_OPTIONS_FILE)
    return env


def test_every_option_the_launcher_passes_exists_in_sglang(tiny_model_dir):
    known = set(json.loads(SGLANG_OPTIONS_FILE.read_text())["options"])
    cfg = ServeConfig(engine="sglang", model=tiny_model_dir, deterministic=True,
                      served_model_name="m", api_key="k", admin_api_key="a",
                      num_continuous_decode_steps=4, max_running_requests=512,
                      sglang_args=["--sglang-tp-size", "2", "--sglang-enable-mixed-chunk"])
    flags = [a for a in sglang_command(cfg, port=30000, key_file=Path("keys.yaml"))
             if a.startswith("--")]
    assert "--config" in flags and "--enable-deterministic-inference" in flags
    assert "--num-continuous-decode-steps" in flags and "--max-running-requests" in flags
    assert [f for f in flags if f not in known] == []
    # unset, SGLang sizes its decode batch itself (from its KV pool)
    unset = ServeConfig(engine="sglang", model=tiny_model_dir)
    assert unset.max_running_requests is None
    assert "--max-running-requests" not in sglang_command(unset, port=30000)


def test_sglang_launcher_reports_an_option_sglang_does_not_have(tiny_model_dir, tmp_path,
                                                                standin_env):
    """SGLang exits at start-up on an unknown option: the launcher reports its output."""
    with pytest.raises(EngineError) as err:
        start_engine(["--engine", "sglang", "--model", str(tiny_model_dir),
                      "--sglang-no-such-option", "1"],
                     log_path=tmp_path / "sglang.log", env=standin_env, ready_timeout_s=120)
    assert "unrecognized arguments: --no-such-option" in str(err.value)


@pytest.mark.slow
def test_sglang_launcher_passes_options_waits_serves_and_stops(tiny_model_dir, tmp_path,
                                                              standin_env):
    proc = start_engine(["--engine", "sglang", "--model", str(tiny_model_dir),
                         "--deterministic", "--sglang-mem-fraction-static", "0.5",
                         "--sglang-enable-mixed-chunk", "--health-timeout-s", "120"],
                        log_path=tmp_path / "sglang.log", env=standin_env)
    try:
        recorded = json.loads((tmp_path / "argv.json").read_text())
        argv = recorded["argv"]
        assert argv[argv.index("--model-path") + 1] == str(tiny_model_dir)
        assert argv[-3:] == ["--mem-fraction-static", "0.5", "--enable-mixed-chunk"]
        assert "--enable-deterministic-inference" in argv and "--dtype" in argv

        async def go():
            async with EngineClient(proc.url, timeout_s=60) as c:
                return await c.generate({"text": "ab", "sampling_params": {"max_new_tokens": 3}})

        assert asyncio.run(go())["meta_info"]["completion_tokens"] >= 1
    finally:
        code = proc.stop(15)
    assert code == 0
    child = recorded["pid"]
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_sglang_missing_fails_clearly(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    result = CliRunner().invoke(main, ["serve", "--engine", "sglang", "--model",
                                       str(tiny_model_dir)])
    assert result.exit_code == 3 and "needs the sglang package" in result.output
    bad = CliRunner().invoke(main, ["serve", "--model", str(tiny_model_dir), "--bogus"])
    assert bad.exit_code == 2 and "unknown option --bogus" in bad.output


def test_external_attaches_to_a_running_engine(builtin_engine, tmp_path):
    ready = tmp_path / "ready.json"
    result = CliRunner().invoke(main, ["serve", "--engine", "external", "--url",
                                       builtin_engine.url, "--ready-file", str(ready)])
    assert result.exit_code == 0 and builtin_engine.url in result.output
    assert json.loads(ready.read_text()) == {"url": builtin_engine.url, "pid": None}
    dead = CliRunner().invoke(main, ["serve", "--engine", "external", "--url",
                                     "http://127.0.0.1:9", "--health-timeout-s", "0.5"])
    assert dead.exit_code == 3 and "did not answer /health" in dead.output
