"""INT4 (W4A16, compressed-tensors pack-quantized) checkpoints in the builtin engine: the check of
a checkpoint's INT4 tensors against its quantization_config, reading one weight's tensors, and the
weights that stay INT4 in memory on CUDA (`Int4Weight`, multiplied by rltool.engine.int4_gemm).

Layout and math: rltool.convert.int4 (docs/formats.md, "INT4 checkpoints"). On CPU (and for any
destination not kept INT4) a weight is dequantized at load into the model dtype by the convert
path's own `dequantize_int4`, so the served weights are bit for bit those of a checkpoint
`rltool convert dequant --dtype <model dtype>` wrote.
"""

from __future__ import annotations

from typing import Any

import torch

from rltool.convert import int4
from rltool.convert.int4 import Int4Format, Int4Tensor
from rltool.errors import CheckpointError


def stored_name(key: str) -> str | None:
    """The weight a checkpoint tensor of an INT4 checkpoint carries: `<p>.weight` for
    `<p>.weight_packed`, None for the other INT4 companions, else the key itself."""
    base, _, suffix = key.rpartition(".")
    if suffix == int4.PACKED:
        return base + ".weight"
    return None if suffix in int4.SUFFIXES else key


def split_tensors(infos: dict[str, tuple[tuple[int, ...], str]], fmt: Int4Format, *,
                  where: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Check an INT4 checkpoint's tensors (`infos`: name -> (shape, safetensors dtype)) against
    its format: each packed weight with its scale, shape and (asymmetric) zero point of matching
    shapes, no INT4 tensor in an ignored module, and no float linear weight the format says is
    INT4. Returns the shapes of the weights (INT4 ones by their logical `<p>.weight` [N, K]) and
    the names of the INT4 weights."""
    shapes: dict[str, tuple[int, ...]] = {}
    quantized: set[str] = set()
    for key, (shape, dtype) in infos.items():
        name = stored_name(key)
        if name is None:
            base = key.rpartition(".")[0]
            if base + "." + int4.PACKED not in infos:
                raise CheckpointError(f"{where}: {key} belongs to no {int4.PACKED} tensor; "
                                      "restore the checkpoint or re-run `rltool convert int4`")
            continue
        if name == key:
            if fmt.quantizes(name, tuple(shape), floating=dtype in ("F32", "F16", "BF16")):
                raise CheckpointError(
                    f"{where}: {name} is stored as {dtype} but quantization_config.ignore does "
                    "not list its module; restore the checkpoint or its config.json")
            shapes[name] = tuple(shape)
            continue
        module = name.removesuffix(".weight")
        if fmt.ignores(module):
            raise CheckpointError(f"{where}: {key} is INT4 but quantization_config.ignore lists "
                                  f"{module}; restore the checkpoint or its config.json")
        shapes[name] = _logical_shape(key, shape, dtype, infos, fmt, where=where)
        quantized.add(name)
    return shapes, quantized


def _logical_shape(key: str, shape: tuple[int, ...], dtype: str,
                   infos: dict[str, tuple[tuple[int, ...], str]], fmt: Int4Format, *,
                   where: str) -> tuple[int, int]:
    base = key.removesuffix(int4.PACKED)
    scale = infos.get(base + int4.SCALE)
    zero = infos.get(base + int4.ZERO_POINT)
    dims = infos.get(base + int4.SHAPE)
    problem = None
    if dtype != "I32" or len(shape) != 2:
        problem = f"{key} is {dtype}{list(shape)}, expected a 2-D I32 tensor"
    elif scale is None or dims is None:
        problem = f"{base}{int4.SCALE if scale is None else int4.SHAPE} is missing"
    elif (len(scale[0]) != 2 or scale[0][0] != shape[0]
          or scale[1] not in ("F32", "F16", "BF16")):
        problem = f"{base}{int4.SCALE} is {scale[1]}{list(scale[0])}, expected [{shape[0]}, K/g]"
    elif dims[0] != (2,) or dims[1] not in ("I64", "I32"):
        problem = f"{base}{int4.SHAPE} is {dims[1]}{list(dims[0])}, expected I64[2]"
    else:
        k = scale[0][1] * fmt.group_size
        zp_shape = (-(-shape[0] // int4.PER_WORD), scale[0][1])
        if shape[1] != -(-k // int4.PER_WORD):
            problem = (f"{key} has {shape[1]} words per row, but its scale's {scale[0][1]} "
                       f"groups of {fmt.group_size} make K = {k}")
        elif fmt.symmetric and zero is not None:
            problem = f"{base}{int4.ZERO_POINT} exists but quantization_config is symmetric"
        elif not fmt.symmetric and (zero is None or zero != (zp_shape, "I32")):
            got = "is missing" if zero is None else f"is {zero[1]}{list(zero[0])}"
            problem = f"{base}{int4.ZERO_POINT} {got}, expected I32{list(zp_shape)}"
        else:
            return shape[0], k
    raise CheckpointError(f"{where}: {problem}; restore the checkpoint or re-run "
                          "`rltool convert int4`")


def read_weight(name: str, get: Any, infos: dict[str, Any], *, where: str) -> Int4Tensor:
    """Weight `name`'s INT4 tensors from a checkpoint (`get(key)` reads a tensor), checked
    against its `weight_shape`."""
    return int4.read_int4_tensor(infos, name, get, where=where)


def pair_int4(named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """An in-memory update's INT4 weights (each `<p>.weight_packed` with its scale, zero point
    and shape, as rltool.delta.tensor_sync.quantize_named_int4 sends them) joined into one
    Int4Tensor named `<p>.weight`; other tensors as they are. BadInputError for a companion
    without its packed weight, or INT4 tensors that do not fit together."""
    from rltool.errors import BadInputError

    if not any(n.endswith("." + int4.PACKED) for n, _ in named):
        return named
    tensors = dict(named)
    out: list[tuple[str, Any]] = []
    for name, t in named:
        base, _, suffix = name.rpartition(".")
        if suffix in (int4.SCALE, int4.ZERO_POINT, int4.SHAPE):
            if f"{base}.{int4.PACKED}" not in tensors:
                raise BadInputError(f"{name} belongs to no {int4.PACKED} tensor of the update; "
                                    "send each INT4 weight with its companions")
            continue
        if suffix != int4.PACKED:
            out.append((name, t))
            continue
        missing = [s for s in (int4.SCALE, int4.SHAPE) if f"{base}.{s}" not in tensors]
        if missing:
            raise BadInputError(f"{name} comes without {', '.join(missing)}; send each INT4 "
                                "weight with its scale, shape and zero point")
        try:
            value = int4.read_int4_tensor(tensors, base + ".weight", tensors.__getitem__,
                                          where="update")
        except CheckpointError as e:
            raise BadInputError(str(e)) from e
        out.append((base + ".weight", value))
    return out


class Int4Weight:
    """A linear weight kept INT4: `packed` int32 [..., N, K/8] (the checkpoint's layout), float32
    `scale` [..., N, K/g], and for asymmetric groups the zero points unpacked, int8 `zero`
    [..., N, K/g] (fused projections start at any row, while packed zero points hold 8 rows per
    word). K is a multiple of 8."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 group_size: int):
        self.packed, self.scale, self.zero, self.group_size = packed, scale, zero, group_size

    @classmethod
    def empty(cls, *shape: int, fmt: Int4Format, device: torch.device) -> Int4Weight:
        *lead, n, k = shape
        groups = k // fmt.group_size
        return cls(torch.empty(*lead, n, k // int4.PER_WORD, dtype=torch.int32, device=device),
                   torch.empty(*lead, n, groups, dtype=torch.float32, device=device),
                   None if fmt.symmetric else torch.empty(*lead, n, groups, dtype=torch.int8,
                                                          device=device),
                   fmt.group_size)

    @staticmethod
    def fits(shape: tuple[int, ...], fmt: Int4Format) -> bool:
        """Whether a weight of this shape can be kept INT4 (K a multiple of 8 and of the group)."""
        return shape[-1] % int4.PER_WORD == 0 and shape[-1] % fmt.group_size == 0

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * int4.PER_WORD))

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def __getitem__(self, index: Any) -> Int4Weight:
        return Int4Weight(self.packed[index], self.scale[index],
                          None if self.zero is None else self.zero[index], self.group_size)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.packed, self.scale, self.zero) if t is not None)

    def copy_rows(self, start: int, rows: int, value: torch.Tensor | Int4Tensor) -> None:
        """Write `value` (an INT4 checkpoint weight, or a float weight quantized here with this
        weight's group size and symmetry) into rows [start, start + rows)."""
        if not isinstance(value, Int4Tensor) or value.group_size != self.group_size or (
                value.zero_point is None) != (self.zero is None):
            if isinstance(value, Int4Tensor):
                value = int4.dequantize_int4(value, dtype=torch.float32)
            value = int4.quantize_int4(value, group_size=self.group_size,
                                       symmetric=self.zero is None, scale_dtype=torch.float32)
        end = start + rows
        self.packed[start:end].copy_(value.packed, non_blocking=True)
        self.scale[start:end].copy_(value.scale, non_blocking=True)
        if self.zero is not None:
            zero = int4.unpack_int4(value.zero_point, rows, dim=0)
            self.zero[start:end].copy_(zero, non_blocking=True)


def dequantized(value: Int4Tensor, dtype: torch.dtype) -> torch.Tensor:
    return int4.dequantize_int4(value, dtype=dtype)
