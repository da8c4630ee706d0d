"""INT4 (W4A16 pack-quantized) checkpoints in the builtin engine on CPU: dequantized at load, bit
for bit the weights and logits of the checkpoint `rltool convert dequant` writes; the ignore list
honoured exactly (a quantized router or a float linear the config says is INT4 is refused); the
weight precision reported."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rltool.convert import int4
from rltool.convert.fp8 import DequantConfig
from rltool.engine.dense_model import load_model
from rltool.errors import CheckpointError

IDS = torch.tensor([3, 9, 4, 17, 22, 5, 8, 30, 11, 2])


def _logits(model):
    import torch.nn.functional as F

    pos = torch.arange(len(IDS))

    def attend(layer, q, k, v):
        model.rope_store(q, k, v, pos)
        return F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=True).transpose(0, 1)

    return model.logits(model.hidden(IDS, attend))


def _params(model):
    out = {"embed": model.embed, "lm_head": model.lm_head, "norm": model.norm}
    for i, layer in enumerate(model.layers):
        out.update({f"{i}.{k}": t for k, t in layer.items()})
    return out


@pytest.mark.parametrize("arch,symmetric,dtype", [("qwen3", True, "fp32"),
                                                  ("qwen3_moe", False, "bf16"),
                                                  ("qwen2", False, "fp32")])
def test_dequantized_at_load_equals_the_dequantized_checkpoint(tiny_model_factory, tmp_path,
                                                               arch, symmetric, dtype):
    q, d = tmp_path / "int4", tmp_path / "deq"
    int4.quantize_checkpoint(int4.Int4Config(hf=tiny_model_factory(arch, 1), out=q,
                                             group_size=16, symmetric=symmetric, workers=1))
    int4.dequantize_checkpoint(DequantConfig(hf=q, out=d, dtype=dtype, workers=1))
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    served = load_model(q, device="cpu", dtype=torch_dtype)
    reference = load_model(d, device="cpu", dtype=torch_dtype)
    assert served.fp8_keys == frozenset()
    a, b = _params(served), _params(reference)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(_logits(served), _logits(reference))
    # and the INT4 weights are not the original ones (the checkpoint really was quantized)
    original = load_model(tiny_model_factory(arch, 1), device="cpu", dtype=torch_dtype)
    assert not torch.equal(_params(original)["0.down" if arch != "qwen3_moe" else
                                             "0.experts_down"], a["0.down" if arch != "qwen3_moe"
                                                                 else "0.experts_down"])


def test_server_info_reports_int4(tiny_model_factory, tmp_path):
    from rltool.engine.paged_runner import PagedRunner

    q = tmp_path / "int4"
    int4.quantize_checkpoint(int4.Int4Config(hf=tiny_model_factory("qwen2", 0), out=q,
                                             group_size=32, workers=1))
    runner = PagedRunner(q, device="cpu", dtype="fp32", max_running=2, max_total_tokens=64)
    info = runner.weight_info  # /get_server_info spreads it into its answer
    assert info["weight_precision"] == "int4" and info["weight_dtype"] == "fp32"
    assert info["quantization"] == {"quant_method": "compressed-tensors",
                                    "format": "pack-quantized", "num_bits": 4, "group_size": 32,
                                    "symmetric": True, "resident": "dequantized"}
    plain = PagedRunner(tiny_model_factory("qwen2", 0), device="cpu", dtype="fp32",
                        max_running=2, max_total_tokens=64)
    assert plain.weight_info["weight_precision"] == "fp32"


def test_ignore_list_is_honoured_exactly(tiny_model_factory, tmp_path):
    """A checkpoint whose INT4 tensors and ignore list disagree is refused at load: a router
    stored INT4 while the list ignores it, and an expert linear stored in bf16 while the list
    says INT4."""
    q = tmp_path / "all"
    hf = tiny_model_factory("qwen3_moe", 0)
    # everything but lm_head INT4, the router (mlp.gate) included
    int4.quantize_checkpoint(int4.Int4Config(hf=hf, out=q, group_size=16, ignore=["lm_head"],
                                             workers=1))
    config_path = q / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"] = list(int4.MOE_IGNORE)  # claims the router is bf16
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.gate\.weight_packed is INT4 but "
                                              r"quantization_config\.ignore lists"):
        load_model(q, device="cpu", dtype=torch.float32)

    q2 = tmp_path / "experts"
    int4.quantize_checkpoint(int4.Int4Config(hf=hf, out=q2, group_size=16, workers=1))
    tensors = load_file(str(q2 / "model.safetensors"))
    p = "model.layers.0.mlp.experts.1.up_proj."
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
        del tensors[p + suffix]
    tensors[p + "weight"] = load_file(str(hf / "model.safetensors"))[p + "weight"]
    save_file(tensors, str(q2 / "model.safetensors"))
    with pytest.raises(CheckpointError, match="experts.1.up_proj.weight is stored as .* but "
                                              "quantization_config.ignore does not list"):
        load_model(q2, device="cpu", dtype=torch.float32)


def test_mismatched_int4_tensors_are_refused(tiny_model_factory, tmp_path):
    q = tmp_path / "int4"
    int4.quantize_checkpoint(int4.Int4Config(hf=tiny_model_factory("qwen2", 0), out=q,
                                             group_size=16, symmetric=False, workers=1))
    tensors = load_file(str(q / "model.safetensors"))
    p = "model.layers.1.self_attn.o_proj."
    tensors[p + "weight_zero_point"] = tensors[p + "weight_zero_point"][:, :1].contiguous()
    save_file(tensors, str(q / "model.safetensors"))
    with pytest.raises(CheckpointError, match="o_proj.weight_zero_point is I32"):
        load_model(q, device="cpu", dtype=torch.float32)
