"""`rltool init-model`: tiny random-init checkpoints per architecture, loadable offline."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rltool.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("init-model")
    runner = CliRunner()
    out = {}
    for arch in ("qwen2", "qwen3", "llama", "qwen3_moe"):
        result = runner.invoke(main, ["init-model", "--arch", arch, "--task", "add", "--seed", "1",
                                      "--out", str(root / arch), "--json"])
        assert result.exit_code == 0, result.output
        out[arch] = (root / arch, json.loads(result.stdout))
    return out


def test_init_model_writes_a_full_checkpoint(models):
    for arch, (path, result) in models.items():
        assert result == {"path": str(path), "arch": arch, "preset": "tiny", "task": "add"}
        names = {p.name for p in path.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "rltool_version.json", "generation_config.json"} <= names
        assert not any(n.endswith(".bin") or n.endswith(".pt") for n in names)  # never pickles
        assert json.loads((path / "rltool_version.json").read_text()) == {"version": 0}
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == arch and config["rltool_task"] == "add"
        assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2


def test_checkpoints_load_offline_with_auto_classes(models):
    """AutoTokenizer/AutoModelForCausalLM load every checkpoint with the hub switched off, and
    every loader gives the same ids. Bug: a WordLevel tokenizer.json was loaded as Qwen2Tokenizer
    for qwen2 (transformers 5 forces that class), which dropped spaces and newlines."""
    import huggingface_hub.constants
    import tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert huggingface_hub.constants.HF_HUB_OFFLINE  # conftest sets HF_HUB_OFFLINE=1 first
    chat = [{"role": "user", "content": "reverse 12 a+b=(x)!"}]
    want = "<|im_start|>user\nreverse 12 a+b=(x)!<|im_end|>\n<|im_start|>assistant\n"
    all_ids = []
    for arch, (path, _) in models.items():
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path))
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == want
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        # special tokens are one id each, every other character one id
        assert len(ids) == len(text.replace("<|im_start|>", "S").replace("<|im_end|>", "E"))
        assert len(tok) == model.get_input_embeddings().weight.shape[0] < 100  # small vocabulary
        assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
        assert type(model).__name__.lower().startswith(arch.replace("_", ""))
        all_ids.append(ids)
        all_ids.append(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids)
    assert all(ids == all_ids[0] for ids in all_ids)


def test_init_model_same_seed_same_weights(tmp_path, models):
    from safetensors.numpy import load_file

    result = CliRunner().invoke(main, ["init-model", "--arch", "qwen2", "--task", "add", "--seed",
                                       "1", "--out", str(tmp_path / "again")])
    assert result.exit_code == 0 and "wrote qwen2/tiny model" in result.output
    a = load_file(str(models["qwen2"][0] / "model.safetensors"))
    b = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.parametrize("args,match", [
    (["--task", "nope"], "unknown task 'nope'"),
    (["--preset", "huge"], "unknown --preset 'huge'"),
])
def test_init_model_bad_input_changes_nothing(tmp_path, args, match):
    out = tmp_path / "m"
    result = CliRunner().invoke(main, ["init-model", *args, "--out", str(out)])
    assert result.exit_code == 2 and match in result.output
    assert list(tmp_path.iterdir()) == []


def test_init_model_refuses_existing_dir(tmp_path):
    (tmp_path / "m").mkdir()
    result = CliRunner().invoke(main, ["init-model", "--out", str(tmp_path / "m")])
    assert result.exit_code == 2 and "already exists" in result.output
    assert CliRunner().invoke(main, ["init-model", "--arch", "gpt2", "--out",
                                     str(tmp_path / "x")]).exit_code == 2


def test_init_model_config_file(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[init_model]\narch = "llama"\ntask = "sort"\nseed = 3\n'
                   '[model]\npath = "run/weights/weight_v000000"\n[rollout]\nreward = "sort"\n')
    result = CliRunner().invoke(main, ["init-model", "--config", str(cfg), "--task", "copy",
                                       "--out", str(tmp_path / "m"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["arch"] == "llama"
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["model_type"], config["rltool_task"]) == ("llama", "copy")  # the flag won
    result = CliRunner().invoke(main, ["init-model", "--config", str(cfg)])
    assert result.exit_code == 2 and "--out (in [init_model]): Field required" in result.output
    # a loop config (its [model] table names existing weights) does not confuse init-model
    cfg.write_text('[model]\npath = "w"\n[loop]\nnum_steps = 2\n')
    result = CliRunner().invoke(main, ["init-model", "--config", str(cfg), "--out",
                                       str(tmp_path / "m2")])
    assert result.exit_code == 0, result.output
