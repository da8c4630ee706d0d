"""The native FP8 kernel (csrc/fp8.c) against torch: the e4m3 cast over float32 bit patterns, and
whole quantize / dequantize calls bit for bit against the torch implementation, which
tests/convert/test_fp8.py checks against a float64 reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rltool import native
from rltool.convert import fp8, fp8_native
from rltool.errors import CheckpointError


@pytest.fixture
def use_native(monkeypatch):
    """use_native(False) sets RLTOOL_NATIVE=0 (the torch fallback, as on a host without the
    built library), use_native(True) clears it; the cached library handles are reset each time."""

    def select(enabled: bool) -> None:
        if enabled:
            monkeypatch.delenv(native.DISABLE_ENV, raising=False)
        else:
            monkeypatch.setenv(native.DISABLE_ENV, "0")
        native.load.cache_clear()
        fp8_native._lib.cache_clear()

    yield select
    native.load.cache_clear()  # monkeypatch restores the environment after this
    fp8_native._lib.cache_clear()


def test_native_library_is_built():
    """A missing build is a failure, not a skip: `pip install -e .` compiles csrc/*.c."""
    path = native.library_path()
    assert path is not None, "rltool/_native*.so is missing: run `pip install -e .` (needs gcc)"
    assert native.load() is not None and fp8_native.available()


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _bit_patterns() -> torch.Tensor:
    """float32 bit patterns: a stride-251 sweep of all 2**32 (every sign, exponent, inf and NaN),
    and, for every sign/exponent/top-3-mantissa prefix, the low 20 bits that sit on and next to
    every rounding boundary of e4m3 (normal and subnormal: ties are a single set bit)."""
    sweep = torch.arange(0, 2**32, 251, dtype=torch.int64)
    lows = {0, 0xFFFFF}
    for bit in range(20):
        lows |= {1 << bit, (1 << bit) - 1, (1 << bit) + 1, (1 << bit) | 1, (2 << bit) - 1}
    prefixes = torch.arange(4096, dtype=torch.int64) << 20
    edges = (prefixes[:, None] | torch.tensor(sorted(lows), dtype=torch.int64)[None, :]).flatten()
    return torch.cat([sweep, edges]).to(torch.int32).view(torch.float32)


def test_cast_matches_torch_on_float32_bit_patterns():
    x = _bit_patterns()
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 449.0, 463.99, 464.0, 480.0, 1e30,
                            float("inf"), -float("inf"), float("nan"), -float("nan"), 2.0**-6,
                            2.0**-9, 2.0**-10, 3 * 2.0**-10, 1e-45, -1e-45])
    for values in (x, special):
        got, want = _u8(fp8_native.cast_e4m3(values)), _u8(values.to(torch.float8_e4m3fn))
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, [(hex(int(values.view(torch.int32)[i]) & 0xFFFFFFFF),
                                int(got[i]), int(want[i])) for i in bad[:5]]


def _weights(dtype: torch.dtype, shape: tuple[int, int], kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    if kind == "outliers" and w.numel():
        w.view(-1)[torch.randint(w.numel(), (max(1, w.numel() // 500),), generator=gen)] *= 300
    elif kind == "zero":
        w = torch.zeros(shape)
        if w.numel() > 1:
            w.view(-1)[::7] = -0.0  # signed zeros stay signed
    elif kind == "tiny":  # max|w| below the 1e-12 floor: scale 1e-12/448, subnormal e4m3 codes
        w = w * (1e-11 if dtype == torch.float32 else 1e-3)
    elif kind == "huge" and dtype == torch.float32:
        w = w * 1e37
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,block", [((300, 260), (128, 128)), ((5, 7), (2, 3)),
                                         ((130, 70), (64, 32)), ((1, 1), (128, 128)),
                                         ((0, 5), (4, 4))])
def test_native_quantize_equals_torch_bit_for_bit(dtype, shape, block):
    for seed, kind in enumerate(("normal", "outliers", "zero", "tiny", "huge")):
        w = _weights(dtype, shape, kind, seed)
        q, scale = fp8_native.quantize(w, block)
        q_ref, scale_ref = fp8.quantize_blocks_torch(w, block)
        assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape, kind
        np.testing.assert_array_equal(scale.view(torch.int32).numpy(),
                                      scale_ref.view(torch.int32).numpy(), err_msg=kind)
        np.testing.assert_array_equal(_u8(q), _u8(q_ref), err_msg=kind)
        for out in (torch.float32, torch.bfloat16):
            deq = fp8_native.dequantize(q, scale, block, dtype=out)
            deq_ref = fp8.dequantize_blocks_torch(q, scale, block, dtype=out)
            assert deq.dtype == out
            np.testing.assert_array_equal(deq.view(torch.uint8).numpy(),
                                          deq_ref.view(torch.uint8).numpy(), err_msg=kind)


def test_native_propagates_non_finite_to_the_scale():
    w = torch.randn(8, 8)
    w[1, 2] = float("inf")
    w[6, 6] = float("nan")
    _, scale = fp8_native.quantize(w, (4, 4))
    assert torch.isinf(scale[0, 0]) and torch.isnan(scale[1, 1])
    assert torch.isfinite(scale[0, 1]) and torch.isfinite(scale[1, 0])


def test_kernel_declines_what_it_does_not_handle():
    """The dispatchers fall back to torch for these (fp16 output, non-CPU devices, other dtypes)."""
    q, scale = fp8_native.quantize(torch.randn(4, 4), (2, 2))
    assert fp8_native.dequantize(q, scale, (2, 2), dtype=torch.float16) is None
    assert fp8_native.quantize(torch.randn(4, 4, dtype=torch.float64), (2, 2)) is None
    deq = fp8.dequantize_blocks(q, scale, (2, 2), dtype=torch.float16)
    assert torch.equal(deq, fp8.dequantize_blocks_torch(q, scale, (2, 2), dtype=torch.float16))
    # a non-contiguous input is quantized like its contiguous copy
    w = torch.randn(6, 10, dtype=torch.bfloat16)
    assert torch.equal(_as_u8(fp8_native.quantize(w.t(), (4, 4))[0]),
                       _as_u8(fp8.quantize_blocks_torch(w.t().contiguous(), (4, 4))[0]))


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from rltool.data.models import init_model

    return init_model(tmp_path_factory.mktemp("fp8n") / "qwen2-bf16", arch="qwen2",
                      preset="tiny", dtype="bfloat16", seed=5)


def _checkpoint_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if p.suffix in (".safetensors", ".json")}


def test_fallback_writes_the_same_checkpoint(bf16_checkpoint, tmp_path, use_native):
    """RLTOOL_NATIVE=0 (the torch path) and the native kernel write byte-identical checkpoints,
    for fp8 and for dequant back to bf16."""
    written = {}
    for enabled in (False, True):
        use_native(enabled)
        assert fp8_native.available() == enabled
        q, d = tmp_path / f"q{enabled}", tmp_path / f"d{enabled}"
        fp8.quantize_checkpoint(fp8.Fp8Config(hf=bf16_checkpoint, out=q, block=(32, 64),
                                              workers=2))
        fp8.dequantize_checkpoint(fp8.DequantConfig(hf=q, out=d))
        written[enabled] = _checkpoint_bytes(q), _checkpoint_bytes(d)
    for torch_files, native_files in zip(written[False], written[True], strict=True):
        assert torch_files.keys() == native_files.keys()
        for name in torch_files:
            assert torch_files[name] == native_files[name], name
    index = json.loads(written[True][0]["model.safetensors.index.json"])
    assert any(name.endswith("_scale_inv") for name in index["weight_map"])


def test_non_finite_weight_is_refused(bf16_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for p in bf16_checkpoint.iterdir():
        if p.suffix != ".safetensors":
            (src / p.name).write_bytes(p.read_bytes())
    tensors = {}
    for p in sorted(bf16_checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    for p in src.glob("*.index.json"):
        p.unlink()
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.weight holds inf or NaN"):
        fp8.quantize_checkpoint(fp8.Fp8Config(hf=src, out=tmp_path / "q", workers=2))
    assert not (tmp_path / "q").exists()


def test_workers_share_the_cores_and_threads_are_restored(bf16_checkpoint, tmp_path, monkeypatch):
    """hf_writer gives each worker cores // workers torch threads and restores the setting."""
    seen = []
    real = fp8.quantize_blocks

    def spy(w, block, **kwargs):
        seen.append(torch.get_num_threads())
        return real(w, block, **kwargs)

    monkeypatch.setattr(fp8, "quantize_blocks", spy)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    before = torch.get_num_threads()
    fp8.quantize_checkpoint(fp8.Fp8Config(hf=bf16_checkpoint, out=tmp_path / "q", workers=4))
    assert seen and set(seen) == {2}
    assert torch.get_num_threads() == before


def test_buffer_pool_recycles_written_outputs():
    from rltool.convert.hf_writer import BufferPool

    pool = BufferPool()
    a = pool.take((3, 4), torch.float8_e4m3fn)
    pool.give(a)
    assert pool.take((3, 4), torch.float8_e4m3fn).data_ptr() == a.data_ptr()
    b = pool.take((3, 4), torch.float8_e4m3fn)  # the pool is empty again: a new buffer
    assert b.data_ptr() != a.data_ptr() and tuple(b.shape) == (3, 4)
    assert pool.take((4, 3), torch.float8_e4m3fn).data_ptr() != a.data_ptr()


def test_small_jobs_run_ahead_while_a_large_tensor_is_written():
    """hf_writer's read-ahead: beyond the count window, jobs whose outputs fit in window_bytes
    are started before the large tensor is written (the FP8 workers idled during embeddings)."""
    from concurrent.futures import ThreadPoolExecutor

    from rltool.convert.hf_writer import Job, _ordered_results

    started = []

    def job(name: str, numel: int) -> Job:
        def run():
            started.append(name)
            return [torch.zeros(numel, dtype=torch.uint8)]

        return Job(outputs=[(name, "U8", (numel,))], run=run)

    jobs = [job("big", 1000)] + [job(f"s{i}", 10) for i in range(10)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        results = _ordered_results(jobs, pool, window=1, window_bytes=50)
        name, _ = next(results)  # the big tensor is now being written
        pool.submit(lambda: None).result()  # let queued jobs start
        assert name == "big" and started == ["big"] + [f"s{i}" for i in range(5)]
        assert [n for n, _ in results] == [f"s{i}" for i in range(10)]
