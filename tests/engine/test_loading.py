"""`rltool serve --engine builtin` on a checkpoint it cannot load: exit 2 with one line."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from rltool.cli import main as cli


def serve(model_dir):
    return CliRunner().invoke(cli, ["serve", "--engine", "builtin", "--model", str(model_dir),
                                    "--port", "0"])


def assert_one_line_bad_input(result, *needles):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "internal failure" not in result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1, result.output
    for needle in needles:
        assert needle in error[0], error[0]


@pytest.mark.parametrize("damage", ["truncated_shard", "unknown_architecture", "config_not_json",
                                    "unsupported_architecture"])
def test_unloadable_checkpoint_is_one_line_bad_input(tiny_model_dir, tmp_path, damage):
    """Any other checkpoint the engine cannot load (corrupt shard, unknown model type, broken
    config.json) is exit 2 with the reason in one line, not a traceback. An architecture that
    transformers knows but the engine's own model definition does not (gpt2) is refused the same
    way, on CPU as on CUDA, naming the supported families and the other engine."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    if damage == "truncated_shard":
        shard = model / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:100])
        needle = "model.safetensors is not a readable safetensors file"
    elif damage == "unknown_architecture":
        (model / "config.json").write_text('{"model_type": "no-such-arch"}')
        needle = "no-such-arch"
    elif damage == "config_not_json":
        (model / "config.json").write_text("{not json")
        needle = "not valid JSON"
    else:
        config = json.loads((model / "config.json").read_text())
        config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
        (model / "config.json").write_text(json.dumps(config))
        assert_one_line_bad_input(serve(model), "GPT2LMHeadModel", "Qwen2ForCausalLM",
                                  "Qwen3ForCausalLM", "LlamaForCausalLM", "--engine sglang")
        return
    assert_one_line_bad_input(serve(model), str(model), needle)
