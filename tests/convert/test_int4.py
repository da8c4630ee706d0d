"""INT4 (W4A16, compressed-tensors pack-quantized): packing against the documented bit layout, the
quantization math against a reference written here, compressed-tensors' own pack/unpack and
decompression, whole checkpoints and the CLI's refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from rltool.cli import main
from rltool.convert import int4
from rltool.errors import BadInputError


def _reference_pack_rows(values: np.ndarray) -> np.ndarray:
    """The documented layout with plain loops: value v of column 8i + j stored as code v + 8 at
    bits 4j..4j+3 of word i (zero-padded), read back as a signed int32."""
    rows, cols = values.shape
    words = -(-cols // 8)
    out = np.zeros((rows, words), dtype=np.int64)
    for r in range(rows):
        for c in range(cols):
            out[r, c // 8] |= (int(values[r, c]) + 8) << (4 * (c % 8))
    return np.where(out >= 2**31, out - 2**32, out).astype(np.int32)


@pytest.mark.parametrize("shape", [(3, 16), (5, 13), (1, 1), (8, 40)])
def test_pack_unpack_round_trip_and_layout(shape):
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    packed = int4.pack_int4(q)
    assert packed.dtype == torch.int32
    np.testing.assert_array_equal(packed.numpy(), _reference_pack_rows(q.numpy()))
    assert torch.equal(int4.unpack_int4(packed, shape[1]), q)
    # along the rows (zero points): the same layout on the transpose
    packed0 = int4.pack_int4(q, dim=0)
    np.testing.assert_array_equal(packed0.numpy(), _reference_pack_rows(q.numpy().T).T)
    assert torch.equal(int4.unpack_int4(packed0, shape[0], dim=0), q)


def _reference_quantize(w: np.ndarray, group: int, symmetric: bool):
    """float32 numpy reference of the documented math (fp32 weights, so fp32 scales)."""
    n, k = w.shape
    q = np.zeros((n, k), dtype=np.int64)
    scale = np.zeros((n, k // group), dtype=np.float32)
    zp = np.zeros((n, k // group), dtype=np.int64)
    eps = np.finfo(np.float32).eps
    for r in range(n):
        for j in range(k // group):
            x = w[r, j * group:(j + 1) * group].astype(np.float32)
            if symmetric:
                s = np.float32(np.max(np.abs(x)) / np.float32(7.5))
            else:
                lo, hi = np.float32(min(x.min(), 0)), np.float32(max(x.max(), 0))
                s = np.float32(np.float32(hi - lo) / np.float32(15))
            s = np.float32(eps) if s == 0 else s
            z = 0 if symmetric else int(np.round(np.clip(np.float32(-8 - lo / s), -8, 7)))
            scale[r, j], zp[r, j] = s, z
            v = np.float32(x / s) if symmetric else np.float32(np.float32(x / s) + np.float32(z))
            q[r, j * group:(j + 1) * group] = np.clip(np.round(v), -8, 7)
    return q, scale, zp


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_matches_reference_and_dequantizes(symmetric):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(12, 64, generator=g)
    w[0, :16] = 0.0  # an all-zero group: scale eps, codes 0 after dequantization
    w[1, 16:32] = torch.linspace(0.1, 2.0, 16)  # all positive: lo = 0
    t = int4.quantize_int4(w, group_size=16, symmetric=symmetric)
    q_ref, s_ref, zp_ref = _reference_quantize(w.numpy(), 16, symmetric)
    np.testing.assert_array_equal(int4.unpack_int4(t.packed, 64).numpy(), q_ref)
    np.testing.assert_array_equal(t.scale.numpy(), s_ref)
    if symmetric:
        assert t.zero_point is None
    else:
        np.testing.assert_array_equal(int4.unpack_int4(t.zero_point, 12, dim=0).numpy(), zp_ref)
    deq = int4.dequantize_int4(t, dtype=torch.float32).double().numpy()
    expect = ((q_ref - np.repeat(zp_ref, 16, axis=1)).astype(np.float32)
              * np.repeat(s_ref, 16, axis=1))  # one float32 product
    np.testing.assert_array_equal(deq, expect.astype(np.float64))
    assert not deq[0, :16].any()
    assert np.linalg.norm(deq - w.numpy()) / np.linalg.norm(w.numpy()) < 0.15


def test_non_finite_weight_is_refused():
    w = torch.ones(2, 8)
    w[1, 3] = float("nan")
    with pytest.raises(Exception, match="inf or NaN"):
        int4.quantize_int4(w, group_size=8, symmetric=True)


@pytest.mark.parametrize("symmetric", [True, False])
def test_matches_compressed_tensors(symmetric):
    """compressed-tensors' own pack/unpack, compression and decompression agree bit for bit."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import (pack_to_int32,
                                                                       unpack_from_int32)
    from compressed_tensors.quantization import QuantizationConfig

    g = torch.Generator().manual_seed(11)
    q = torch.randint(-8, 8, (9, 24), generator=g, dtype=torch.int8)
    assert torch.equal(pack_to_int32(q, 4), int4.pack_int4(q))
    assert torch.equal(pack_to_int32(q, 4, packed_dim=0), int4.pack_int4(q, dim=0))
    assert torch.equal(unpack_from_int32(int4.pack_int4(q), 4, torch.Size(q.shape)), q)

    fmt = int4.Int4Format(group_size=32, symmetric=symmetric, ignore=("lm_head",))
    config = QuantizationConfig.model_validate(fmt.quantization_config())
    assert config.format == "pack-quantized" and config.ignore == ["lm_head"]
    scheme = config.config_groups["group_0"]
    assert (scheme.weights.num_bits, scheme.weights.group_size, scheme.weights.symmetric,
            scheme.weights.strategy) == (4, 32, symmetric, "group")
    assert scheme.input_activations is None

    w = torch.randn(16, 96, generator=g).to(torch.bfloat16)
    t = int4.quantize_int4(w, group_size=32, symmetric=symmetric)
    stored = {k.removeprefix("m."): v for k, v in t.tensors("m.weight").items()}
    assert stored["weight_shape"].dtype == torch.int64
    decompressed = PackedQuantizationCompressor.decompress(dict(stored), scheme)
    assert torch.equal(decompressed["weight"], int4.dequantize_int4(t, dtype=torch.bfloat16))

    # compressing our scales and zero points (fp32 weights) gives our codes
    w32 = torch.randn(16, 96, generator=g)
    t32 = int4.quantize_int4(w32, group_size=32, symmetric=symmetric)
    state = {"weight": w32, "weight_scale": t32.scale}
    if not symmetric:
        state["weight_zero_point"] = int4.unpack_int4(t32.zero_point, 16, dim=0)
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    assert torch.equal(compressed["weight_packed"], t32.packed)
    if not symmetric:
        assert torch.equal(compressed["weight_zero_point"], t32.zero_point)


def test_ignore_patterns_follow_compressed_tensors_rules():
    fmt = int4.Int4Format(group_size=8, symmetric=True, ignore=int4.MOE_IGNORE)
    assert fmt.quantizes("model.layers.0.mlp.experts.3.down_proj.weight", (8, 8))
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.mlp.shared_experts.up_proj.weight", "lm_head.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert not fmt.quantizes(name, (8, 8)), name
    assert not fmt.quantizes("model.layers.0.input_layernorm.weight", (8,))
    dense = int4.Int4Format(group_size=8, symmetric=True, ignore=int4.DENSE_IGNORE)
    assert dense.quantizes("model.layers.0.self_attn.o_proj.weight", (8, 8))
    assert not dense.quantizes("model.embed_tokens.weight", (8, 8))  # an embedding, not linear
    assert not dense.quantizes("lm_head.weight", (8, 8))
    exact = int4.Int4Format(group_size=8, symmetric=True, ignore=("layers.0.mlp",))
    assert exact.quantizes("layers.0.mlp.up_proj.weight", (8, 8))  # exact names, not prefixes
    with pytest.raises(BadInputError, match="unknown pattern syntax"):
        int4.check_patterns(["*norm*"])
    with pytest.raises(BadInputError, match="not a valid regular expression"):
        int4.check_patterns(["re:(("])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from rltool.data.models import init_model

    root = tmp_path_factory.mktemp("int4")
    return {arch: init_model(root / arch, arch=arch, preset="tiny", dtype="bfloat16", seed=3)
            for arch in ("qwen3", "qwen3_moe")}


def _read(directory):
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({n: sf.get_tensor(n) for n in sf.keys()})
    return out


@pytest.mark.parametrize("arch,symmetric", [("qwen3", True), ("qwen3_moe", False)])
def test_checkpoint_layout_defaults_and_dequant(models, tmp_path, arch, symmetric):
    runner = CliRunner()
    out = tmp_path / "q"
    args = ["convert", "int4", "--hf", str(models[arch]), "--out", str(out), "--group-size", "16",
            "--json", "-q", "--symmetric" if symmetric else "--asymmetric"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    src, got = _read(models[arch]), _read(out)
    if arch == "qwen3":  # dense: every linear but lm_head
        want = {n for n, t in src.items() if t.dim() == 2 and "embed" not in n
                and n != "lm_head.weight"}
    else:  # MoE, slime's list: the routed experts only (router, attention, norms stay)
        want = {n for n in src if ".mlp.experts." in n}
    assert json.loads(res.stdout)["quantized"] == len(want) > 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fmt = int4.read_format(qc, where="test")
    assert (fmt.group_size, fmt.symmetric) == (16, symmetric)
    assert fmt.ignore == (int4.DENSE_IGNORE if arch == "qwen3" else int4.MOE_IGNORE)
    for name, w in src.items():
        if name not in want:
            assert torch.equal(got[name], w) and got[name].dtype == w.dtype, name
            continue
        p = name.removesuffix("weight")
        assert name not in got
        assert got[p + "weight_packed"].shape == (w.shape[0], w.shape[1] // 8)
        assert got[p + "weight_scale"].dtype == torch.bfloat16
        assert got[p + "weight_shape"].tolist() == list(w.shape)
        assert (p + "weight_zero_point" in got) == (not symmetric)
        ref = int4.quantize_int4(w, group_size=16, symmetric=symmetric)
        assert torch.equal(got[p + "weight_packed"], ref.packed)
    assert any("norm" in n for n in src) and all(n in got for n in src if "norm" in n)

    res = runner.invoke(main, ["convert", "dequant", "--hf", str(out), "--out",
                               str(tmp_path / "d"), "-q"])
    assert res.exit_code == 0, res.output
    back = _read(tmp_path / "d")
    assert set(back) == set(src)
    for name in want:
        ref = int4.quantize_int4(src[name], group_size=16, symmetric=symmetric)
        assert torch.equal(back[name], int4.dequantize_int4(ref, dtype=torch.bfloat16)), name
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())


def test_cli_refuses_bad_input_and_writes_nothing(models, tmp_path):
    runner = CliRunner()
    hf = str(models["qwen3"])
    cases = [
        (["--group-size", "48"], "not a multiple of --group-size 48"),
        (["--ignore", "*norm*"], "unknown pattern syntax"),
        (["--ignore", "re:(("], "not a valid regular expression"),
        (["--group-size", "0"], "--group-size"),
    ]
    for extra, message in cases:
        res = runner.invoke(main, ["convert", "int4", "--hf", hf, "--out", str(tmp_path / "x"),
                                   *extra])
        assert res.exit_code == 2 and message in res.output, (extra, res.output)
        assert len(res.output.strip().splitlines()) == 1, res.output
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "taken").mkdir()
    res = runner.invoke(main, ["convert", "int4", "--hf", hf, "--out", str(tmp_path / "taken")])
    assert res.exit_code == 2 and "already exists" in res.output
    assert list((tmp_path / "taken").iterdir()) == []
    res = runner.invoke(main, ["convert", "int4", "--hf", hf, "--out", str(tmp_path / "q"), "-q"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["convert", "int4", "--hf", str(tmp_path / "q"), "--out",
                               str(tmp_path / "qq")])
    assert res.exit_code == 2 and "already quantized" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "taken"]
