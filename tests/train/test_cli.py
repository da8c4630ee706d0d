"""`rltool train` through click: success output, and bad input refused with exit 2, nothing written."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from rltool.cli import main
from tests.helpers.shards import make_shard, shard_rows


def _invoke(args):
    return CliRunner().invoke(main, ["train", *map(str, args)], catch_exceptions=False)


def test_train_json_and_config_file(tiny_model_dir, train_shard, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[train]\nlr = 0.001\nglobal_batch_size = 6\nnum_steps = 1\n"
                      "max_tokens_per_microbatch = 64\n[rollout]\nsomething = 1\n")
    result = _invoke(["--rollouts", train_shard, "--load", tiny_model_dir, "--save",
                      tmp_path / "run" / "train" / "ckpt", "--publish", tmp_path / "run" / "weights",
                      "--num-steps", 2, "--config", config, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["policy_version"] == 2 and out["optimizer_steps"] == 2
    assert out["published"].endswith("weight_v000002")
    assert out["last_metrics"]["train/lr"] == 0.001
    lines = (tmp_path / "run" / "metrics" / "train.jsonl").read_text().splitlines()
    metrics = [json.loads(x) for x in lines]  # RUN/metrics/train.jsonl when --save is RUN/train/ckpt
    assert sum("train/loss" in m for m in metrics) == 2
    assert [m["sync/mode"] for m in metrics if "sync/mode" in m] == ["full"]  # the publish line
    saved = (tmp_path / "run" / "train" / "ckpt" / "step-000002" / "config.toml").read_text()
    assert "num_steps = 2" in saved and "lr = 0.001" in saved


def _corrupt_part(shard):
    part = sorted(shard.glob("part-*.parquet"))[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))


def _bad_shards(tiny_model_dir, root):
    """name -> (shard dir, expected message fragment)."""
    out = {}
    out["tokenizer"] = (make_shard(root / "tok", tiny_model_dir, shard_rows([[1.0, 0.0]]),
                                   tok_hash="0123456789abcdef"), "tokenizer")
    out["checksum"] = (make_shard(root / "sum", tiny_model_dir, shard_rows([[1.0, 0.0]])),
                       "checksum")
    _corrupt_part(out["checksum"][0])
    out["manifest"] = (make_shard(root / "man", tiny_model_dir, shard_rows([[1.0, 0.0]])),
                       "_SUCCESS")
    (out["manifest"][0] / "_SUCCESS").unlink()
    vocab = shard_rows([[1.0, 0.0]])
    vocab[0]["response_token_ids"][0] = 999
    out["vocab"] = (make_shard(root / "voc", tiny_model_dir, vocab), "outside the model")
    no_temp = make_shard(root / "temp", tiny_model_dir, shard_rows([[1.0, 0.0]]))
    part = sorted(no_temp.glob("part-*.parquet"))[0]
    table = pq.read_table(part)
    meta = {k: v for k, v in table.schema.metadata.items()}
    meta[b"rltool.sampling"] = b"{}"
    pq.write_table(table.replace_schema_metadata(meta), part)
    # Re-checksum so the only defect is the missing temperature.
    from rltool.data.shards import file_xxh3_128

    manifest = json.loads((no_temp / "_SUCCESS").read_text())
    manifest["parts"][0]["xxh3_128"] = file_xxh3_128(part)
    (no_temp / "_SUCCESS").write_text(json.dumps(manifest))
    out["temperature"] = (no_temp, "temperature")
    return out


@pytest.fixture(scope="module")
def bad_shards(tiny_model_dir, tmp_path_factory):
    return _bad_shards(tiny_model_dir, tmp_path_factory.mktemp("bad"))


@pytest.mark.parametrize("kind", ["tokenizer", "checksum", "manifest", "vocab", "temperature"])
def test_bad_shards_are_refused(tiny_model_dir, bad_shards, tmp_path, kind):
    shard, fragment = bad_shards[kind]
    result = _invoke(["--rollouts", shard, "--load", tiny_model_dir, "--save", tmp_path / "ckpt",
                      "--publish", tmp_path / "weights"])
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert fragment in last and last.startswith("Error: ")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "weights").exists()


@pytest.mark.parametrize("args,fragment", [
    (["--lr-decay-style", "cosine"], "--lr-decay-steps"),
    (["--kl-loss-coef", "0.1"], "--ref"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c"),
    (["--prompts", "p.jsonl"], "exclusive"),
])
def test_bad_flags_are_refused(tiny_model_dir, train_shard, args, fragment):
    result = _invoke(["--rollouts", train_shard, "--load", tiny_model_dir, *args])
    assert result.exit_code == 2 and fragment in result.stderr, result.output


@pytest.mark.parametrize("args", [["--recompute-activations"], ["--no-recompute-activations"],
                                  ["--recompute-granularity", "full"],
                                  ["--backend", "megatron", "--recompute-granularity=selective"]])
def test_retired_recompute_flags_name_recompute(tiny_model_dir, train_shard, args):
    result = _invoke(["--rollouts", train_shard, "--load", tiny_model_dir, *args])
    assert result.exit_code == 2, result.output
    assert "was replaced by --recompute " in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("key", ["recompute_activations = true",
                                 'recompute_granularity = "full"'])
def test_retired_recompute_keys_name_recompute(tiny_model_dir, train_shard, tmp_path, key):
    config = tmp_path / "run.toml"
    config.write_text(f"[train]\n{key}\n")
    result = _invoke(["--rollouts", train_shard, "--load", tiny_model_dir, "--config", config])
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: --recompute-") and "was replaced by --recompute " in last


def test_recompute_selective_is_refused_by_the_torch_backend(tiny_model_dir, train_shard):
    result = _invoke(["--rollouts", train_shard, "--load", tiny_model_dir, "--recompute",
                      "selective"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("Error: --recompute selective: the torch backend recomputes "
                                     "whole layers; use --recompute full, none or auto (or "
                                     "--backend megatron)")


def test_missing_inputs_are_refused(tiny_model_dir, tmp_path):
    assert "--load" in _invoke(["--rollouts", tmp_path]).stderr
    result = _invoke(["--rollouts", tmp_path / "nope", "--load", tiny_model_dir])
    assert result.exit_code == 2 and "no such shard" in result.stderr
    result = _invoke(["--loss", "sft", "--prompts", tmp_path / "none.jsonl", "--load",
                      tmp_path])
    assert result.exit_code == 2 and "neither a HF weights directory" in result.stderr


def test_existing_version_is_not_replaced(tiny_model_dir, train_shard, tmp_path):
    (tmp_path / "weights" / "weight_v000001").mkdir(parents=True)
    result = _invoke(["--rollouts", train_shard, "--load", tiny_model_dir, "--num-steps", 1,
                      "--publish", tmp_path / "weights", "--save", tmp_path / "ckpt"])
    assert result.exit_code == 2 and "never replaced" in result.stderr
    assert not (tmp_path / "ckpt").exists()  # refused before any training


def test_multi_process_bad_input_exits_2_before_launching(tiny_model_dir, bad_shards, tmp_path):
    shard, _ = bad_shards["tokenizer"]
    result = _invoke(["--rollouts", shard, "--load", tiny_model_dir, "--nproc-per-node", 2,
                      "--save", tmp_path / "ckpt"])
    assert result.exit_code == 2 and "tokenizer" in result.stderr
    assert not (tmp_path / "ckpt").exists()


def test_broken_checkpoints_are_refused(tiny_model_dir, train_shard, tmp_path):
    import shutil

    from rltool.train import run
    from rltool.train.config import TrainConfig

    run(TrainConfig(rollouts=[str(train_shard)], load=str(tiny_model_dir), num_steps=1,
                    save=str(tmp_path / "ckpt"), lr=1e-3))
    good = tmp_path / "ckpt" / "step-000001"
    cases = {"state": ("trainer_state.json", b"{not json", "not valid JSON"),
             "optimizer": ("optimizer.safetensors", b"\x00" * 16, "unreadable safetensors"),
             "missing": ("rng.safetensors", None, "missing rng.safetensors")}
    for name, (file, content, fragment) in cases.items():
        broken = tmp_path / name
        shutil.copytree(good, broken)
        if content is None:
            (broken / file).unlink()
        else:
            (broken / file).write_bytes(content)
        result = _invoke(["--rollouts", train_shard, "--load", broken, "--num-steps", 1,
                          "--save", tmp_path / f"out-{name}"])
        assert result.exit_code == 2, (name, result.output)
        assert fragment in result.stderr, (name, result.stderr)
        assert not (tmp_path / f"out-{name}").exists()
