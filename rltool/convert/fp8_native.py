"""ctypes bindings of the block-FP8 kernels in `csrc/fp8.c` (see `rltool.native`).

Each function returns None when the native library is not available, and the caller falls back to
the torch implementation in `rltool.convert.fp8`, which gives the same bits (tests check both).
The kernels run without the GIL, one call per tensor, so `--workers` threads quantize in parallel.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

from rltool import native

if TYPE_CHECKING:
    import torch

_F32, _BF16, _F16 = 0, 1, 2  # csrc/fp8.c's dtype codes
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = native.load()
    if lib is None:
        return None
    lib.rltool_fp8_quantize.argtypes = [_ptr, ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _ptr]
    lib.rltool_fp8_quantize.restype = ctypes.c_int
    lib.rltool_fp8_dequantize.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_int, _ptr]
    lib.rltool_fp8_dequantize.restype = ctypes.c_int
    lib.rltool_f32_to_e4m3.argtypes = [_ptr, _ptr, _i64]
    lib.rltool_f32_to_e4m3.restype = None
    return lib


def available() -> bool:
    return _lib() is not None


def _code(dtype: torch.dtype) -> int | None:
    import torch

    return {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}.get(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int], *,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q float8_e4m3fn [N, K], scale_inv float32), or None if the kernel cannot take `w`.
    `out`: an optional contiguous float8_e4m3fn [N, K] CPU tensor to write q into."""
    import torch

    lib, code = _lib(), _code(w.dtype)
    if lib is None or code is None or w.dim() != 2 or w.device.type != "cpu":
        return None
    w = w.contiguous()
    n, k = w.shape
    if out is None:
        q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    elif (out.dtype, tuple(out.shape), out.device.type) == (torch.float8_e4m3fn, (n, k), "cpu") \
            and out.is_contiguous():
        q = out
    else:
        raise ValueError(f"out must be a contiguous CPU float8_e4m3fn tensor of shape {(n, k)}")
    scale = torch.empty(-(-n // block[0]), -(-k // block[1]), dtype=torch.float32)
    rc = lib.rltool_fp8_quantize(w.data_ptr(), code, n, k, block[0], block[1], q.data_ptr(),
                                 scale.data_ptr())
    if rc != 0:
        raise RuntimeError(f"rltool_fp8_quantize failed for shape {(n, k)}, block {block}")
    return q, scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *,
               dtype: torch.dtype) -> torch.Tensor | None:
    """q * scale_inv in `dtype` (float32 or bfloat16), or None if the kernel cannot produce it."""
    import torch

    lib, code = _lib(), _code(dtype)
    if (lib is None or code not in (_F32, _BF16) or q.dtype != torch.float8_e4m3fn
            or q.dim() != 2 or q.device.type != "cpu"):
        return None
    q, scale_inv = q.contiguous(), scale_inv.to(torch.float32).contiguous()
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype)
    rc = lib.rltool_fp8_dequantize(q.data_ptr(), scale_inv.data_ptr(), n, k, block[0], block[1],
                                   code, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"rltool_fp8_dequantize failed for shape {(n, k)}, block {block}")
    return out


def cast_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 -> float8_e4m3fn cast alone (tests compare it with torch's)."""
    import torch

    lib = _lib()
    if lib is None:
        raise RuntimeError("the native library is not built")
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    lib.rltool_f32_to_e4m3(x.data_ptr(), out.data_ptr(), x.numel())
    return out
