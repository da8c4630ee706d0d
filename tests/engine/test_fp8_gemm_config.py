"""The block-FP8 GEMM's launch plan (rltool.engine.fp8_gemm.config) and backend switch, without
running a kernel: every K split non-empty and covering K once, the decode path up to 64 tokens,
K split only while the tiles leave SMs idle."""

from __future__ import annotations

import pytest

from rltool.engine import fp8_gemm


@pytest.mark.parametrize("sms", [8, 132])
def test_config_covers_k_once_and_fills_the_gpu(sms):
    for m in (1, 7, 16, 33, 64, 65, 128, 129, 256, 8192):
        for n in (24, 896, 3584, 37888):
            for num_kb in (1, 2, 7, 28, 148):
                cfg = fp8_gemm.config(m, n, num_kb, sms)
                split, per = cfg["split"], cfg["per_split"]
                assert (split - 1) * per < num_kb <= split * per, (m, n, num_kb, cfg)
                assert cfg["SWAP"] == (m <= 64)
                assert cfg["BLOCK_M"] >= (min(m, 64) if m <= 64 else 64)
                tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
                if tiles >= sms:
                    assert split == 1, (m, n, num_kb, cfg)
                else:
                    assert tiles * split <= 2 * sms, (m, n, num_kb, cfg)
    assert fp8_gemm.config(64, 3584, 28, 132)["split"] == 3  # 7B o_proj at decode: 56 tiles


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="not one of auto, triton, native"):
        fp8_gemm.set_backend("cublas")
    fp8_gemm.set_backend("triton")
    fp8_gemm.set_backend("auto")
