"""Serving block-FP8 checkpoints (what `rltool convert fp8` writes) with the builtin engine on CPU:
dequantized at load, bit for bit what serving the checkpoint `rltool convert dequant` writes gives;
modules_to_not_convert honoured; missing, mis-shaped or orphan scales and unsupported
quantization_configs refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rltool.convert.fp8 import (DequantConfig, Fp8Config, dequantize_blocks,
                                dequantize_checkpoint, quantize_checkpoint)
from rltool.engine.paged_runner import PagedRunner
from tests.engine.test_loading import assert_one_line_bad_input, serve

SEQ = [3, 9, 4, 17, 22, 5, 8, 30, 11, 2, 7, 19]


@pytest.fixture(scope="module")
def fp8_dirs(tiny_model_factory, tmp_path_factory):
    """(fp8 checkpoint, its dequantization in fp32, in bf16) per (arch, block)."""
    cache = {}

    def make(arch: str, block: tuple[int, int]):
        if (arch, block) not in cache:
            root = tmp_path_factory.mktemp(f"fp8-{arch}")
            quantize_checkpoint(Fp8Config(hf=tiny_model_factory(arch, 0), out=root / "fp8",
                                          block=block, workers=1))
            for dtype in ("fp32", "bf16"):
                dequantize_checkpoint(DequantConfig(hf=root / "fp8", out=root / dtype,
                                                    dtype=dtype, workers=1))
            cache[arch, block] = root
        return cache[arch, block]

    return make


def runner(path, dtype="fp32"):
    return PagedRunner(path, device="cpu", dtype=dtype, max_running=4, page_size=4,
                       max_total_tokens=256)


def served_logits(r: PagedRunner) -> list[torch.Tensor]:
    """Logits of one full pass, a chunked paged prefill, and three decode steps."""
    out = [r.full_pass_logits(SEQ, start=1)]
    r.prefill([("a", SEQ[:5], 0)], want=[False])
    out.append(r.prefill([("b", SEQ[2:9], 0), ("a", SEQ[5:9], 5)], want=[True, True]))
    for t in SEQ[9:]:
        out.append(r.decode(["a", "b"], [t, t]))
    r.remove("a")
    r.remove("b")
    return out


@pytest.mark.parametrize("arch,block,dtype", [("qwen2", (16, 16), "fp32"),
                                              ("qwen2", (128, 128), "bf16"),
                                              ("qwen3_moe", (16, 32), "fp32")])
def test_fp8_checkpoint_serves_like_its_dequantization(fp8_dirs, arch, block, dtype):
    root = fp8_dirs(arch, block)
    fp8, plain = runner(root / "fp8", dtype), runner(root / dtype, dtype)
    for a, b in zip(served_logits(fp8), served_logits(plain)):
        assert torch.equal(a, b)
    assert fp8.weight_info == {"weight_precision": "fp8", "weight_dtype": dtype, "quantization": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
        "resident": "dequantized"}}
    assert plain.weight_info == {"weight_precision": dtype, "weight_dtype": dtype,
                                 "quantization": None}
    # An FP8 update from disk into a running engine: the same bits again.
    other = runner(root / dtype, dtype)
    other.load_weights(root / "fp8")
    assert torch.equal(other.full_pass_logits(SEQ, start=1), served_logits(plain)[0])


def test_modules_to_not_convert_are_served_as_stored(fp8_dirs, tmp_path):
    """A module the config keeps unconverted is read in its dtype (here: one layer's down_proj
    stored dequantized, in fp32); one listed there but stored in FP8 is refused."""
    src = fp8_dirs("qwen2", (16, 16))
    mixed = tmp_path / "mixed"
    shutil.copytree(src / "fp8", mixed)
    tensors = load_file(mixed / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    q, s = tensors[name + ".weight"], tensors.pop(name + ".weight_scale_inv")
    tensors[name + ".weight"] = dequantize_blocks(q, s, (16, 16), dtype=torch.float32)
    save_file(tensors, mixed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mixed / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(name)
    (mixed / "config.json").write_text(json.dumps(config))
    assert torch.equal(runner(mixed).full_pass_logits(SEQ, start=1),
                       runner(src / "fp32").full_pass_logits(SEQ, start=1))

    listed = tmp_path / "listed"
    shutil.copytree(src / "fp8", listed)
    config = json.loads((listed / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append(name)
    (listed / "config.json").write_text(json.dumps(config))
    assert_one_line_bad_input(serve(listed), f"{name}.weight is FP8", "modules_to_not_convert")


@pytest.mark.parametrize("damage", ["missing", "mis_shaped", "not_f32", "orphan"])
def test_bad_scales_are_refused_in_one_line(fp8_dirs, tmp_path, damage):
    model = tmp_path / "model"
    shutil.copytree(fp8_dirs("qwen2", (16, 16)) / "fp8", model)
    tensors = load_file(model / "model.safetensors")
    scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    needles = [scale]
    if damage == "missing":
        del tensors[scale]
        needles.append("is missing, expected F32[4, 4] for block [16, 16]")
    elif damage == "mis_shaped":
        tensors[scale] = tensors[scale][:, :2].contiguous()
        needles.append("is F32[4, 2], expected F32[4, 4]")
    elif damage == "not_f32":
        tensors[scale] = tensors[scale].to(torch.bfloat16)
        needles.append("is BF16[4, 4]")
    else:
        scale = "model.norm.weight_scale_inv"
        tensors[scale] = torch.ones(1)
        needles = [scale, "scales no FP8 weight"]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_bad_input(serve(model), *needles)


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "awq", "bits": 4}, "'quant_method': 'awq'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "'activation_scheme': 'static'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "'fmt': 'e5m2'"),
    ({"quant_method": "fp8"}, "block FP8 only")])
def test_unsupported_quantization_config_is_refused_in_one_line(tiny_model_dir, tmp_path, qc,
                                                                needle):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = qc
    (model / "config.json").write_text(json.dumps(config))
    assert_one_line_bad_input(serve(model), "quantization_config", needle, "--engine sglang",
                              "convert dequant")
