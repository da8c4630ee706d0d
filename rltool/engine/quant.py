"""Quantized checkpoints in the builtin engine: block FP8 (the format `rltool convert fp8`, slime
and DeepSeek-V3 write; docs/formats.md) here, INT4 W4A16 (compressed-tensors pack-quantized, what
`rltool convert int4` and slime's INT4 converter write) in rltool.engine.int4_weight. This module
reads the quantization_config, checks the quantized tensors, and dispatches the linears and
weight copies by weight kind.

A checkpoint's quantized linear is `<p>.weight` float8_e4m3fn [N, K] plus `<p>.weight_scale_inv`
float32 [ceil(N/bn), ceil(K/bk)]. On CPU (and whenever a destination is not FP8) it is dequantized
at load into the model dtype by the convert path's own dequantizer, so the served weights are bit
for bit those of a checkpoint `rltool convert dequant --dtype <model dtype>` wrote. On CUDA a
fused projection whose sources are all FP8 stays FP8 (`Fp8Weight`) and runs through
rltool.engine.fp8_gemm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rltool.convert import int4
from rltool.convert.fp8 import SCALE_SUFFIX, dequantize_blocks, quantize_blocks, scale_shape
from rltool.convert.int4 import Int4Format, Int4Tensor
from rltool.engine import int4_weight
from rltool.engine.int4_weight import Int4Weight, pair_int4  # noqa: F401 - the model's entry
from rltool.errors import CheckpointError

if TYPE_CHECKING:  # the GEMM module imports triton: only on the FP8 path
    from rltool.engine.fp8_gemm import Fp8Activations

SUPPORTED = ("quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [bn, bk]; "
             "or compressed-tensors pack-quantized INT4 W4A16")


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's block-FP8 quantization_config."""
    block: tuple[int, int]
    not_converted: frozenset[str]  # modules_to_not_convert: 2-D weights kept in their dtype

    def describe(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block)}


Format = Fp8Format | Int4Format


def read_format(config: dict[str, Any], *, where: str) -> Format | None:
    """The block-FP8 or INT4 format of a config.json (None when unquantized); anything else that
    names a quantization is refused in one line."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if int4.is_int4_config(qc):
        return int4.read_format(qc, where=where)
    block = qc.get("weight_block_size") if isinstance(qc, dict) else None
    skip = qc.get("modules_to_not_convert") if isinstance(qc, dict) else None
    ok = (isinstance(qc, dict) and qc.get("quant_method") == "fp8"
          and qc.get("fmt", "e4m3") == "e4m3"
          and qc.get("activation_scheme", "dynamic") == "dynamic"
          and isinstance(block, list) and len(block) == 2
          and all(isinstance(b, int) and b > 0 for b in block)
          and (skip is None or (isinstance(skip, list) and all(isinstance(s, str) for s in skip))))
    if not ok:
        shown = {k: qc.get(k) for k in ("quant_method", "fmt", "activation_scheme",
                                        "weight_block_size") if k in qc} \
            if isinstance(qc, dict) else qc
        raise CheckpointError(
            f"{where}: quantization_config {shown} is not supported by the builtin engine (block "
            f"FP8 only: {SUPPORTED}); serve it with --engine sglang, or `rltool convert dequant` "
            "it first")
    return Fp8Format(block=(block[0], block[1]), not_converted=frozenset(skip or ()))


def describe(fp8_keys: frozenset, fmt: Format | None, dtype: str) -> dict[str, Any]:
    """What /get_server_info reports of the weights: `weight_precision` (the checkpoint's: fp8,
    int4, else the model dtype), `weight_dtype` (what the linears are kept in: fp8_e4m3 or int4
    when they stay quantized, `fp8_keys` being those kept so) and the checkpoint's quantization
    (and whether it was dequantized at load)."""
    kind = None if fmt is None else "int4" if isinstance(fmt, Int4Format) else "fp8"
    resident = {"fp8": "fp8_e4m3", "int4": "int4"}.get(kind) if fp8_keys else None
    return {"weight_precision": kind or dtype, "weight_dtype": resident or dtype,
            "quantization": None if fmt is None else {
                **fmt.describe(), "resident": kind if fp8_keys else "dequantized"}}


def resident_keys(fmt: Format | None, sources: dict[tuple[int, str], list[str]],
                  shapes: dict[str, tuple[int, ...]], quantized: set[str]) -> frozenset:
    """The (layer, linear) weights a CUDA engine keeps quantized: every source of the fused
    weight quantized in the checkpoint, and the format one the GEMMs take (block FP8 with a
    power-of-two K-block >= 32, the FP8 tensor-core dot's minimum; INT4 with K a multiple of 8)."""
    if isinstance(fmt, Fp8Format):
        ok = fmt.block[1] >= 32 and fmt.block[1] & (fmt.block[1] - 1) == 0
    else:
        ok = fmt is not None
    return frozenset(k for k, names in sources.items() if ok and all(
        n in quantized and (isinstance(fmt, Fp8Format) or Int4Weight.fits(shapes[n], fmt))
        for n in names))


def stored_name(key: str, fmt: Format | None) -> str | None:
    """The weight name a checkpoint tensor carries (None for a scale or other companion)."""
    if isinstance(fmt, Int4Format):
        return int4_weight.stored_name(key)
    return None if key.endswith(SCALE_SUFFIX) else key


def read_quantized(name: str, get: Any, infos: dict[str, Any], fmt: Format, *,
                   where: str) -> BlockFp8 | Int4Tensor:
    """Quantized weight `name` of a checkpoint, with its scales (`get(key)` reads a tensor)."""
    if isinstance(fmt, Int4Format):
        return int4_weight.read_weight(name, get, infos, where=where)
    return BlockFp8(get(name), get(name + SCALE_SUFFIX), fmt.block)


def split_scales(infos: dict[str, tuple[tuple[int, ...], str]], fmt: Fp8Format | None, *,
                 where: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Check a checkpoint's FP8 weights against their scales (`infos`: name -> (shape, safetensors
    dtype)). Returns the shapes of everything but the scales, and the names of the FP8 weights.
    An INT4 checkpoint's tensors are checked by rltool.engine.int4_weight."""
    if isinstance(fmt, Int4Format):
        return int4_weight.split_tensors(infos, fmt, where=where)
    fp8: set[str] = set()
    for name, (shape, dtype) in infos.items():
        if name.endswith(SCALE_SUFFIX):
            weight = infos.get(name.removesuffix(SCALE_SUFFIX))
            if weight is None or weight[1] != "F8_E4M3":
                raise CheckpointError(f"{where}: {name} scales no FP8 weight; restore the "
                                      "checkpoint or re-run `rltool convert fp8`")
            continue
        if dtype != "F8_E4M3":
            continue
        if fmt is None:
            raise CheckpointError(f"{where}: {name} is FP8 but config.json has no "
                                  "quantization_config; restore config.json")
        if name.removesuffix(".weight") in fmt.not_converted:
            raise CheckpointError(f"{where}: {name} is FP8 but quantization_config lists it in "
                                  "modules_to_not_convert; restore the checkpoint")
        scale = infos.get(name + SCALE_SUFFIX)
        want = scale_shape(shape, fmt.block) if len(shape) == 2 else None
        if scale is None or want is None or (tuple(scale[0]), scale[1]) != (want, "F32"):
            got = "is missing" if scale is None else f"is {scale[1]}{list(scale[0])}"
            expected = f"F32{list(want)}" if want else "a 2-D weight"
            raise CheckpointError(f"{where}: {name + SCALE_SUFFIX} {got}, expected {expected} "
                                  f"for block {list(fmt.block)}; restore the checkpoint or re-run "
                                  "`rltool convert fp8`")
        fp8.add(name)
    shapes = {n: tuple(s) for n, (s, _) in infos.items() if not n.endswith(SCALE_SUFFIX)}
    return shapes, fp8


@dataclass(frozen=True)
class BlockFp8:
    """A checkpoint's quantized tensor, as stored: q [N, K] e4m3 and its block scales."""
    q: torch.Tensor
    scale_inv: torch.Tensor  # float32 [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def pair_scales(named: list[tuple[str, torch.Tensor]], block: tuple[int, int]
                ) -> list[tuple[str, torch.Tensor | BlockFp8]]:
    """An in-memory block-FP8 update: each float8_e4m3fn weight joined with its float32
    `<name>_scale_inv` (checked against `block`); other tensors as they are."""
    from rltool.errors import BadInputError

    if block[0] < 1 or block[1] < 1:
        raise BadInputError(f"weight_block_size {list(block)} must be two positive integers")
    tensors = dict(named)
    out: list[tuple[str, torch.Tensor | BlockFp8]] = []
    for name, t in named:
        if name.endswith(SCALE_SUFFIX):
            weight = tensors.get(name.removesuffix(SCALE_SUFFIX))
            if weight is None or weight.dtype != torch.float8_e4m3fn:
                raise BadInputError(f"{name} scales no float8_e4m3fn weight of the update; send "
                                    "each FP8 weight with its scales")
            continue
        if t.dtype != torch.float8_e4m3fn:
            out.append((name, t))
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        want = scale_shape(tuple(t.shape), block) if t.dim() == 2 else None
        if scale is None or want is None or (tuple(scale.shape), scale.dtype) != (
                want, torch.float32):
            got = "is missing" if scale is None else f"is {scale.dtype}{list(scale.shape)}"
            raise BadInputError(f"{name}{SCALE_SUFFIX} {got}, expected float32"
                                f"{list(want) if want else ''} for weight_block_size "
                                f"{list(block)}; send the scales of that block size")
        out.append((name, BlockFp8(t, scale, block)))
    return out


class Fp8Weight:
    """A linear weight kept in FP8: q [..., N, K] e4m3 and one float32 scale per row and K-block
    (`scale` [..., N, ceil(K / block_k)]; the block scales repeated over their rows), stored
    K-block-major (strides (1, N) per matrix: the layout of cuBLAS's 1x128 scales)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, block_k: int):
        self.q, self.scale, self.block_k = q, scale, block_k

    @classmethod
    def empty(cls, *shape: int, block_k: int, device: torch.device) -> Fp8Weight:
        scale = torch.empty(*shape[:-2], -(-shape[-1] // block_k), shape[-2],
                            dtype=torch.float32, device=device).transpose(-1, -2)
        return cls(torch.empty(*shape, dtype=torch.float8_e4m3fn, device=device), scale, block_k)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    def __getitem__(self, index: Any) -> Fp8Weight:
        return Fp8Weight(self.q[index], self.scale[index], self.block_k)

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


def linear(x: torch.Tensor | Fp8Activations, w: torch.Tensor | Fp8Weight | Int4Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, the W4A16 GEMM for a weight kept INT4, or the block-FP8 GEMM for a weight kept
    in FP8 (x possibly quantized for it already, by the kernel that computed it)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, Int4Weight):
        from rltool.engine.int4_gemm import int4_linear

        return int4_linear(x, w, bias)
    from rltool.engine.fp8_gemm import fp8_linear

    return fp8_linear(x, w.q, w.scale, block_k=w.block_k, bias=bias)


def copy_into(dest: torch.Tensor | Fp8Weight | Int4Weight, start: int, rows: int,
              value: torch.Tensor | BlockFp8 | Int4Tensor) -> None:
    """Write `value` into rows [start, start + rows) of `dest`: dequantized into a plain weight,
    quantized (with the destination's K-block, square blocks; or group size) into an FP8 or INT4
    one."""
    if isinstance(dest, torch.Tensor):
        if isinstance(value, BlockFp8):
            value = dequantize_blocks(value.q, value.scale_inv, value.block, dtype=dest.dtype)
        elif isinstance(value, Int4Tensor):
            value = int4_weight.dequantized(value, dest.dtype)
        dest[start:start + rows].copy_(value, non_blocking=True)
        return
    if isinstance(dest, Int4Weight):
        if isinstance(value, BlockFp8):
            value = dequantize_blocks(value.q, value.scale_inv, value.block, dtype=torch.float32)
        dest.copy_rows(start, rows, value)
        return
    if isinstance(value, Int4Tensor):
        value = int4_weight.dequantized(value, torch.float32)
    if not isinstance(value, BlockFp8) or value.block[1] != dest.block_k:
        if isinstance(value, BlockFp8):
            value = dequantize_blocks(value.q, value.scale_inv, value.block, dtype=torch.float32)
        block = (dest.block_k, dest.block_k)
        q, scale_inv = quantize_blocks(value, block)  # the native kernel on CPU, else torch
        value = BlockFp8(q, scale_inv.to(value.device), block)
    dest.q[start:start + rows].copy_(value.q, non_blocking=True)
    per_row = value.scale_inv.repeat_interleave(value.block[0], dim=0)[:rows]
    dest.scale[start:start + rows].copy_(per_row, non_blocking=True)
