"""`rltool env list` and `rltool env serve` bad input, through CliRunner."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rltool.cli import main


def test_env_list_shows_the_builtins():
    result = CliRunner().invoke(main, ["env", "list"])
    assert result.exit_code == 0
    names = [line.split()[0] for line in result.output.splitlines()]
    assert names == ["calculator", "guess", "python"]
    rows = json.loads(CliRunner().invoke(main, ["env", "list", "--json"]).output)
    assert {r["name"]: r["stop"] for r in rows} == {"calculator": ["</calc>"], "guess": [],
                                                     "python": ["</python>"]}


def test_env_serve_refuses_bad_input(tmp_path):
    cases = [
        (["--env", "nope"], "neither a built-in environment"),
        (["--env", "no.such.module:Env"], "cannot import no.such.module"),
        (["--env", "json:dumps"], "is not an environment class"),
        (["--env", "guess", "--host", "0.0.0.0"], "give --api-key KEY"),
        (["--env", "guess", "--max-episodes", "0"], "--max-episodes"),
    ]
    for args, words in cases:
        ready = tmp_path / "ready.json"
        result = CliRunner().invoke(main, ["env", "serve", *args, "--port", "0",
                                           "--ready-file", str(ready)])
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert not ready.exists()


def test_rollout_env_bad_input_writes_nothing(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    base = ["rollout", "--engines", "http://127.0.0.1:9", "--prompts", str(prompts),
            "--out", str(tmp_path / "out"), "--max-response-len", "8",
            "--rollout-batch-size", "1"]
    cases = [
        (["--env", "nope"], 2, "neither a built-in environment"),
        (["--env", "guess", "--reward", "exact"], 2, "--reward and --env exclude each other"),
        (["--env", "guess", "--generate-fn", "m:f", ], 2, "--generate-fn and --env exclude"),
        (["--env", "guess", "--partial"], 2, "--partial cannot carry --env episodes"),
        (["--env", "http://127.0.0.1:9"], 3, "cannot reach the environment server"),
    ]
    for args, code, words in cases:
        result = CliRunner().invoke(main, [*base, *args])
        assert result.exit_code == code, (args, result.output)
        assert words in result.output, (args, result.output)
        assert not (tmp_path / "out").exists()
