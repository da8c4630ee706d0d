"""Block-FP8 quantization: math against a float64 reference written here, and whole checkpoints."""

from __future__ import annotations

import bisect
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from rltool.cli import main
from rltool.convert import fp8, fp8_native
from rltool.errors import BadInputError, CheckpointError


def _e4m3_grid() -> list[float]:
    """Every finite non-negative float8_e4m3fn value, from the format definition (bias 7, 3 mantissa
    bits, subnormals, S.1111.111 is NaN so the top value is 1.75 * 2**8 = 448)."""
    values = set()
    for exp in range(16):
        for man in range(8):
            if exp == 15 and man == 7:
                continue
            values.add(man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return sorted(values)


GRID = _e4m3_grid()


def _round_e4m3(x: float) -> float:
    """Round to nearest e4m3 value, ties to the even mantissa, saturating at 448."""
    sign = -1.0 if x < 0 else 1.0
    a = min(abs(x), 448.0)
    i = bisect.bisect_left(GRID, a)
    if i < len(GRID) and GRID[i] == a:
        return sign * a
    lo, hi = GRID[i - 1], GRID[i]
    if a - lo < hi - lo - (a - lo):
        return sign * lo
    if a - lo > hi - a:
        return sign * hi
    return sign * (lo if GRID.index(lo) % 2 == 0 else hi)


def _reference_quantize(w: np.ndarray, block: tuple[int, int]):
    """Plain loops: per block fp32 scale = max(|w|, 1e-12) / 448, q = round_e4m3(w / scale)."""
    n, k = w.shape
    nb, kb = math.ceil(n / block[0]), math.ceil(k / block[1])
    scale = np.zeros((nb, kb), dtype=np.float32)
    q = np.zeros((n, k), dtype=np.float64)
    for bi in range(nb):
        for bj in range(kb):
            amax = 0.0
            for i in range(bi * block[0], min(n, (bi + 1) * block[0])):
                for j in range(bj * block[1], min(k, (bj + 1) * block[1])):
                    amax = max(amax, abs(float(w[i, j])))
            s = np.float32(max(amax, 1e-12)) / np.float32(448.0)
            scale[bi, bj] = s
            for i in range(bi * block[0], min(n, (bi + 1) * block[0])):
                for j in range(bj * block[1], min(k, (bj + 1) * block[1])):
                    q[i, j] = _round_e4m3(float(np.float32(w[i, j]) / s))
    return q, scale


# The implementations: the native kernel (csrc/fp8.c), the torch one (the fallback) and its
# whole-tensor form (the one a GPU runs, checked here on CPU).
IMPLEMENTATIONS = {"native": fp8_native.quantize, "torch": fp8.quantize_blocks_torch,
                   "torch-whole": fp8.quantize_blocks_whole}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape,block", [((5, 7), (2, 3)), ((64, 128), (128, 128)),
                                         ((130, 70), (64, 32)), ((4, 4), (4, 4))])
def test_quantize_matches_float64_reference(shape, block, impl):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.05
    w[0, 0] = 3.0  # an outlier drives one block's scale
    q, scale = IMPLEMENTATIONS[impl](w.to(torch.bfloat16), block)
    q_ref, scale_ref = _reference_quantize(w.to(torch.bfloat16).float().numpy(), block)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_ref.shape
    np.testing.assert_array_equal(scale.numpy(), scale_ref)
    np.testing.assert_array_equal(q.double().numpy(), q_ref)
    deq = fp8.dequantize_blocks(q, scale, block, dtype=torch.float64)  # torch (fp64 output)
    deq32 = fp8.dequantize_blocks(q, scale, block, dtype=torch.float32)  # native when built
    for i in range(shape[0]):
        for j in range(shape[1]):
            # dequantization multiplies in fp32, as the loaders do
            expect = float(np.float32(q_ref[i, j]) * scale_ref[i // block[0], j // block[1]])
            assert float(deq[i, j]) == expect and float(deq32[i, j]) == expect


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_zero_blocks_and_odd_shapes_give_no_nan(impl):
    w = torch.zeros(3, 5)
    w[2, 4] = -1.0  # only the second column-block of the second row-block is non-zero
    w_before = w.clone()
    q, scale = IMPLEMENTATIONS[impl](w, (2, 3))
    assert torch.equal(w, w_before), "an fp32 input must not be modified in place"
    assert not torch.isnan(q.float()).any() and not torch.isnan(scale).any()
    assert scale[0, 0].item() == pytest.approx(1e-12 / 448, rel=1e-6)
    assert scale[1, 1].item() == pytest.approx(1 / 448, rel=1e-6)
    assert q.float()[2, 4].item() == -448.0
    assert (q.float().flatten()[:-1] == 0).all()
    torch.testing.assert_close(fp8.dequantize_blocks(q, scale, (2, 3), dtype=torch.float32), w)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from rltool.data.models import init_model

    return init_model(tmp_path_factory.mktemp("fp8") / "qwen3-bf16", arch="qwen3", preset="tiny",
                      dtype="bfloat16", seed=3)


def _read_all(directory):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for name, fname in index["weight_map"].items():
        with safe_open(str(directory / fname), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return index, out


def test_checkpoint_quantize_then_dequant(bf16_model, tmp_path):
    cfg = fp8.Fp8Config(hf=bf16_model, out=tmp_path / "q", block=(32, 64), workers=2, verify=True,
                        max_shard_mb=0.05)
    result = fp8.quantize_checkpoint(cfg)
    index, tensors = _read_all(tmp_path / "q")
    _, src = _read_all_single(bf16_model)
    assert len(result["files"]) > 1, "max_shard_mb=0.05 must split the tiny model into shards"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in tensors.values())
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [32, 64]
    assert "lm_head" in qc["modules_to_not_convert"]
    assert "model.embed_tokens" in qc["modules_to_not_convert"]
    expect_quantized = {n for n, w in src.items()
                        if w.dim() == 2 and "embed" not in n and "lm_head" not in n}
    assert {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn} == expect_quantized
    for name, w in src.items():
        if name in expect_quantized:
            q_ref, scale_ref = _reference_quantize(w.float().numpy(), (32, 64))
            np.testing.assert_array_equal(tensors[name + "_scale_inv"].numpy(), scale_ref)
            np.testing.assert_array_equal(tensors[name].double().numpy(), q_ref)
            assert result["relative_error"][name] < 0.05
        else:
            assert torch.equal(tensors[name], w), name  # norms, embeddings, lm_head untouched
    assert any("norm" in n for n in src) and result["quantized"] == 14
    assert (tmp_path / "q" / "tokenizer.json").exists()

    fp8.dequantize_checkpoint(fp8.DequantConfig(hf=tmp_path / "q", out=tmp_path / "d",
                                                dtype="float32"))
    _, back = _read_all_single(tmp_path / "d")
    assert set(back) == set(src)
    for name, w in src.items():
        if name in expect_quantized:
            q_ref, scale_ref = _reference_quantize(w.float().numpy(), (32, 64))
            expect = q_ref * np.kron(scale_ref.astype(np.float64), np.ones((32, 64)))[
                :w.shape[0], :w.shape[1]]
            np.testing.assert_allclose(back[name].double().numpy(), expect, rtol=1e-6, atol=0)
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())


def _read_all_single(directory):
    """Read a checkpoint with the official reader, index or not."""
    if (directory / "model.safetensors.index.json").exists():
        return _read_all(directory)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return None, {name: f.get_tensor(name) for name in f.keys()}


def test_refuses_bad_inputs_without_output(bf16_model, tmp_path):
    q = tmp_path / "q"
    fp8.quantize_checkpoint(fp8.Fp8Config(hf=bf16_model, out=q, workers=1))
    with pytest.raises(BadInputError, match="already quantized"):
        fp8.quantize_checkpoint(fp8.Fp8Config(hf=q, out=tmp_path / "qq"))
    with pytest.raises(BadInputError, match="not a block-FP8"):
        fp8.dequantize_checkpoint(fp8.DequantConfig(hf=bf16_model, out=tmp_path / "dd"))
    # A mis-shaped scale: rewrite one scale tensor with the wrong shape.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(q / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(3, 3)
    save_file(tensors, str(q / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.weight_scale_inv is F32"):
        fp8.dequantize_checkpoint(fp8.DequantConfig(hf=q, out=tmp_path / "bad"))
    assert not (tmp_path / "bad").exists() and not (tmp_path / "qq").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # no leftover temporaries


def test_cli_fp8_verify_and_dequant(bf16_model, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["convert", "fp8", "--hf", str(bf16_model), "--out",
                               str(tmp_path / "q"), "--block", "16", "16", "--verify", "-q"])
    assert res.exit_code == 0, res.output
    assert "max relative error" in res.stdout and "self_attn.q_proj.weight" in res.stdout
    res = runner.invoke(main, ["convert", "dequant", "--hf", str(tmp_path / "q"), "--out",
                               str(tmp_path / "d"), "--json", "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["out"] == str(tmp_path / "d")
    res = runner.invoke(main, ["convert", "fp8", "--hf", str(bf16_model), "--out",
                               str(tmp_path / "q")])
    assert res.exit_code == 2 and "already exists" in res.output
    res = runner.invoke(main, ["convert", "fp8", "--hf", str(bf16_model), "--out",
                               str(tmp_path / "z"), "--block", "0", "128"])
    assert res.exit_code == 2 and "--block" in res.output


def test_direct_writer_output_matches_plain_writes(tmp_path):
    """O_DIRECT staging (aligned chunks, padded tail, truncate) writes exactly the bytes given,
    across chunk boundaries and odd sizes (plain writes where the filesystem lacks O_DIRECT)."""
    from rltool.io.writer import DirectWriter

    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (8, 5000, 1, 20000, 4096,
                                                                          12345)]
    path = tmp_path / "out.bin"
    w = DirectWriter(path, chunk_bytes=8192)
    for p in pieces:
        w.write(memoryview(p))
    w.close()
    assert path.read_bytes() == b"".join(pieces)
