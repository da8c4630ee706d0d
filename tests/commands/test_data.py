"""`rltool data make` and `rltool data list`."""

from __future__ import annotations

import json

from click.testing import CliRunner

from rltool.cli import main
from rltool.data.tasks import TASKS


def test_data_list():
    result = CliRunner().invoke(main, ["data", "list"])
    assert result.exit_code == 0
    for name, task in TASKS.items():
        assert name in result.output and task.description in result.output
    result = CliRunner().invoke(main, ["data", "list", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {n: t.description for n, t in TASKS.items()}


def test_data_make_writes_jsonl(tmp_path):
    out = tmp_path / "prompts.jsonl"
    result = CliRunner().invoke(main, ["data", "make", "--task", "reverse", "--num", "50", "--seed",
                                       "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote 50 reverse prompts to {out}" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 50 and len({r["prompt_id"] for r in rows}) == 50
    for r in rows:
        assert set(r) == {"prompt_id", "prompt", "label", "metadata"}
        digits = r["prompt"].removeprefix("reverse ")
        assert r["label"] == digits[::-1] and 2 <= len(digits) <= 5 and digits.isdigit()
        assert r["metadata"] == {"task": "reverse"}
    # deterministic per seed, different across seeds
    again = tmp_path / "again.jsonl"
    CliRunner().invoke(main, ["data", "make", "--task", "reverse", "--num", "50", "--seed", "1",
                              "--out", str(again)])
    assert again.read_text() == out.read_text()
    other = tmp_path / "other.jsonl"
    CliRunner().invoke(main, ["data", "make", "--task", "reverse", "--num", "50", "--seed", "2",
                              "--out", str(other)])
    assert other.read_text() != out.read_text()


def test_data_make_json_and_lengths(tmp_path):
    out = tmp_path / "add.jsonl"
    result = CliRunner().invoke(main, ["data", "make", "--task", "add", "--num", "20", "--min-len",
                                       "3", "--max-len", "3", "--out", str(out), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"path": str(out), "rows": 20, "task": "add"}
    for r in map(json.loads, out.read_text().splitlines()):
        a, b = r["prompt"].removesuffix("=").split("+")
        assert int(a) + int(b) == int(r["label"])


def test_data_make_bad_input_writes_nothing(tmp_path):
    """Bug: `--min-len 0` was silently replaced by the task default (`0 or default`)."""
    out = tmp_path / "p.jsonl"
    for args, match in [(["--task", "nope", "--num", "3"], "unknown task 'nope'"),
                        (["--task", "sort", "--num", "0"], "--num (in [data]): Input should be greater than 0"),
                        (["--task", "sort"], "--num (in [data]): Field required"),
                        (["--task", "sort", "--num", "3", "--min-len", "0"], "--min-len"),
                        (["--task", "sort", "--num", "3", "--min-len", "6", "--max-len", "2"],
                         "need 1 <= --min-len <= --max-len")]:
        result = CliRunner().invoke(main, ["data", "make", *args, "--out", str(out)])
        assert result.exit_code == 2, args
        assert match in result.output
    assert list(tmp_path.iterdir()) == []


def test_data_make_config_file_and_flag_override(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[data]\ntask = "sort"\nnum = 7\nseed = 3\n[train]\nlr = 1e-5\n')
    out = tmp_path / "p.jsonl"
    result = CliRunner().invoke(main, ["data", "make", "--config", str(cfg), "--num", "4",
                                       "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"path": str(out), "rows": 4, "task": "sort"}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == [f"sort-3-{i}" for i in range(4)]
    cfg.write_text('[data]\ntask = "sort"\nnum = 7\nnmu = 3\n')
    result = CliRunner().invoke(main, ["data", "make", "--config", str(cfg), "--out",
                                       str(tmp_path / "q.jsonl")])
    assert result.exit_code == 2 and "unknown key 'nmu'" in result.output
    assert not (tmp_path / "q.jsonl").exists()


def test_data_make_to_stdout(tmp_path):
    result = CliRunner().invoke(main, ["data", "make", "--task", "copy", "--num", "3", "--out", "-"])
    assert result.exit_code == 0
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["label"] for r in rows] == [r["prompt"].removeprefix("copy ") for r in rows]
    assert len(rows) == 3 and result.stderr == ""
    result = CliRunner().invoke(main, ["data", "make", "--task", "copy", "--num", "3", "--out", "-",
                                       "--json"])
    assert result.exit_code == 2 and "both write to stdout" in result.output
