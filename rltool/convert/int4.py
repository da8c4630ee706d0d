"""Group-wise INT4 weight-only quantization (W4A16) of HF checkpoints, in compressed-tensors'
"pack-quantized" format: what slime's INT4 converter writes and vLLM / SGLang load
(docs/formats.md, "INT4 checkpoints"; docs/convert.md).

A quantized linear `<p>.weight` [N, K] becomes:
  `<p>.weight_packed`      int32 [N, ceil(K/8)]: eight 4-bit codes per int32, code j of a word at
                           bits 4j..4j+3 (column 8i + j of row r is in word [r, i]), each code the
                           signed value + 8 (so -8..7 is stored as 0..15);
  `<p>.weight_scale`       [N, K/g] in the weight's dtype, one scale per row and group of g columns;
  `<p>.weight_zero_point`  asymmetric only: int32 [ceil(N/8), K/g], the signed zero points packed
                           the same way along the rows (dim 0);
  `<p>.weight_shape`       int64 [2] = [N, K].
Dequantization is `(q - zp) * scale` (zp = 0 when symmetric). The math of the scales and codes is
in `quantize_int4`. Which weights are quantized: every 2-D floating `*.weight` that is a linear
layer's (not an embedding's) and whose module name matches no `ignore` pattern (`re:REGEX`,
re.match against the module name, or an exact module name: compressed-tensors' rules).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator

from rltool.config import StageConfig, cli, torch_dtype_name
from rltool.convert import hf_writer
from rltool.convert.fp8 import (DequantConfig, _copy_job, _default_workers, _publish_dequantized,
                                _publish_quantized, relative_error)
from rltool.errors import BadInputError, CheckpointError
from rltool.io import checkpoint as ckpt_io
from rltool.io import header as st
from rltool.io import reader as st_read

if TYPE_CHECKING:
    import torch

QMIN, QMAX = -8, 7  # the signed 4-bit range
CODE_OFFSET = 8  # stored code = value + 8
PER_WORD = 8  # 4-bit codes per int32
PACKED, SCALE, ZERO_POINT, SHAPE = "weight_packed", "weight_scale", "weight_zero_point", "weight_shape"
SUFFIXES = (PACKED, SCALE, ZERO_POINT, SHAPE)
QUANT_METHOD, FORMAT = "compressed-tensors", "pack-quantized"
# slime's default for MoE models: only the routed experts' linears are INT4 (attention, dense and
# shared-expert MLPs, norms, embeddings, lm_head and the router `mlp.gate` stay in their dtype).
MOE_IGNORE = ("re:.*lm_head.*", "re:.*norm.*", "re:.*embed.*", "re:.*self_attn.*",
              "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
              r"re:.*mlp\.gate\.*")
DENSE_IGNORE = ("lm_head",)  # a dense model: every linear layer but the output head
_MODULE_NAME = re.compile(r"[\w-]+(\.[\w-]+)*")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_FLOAT_CODES = ("F32", "F16", "BF16")


def check_patterns(patterns: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The ignore patterns, each `re:REGEX` (a valid regular expression) or an exact dotted module
    name; anything else (globs such as `*norm*`, spaces) raises BadInputError in one line."""
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise BadInputError(f"--ignore {p!r} is not a valid regular expression ({e}); "
                                    "fix the pattern after 're:'") from e
        elif not _MODULE_NAME.fullmatch(p):
            raise BadInputError(f"--ignore {p!r}: unknown pattern syntax; give 're:REGEX' (matched "
                                "from the start of the module name) or an exact module name such "
                                "as model.layers.0.mlp.down_proj")
    return tuple(patterns)


@dataclass(frozen=True)
class Int4Format:
    """The quantization of a pack-quantized W4A16 checkpoint."""

    group_size: int
    symmetric: bool
    ignore: tuple[str, ...]

    def ignores(self, module: str) -> bool:
        return any(re.match(p[3:], module) is not None if p.startswith("re:") else p == module
                   for p in self.ignore)

    def quantizes(self, name: str, shape: tuple[int, ...], *, floating: bool = True) -> bool:
        """Whether tensor `name` of this shape is stored INT4: a linear layer's 2-D floating
        weight (embeddings are not linear layers) that no ignore pattern matches."""
        if not (floating and name.endswith(".weight") and len(shape) == 2):
            return False
        module = name.removesuffix(".weight")
        return "embed" not in module.rsplit(".", 1)[-1] and not self.ignores(module)

    def quantization_config(self) -> dict[str, Any]:
        """config.json's quantization_config (compressed-tensors' keys, as slime writes it)."""
        weights = {"num_bits": 4, "type": "int", "symmetric": self.symmetric, "strategy": "group",
                   "group_size": self.group_size, "dynamic": False, "actorder": None,
                   "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
        return {"quant_method": QUANT_METHOD, "format": FORMAT,
                "quantization_status": "compressed", "kv_cache_scheme": None,
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None,
                                              "output_activations": None}},
                "ignore": list(self.ignore)}

    def describe(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "format": FORMAT, "num_bits": 4,
                "group_size": self.group_size, "symmetric": self.symmetric}


def is_int4_config(qc: Any) -> bool:
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def read_format(qc: dict[str, Any], *, where: str) -> Int4Format:
    """The Int4Format of a compressed-tensors quantization_config; anything but one group of
    4-bit int group-wise weights (no activation quantization), pack-quantized, raises
    CheckpointError naming what differs."""
    groups = qc.get("config_groups")
    group = next(iter(groups.values())) if isinstance(groups, dict) and len(groups) == 1 else None
    w = group.get("weights") if isinstance(group, dict) else None
    problems = []
    if qc.get("format") != FORMAT:
        problems.append(f"format {qc.get('format')!r} (need {FORMAT!r})")
    if not isinstance(w, dict):
        problems.append("config_groups must hold exactly one group with weights")
    else:
        for key, want in (("num_bits", 4), ("type", "int"), ("strategy", "group")):
            if w.get(key) != want:
                problems.append(f"weights.{key} {w.get(key)!r} (need {want!r})")
        g = w.get("group_size")
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            problems.append(f"weights.group_size {g!r} (need a positive integer)")
        if not isinstance(w.get("symmetric"), bool):
            problems.append(f"weights.symmetric {w.get('symmetric')!r} (need true or false)")
        if group.get("input_activations") or group.get("output_activations"):
            problems.append("activation quantization (W4A16 only)")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        problems.append("ignore must be a list of strings")
    if problems:
        raise CheckpointError(f"{where}: compressed-tensors quantization_config not supported: "
                              f"{'; '.join(problems)} (INT4 pack-quantized W4A16 only)")
    try:
        patterns = check_patterns(ignore)
    except BadInputError as e:
        raise CheckpointError(f"{where}: quantization_config.ignore: {e}") from e
    return Int4Format(group_size=w["group_size"], symmetric=w["symmetric"], ignore=patterns)


def is_moe(config: dict[str, Any]) -> bool:
    return any(isinstance(config.get(k), int) and config[k] > 0 for k in _MOE_KEYS)


def default_ignore(config: dict[str, Any]) -> tuple[str, ...]:
    """slime's list for MoE models (experts only), else every linear but lm_head."""
    return MOE_IGNORE if is_moe(config) else DENSE_IGNORE


DEFAULT_GROUP_SIZE = 32  # slime's


def default_format(config: dict[str, Any]) -> Int4Format:
    """What `rltool convert int4` without options writes for a model of this config.json (and
    what `[sync] precision = "int4"` publishes)."""
    return Int4Format(group_size=DEFAULT_GROUP_SIZE, symmetric=True,
                      ignore=default_ignore(config))


# ----- the math -------------------------------------------------------------------------------

def pack_int4(q: torch.Tensor, *, dim: int = -1) -> torch.Tensor:
    """Signed 4-bit values (any integer dtype, in -8..7) -> int32 words along `dim` (-1 or -2,
    zero-padded to a multiple of 8): code j of a word = value 8i + j plus 8, at bits 4j."""
    import torch

    if dim in (0, -2) and q.dim() >= 2:
        return pack_int4(q.transpose(-1, -2)).transpose(-1, -2).contiguous()
    cols = q.shape[-1]
    codes = q.to(torch.int32) + CODE_OFFSET
    pad = -cols % PER_WORD
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    codes = codes.view(*q.shape[:-1], (cols + pad) // PER_WORD, PER_WORD)
    shifts = torch.arange(PER_WORD, device=q.device, dtype=torch.int32) * 4
    # The codes occupy disjoint bits, so the int32 sum is their bitwise or; the top code's bits
    # 28..31 wrap to the word's sign as two's complement (int64 and a wrap-around cost twice this).
    return (codes << shifts).sum(-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, size: int, *, dim: int = -1) -> torch.Tensor:
    """`pack_int4`'s inverse: int8 values along `dim` (-1 or -2), the padding dropped."""
    import torch

    if dim in (0, -2) and packed.dim() >= 2:
        return unpack_int4(packed.transpose(-1, -2), size).transpose(-1, -2).contiguous()
    shifts = torch.arange(PER_WORD, device=packed.device, dtype=torch.int32) * 4
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF
    values = codes.reshape(*packed.shape[:-1], -1)[..., :size] - CODE_OFFSET
    return values.to(torch.int8).contiguous()


@dataclass(frozen=True)
class Int4Tensor:
    """One quantized weight as a checkpoint stores it."""

    packed: torch.Tensor  # int32 [N, ceil(K/8)]
    scale: torch.Tensor  # [N, K/g]
    zero_point: torch.Tensor | None  # int32 [ceil(N/8), K/g] (packed along rows), or None
    shape: tuple[int, int]  # (N, K)

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scale.shape[-1]

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of weight `name` (`<p>.weight`)."""
        import torch

        p = name.removesuffix("weight")
        out = {p + PACKED: self.packed, p + SCALE: self.scale}
        if self.zero_point is not None:
            out[p + ZERO_POINT] = self.zero_point
        out[p + SHAPE] = torch.tensor(self.shape, dtype=torch.int64)
        return out


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    # divide by tensors, not Python numbers: CUDA turns a division by a number into a
    # multiplication by its rounded reciprocal, which would put GPU bits off the host's
    import torch

    return torch.full((), value, dtype=torch.float32, device=like.device)


def quantize_int4(w: torch.Tensor, *, group_size: int, symmetric: bool,
                  scale_dtype: torch.dtype | None = None) -> Int4Tensor:
    """Quantize a 2-D weight [N, K] (K a multiple of `group_size`), in float32 on its device,
    packed as stored (the codes of `_quantize_codes`)."""
    q, scale, zp = _quantize_codes(w, group_size=group_size, symmetric=symmetric,
                                   scale_dtype=scale_dtype)
    return Int4Tensor(packed=pack_int4(q), scale=scale,
                      zero_point=None if zp is None else pack_int4(zp, dim=0), shape=tuple(q.shape))


def fake_quantize_int4(w: torch.Tensor, *, group_size: int, symmetric: bool,
                       scale_dtype: torch.dtype | None = None,
                       dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_int4(quantize_int4(w))` bit for bit, without packing the codes into int32
    words and unpacking them again (the trainer's INT4 QAT runs this in every forward)."""
    q, scale, zp = _quantize_codes(w, group_size=group_size, symmetric=symmetric,
                                   scale_dtype=scale_dtype)
    return _dequantize_codes(q, scale, zp, dtype=dtype)


def _quantize_codes(w: torch.Tensor, *, group_size: int, symmetric: bool,
                    scale_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor | None]:
    """The int8 codes [N, K], the scales [N, K / group_size] and the int8 zero points (None when
    symmetric) of a 2-D weight.

    Per row and group of columns (compressed-tensors' min-max observer, 0 always representable):
    symmetric: scale = max|w| / 7.5, zp = 0; asymmetric: lo = min(min w, 0), hi = max(max w, 0),
    scale = (hi - lo) / 15. The scale is rounded to `scale_dtype` (default: w's dtype) and a zero
    scale becomes that dtype's eps; with s that stored scale, zp = round(clamp(-8 - lo / s, -8, 7))
    and q = clamp(round(w / s + zp), -8, 7), rounding half to even. The same bits on any device.
    Raises CheckpointError for a weight holding inf or NaN.
    """
    import torch

    n, k = w.shape
    if k % group_size:
        raise BadInputError(f"in-features {k} is not a multiple of --group-size {group_size}")
    sdtype = scale_dtype or w.dtype
    g = w.to(torch.float32, copy=True).reshape(n, k // group_size, group_size)  # never modify w
    if symmetric:
        scale = g.abs().amax(dim=-1).div_(_const(7.5, w))
        lo = None
    else:
        lo = g.amin(dim=-1).clamp_(max=0.0)
        scale = g.amax(dim=-1).clamp_(min=0.0).sub_(lo).div_(_const(15.0, w))
    if not torch.isfinite(scale).all():
        raise CheckpointError("the weight holds inf or NaN values; its INT4 groups would be NaN")
    scale = scale.to(sdtype)
    scale = torch.where(scale == 0, torch.full((), torch.finfo(sdtype).eps, dtype=sdtype,
                                               device=w.device), scale)
    s = scale.to(torch.float32)
    x = g.div_(s.unsqueeze(-1))
    zp = None
    if lo is not None:
        zp = (_const(QMIN, w) - lo / s).clamp_(QMIN, QMAX).round_()
        x = x.add_(zp.unsqueeze(-1))
    q = x.round_().clamp_(QMIN, QMAX).to(torch.int8).reshape(n, k)
    return q, scale, None if zp is None else zp.to(torch.int8)


def dequantize_int4(t: Int4Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """`(q - zp) * scale` per group: one float32 product rounded to `dtype`. With dtype = the
    scale's dtype this is compressed-tensors' own dequantization bit for bit (for a bf16 or fp16
    scale the float32 product of it and a 5-bit integer is exact, so rounding it once equals
    multiplying in that dtype)."""

    n, k = t.shape
    zp = None if t.zero_point is None else unpack_int4(t.zero_point, n, dim=0)
    return _dequantize_codes(unpack_int4(t.packed, k), t.scale, zp, dtype=dtype)


def _dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, *,
                      dtype: torch.dtype) -> torch.Tensor:
    import torch

    n, k = q.shape
    groups = scale.shape[-1]
    x = q.view(n, groups, k // groups).to(torch.float32)
    if zp is not None:
        x = x - zp.to(torch.float32).unsqueeze(-1)
    return (x * scale.to(torch.float32).unsqueeze(-1)).reshape(n, k).to(dtype)


def quantize_state(tensors: dict[str, torch.Tensor], fmt: Int4Format
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The pack-quantized version of a state dict (HF names, as a checkpoint stores them), on the
    tensors' devices, and its quantization_config: what `rltool convert int4` writes for a
    checkpoint of these tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not fmt.quantizes(name, tuple(t.shape), floating=t.is_floating_point()):
            out[name] = t
            continue
        check_group(name, tuple(t.shape), fmt.group_size)
        try:
            q = quantize_int4(t, group_size=fmt.group_size, symmetric=fmt.symmetric)
        except CheckpointError as e:
            raise CheckpointError(f"{name}: {e}") from e
        out.update(q.tensors(name))
    return out, fmt.quantization_config()


def check_group(name: str, shape: tuple[int, ...], group_size: int) -> None:
    if shape[-1] % group_size:
        raise BadInputError(f"{name} has {shape[-1]} in-features, not a multiple of --group-size "
                            f"{group_size}; choose a group size that divides it, or --ignore "
                            "that module")


# ----- the convert commands -------------------------------------------------------------------

class Int4Config(StageConfig):
    """`rltool convert int4`: quantize an HF checkpoint to W4A16 (compressed-tensors
    pack-quantized)."""

    hf: Path = Field(description="Source HF checkpoint directory (bf16/fp16/fp32 safetensors).")
    out: Path = Field(description="New output directory (must not exist).")
    group_size: int = Field(default=DEFAULT_GROUP_SIZE, ge=1,
                            description="Columns per scale (slime's default).")
    symmetric: bool = Field(default=True, json_schema_extra=cli(option=False),
                            description="Symmetric groups (no zero point); false: asymmetric "
                            "(--symmetric/--asymmetric).")
    ignore: list[str] | None = Field(
        default=None, description="Modules left unquantized: 're:REGEX' or an exact module name, "
        "repeatable. Default: slime's list for MoE models (only expert linears are INT4: "
        "attention, dense/shared MLPs, norms, embeddings, lm_head and the router stay), every "
        "linear layer but lm_head for dense models.")
    workers: int = Field(default_factory=_default_workers, ge=1,
                         description="Worker threads (default: CPU count, at most 8).")
    verify: bool = Field(default=False,
                         description="Measure each tensor's relative dequantization error.")
    max_shard_mb: float = Field(default=5000.0, gt=0, description="Largest output shard, in MB.")

    @field_validator("ignore")
    @classmethod
    def _patterns(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else list(check_patterns(v))


def _quantize_job(info: st.TensorInfo, fmt: Int4Format,
                  errors: dict[str, float] | None) -> hf_writer.Job:
    import torch

    n, k = info.shape
    groups = k // fmt.group_size
    p = info.name.removesuffix("weight")
    outputs = [(p + PACKED, "I32", (n, -(-k // PER_WORD))), (p + SCALE, info.dtype, (n, groups))]
    if not fmt.symmetric:
        outputs.append((p + ZERO_POINT, "I32", (-(-n // PER_WORD), groups)))
    outputs.append((p + SHAPE, "I64", (2,)))

    def run() -> list[torch.Tensor]:
        w = st_read.read_tensor(info)
        try:
            q = quantize_int4(w, group_size=fmt.group_size, symmetric=fmt.symmetric)
        except CheckpointError as e:
            raise CheckpointError(f"{info.name}: {e}; fix the checkpoint before quantizing") \
                from e
        if errors is not None:
            errors[info.name] = relative_error(dequantize_int4(q, dtype=torch.float32), w)
        return list(q.tensors(info.name).values())

    return hf_writer.Job(outputs=outputs, run=run)


def quantize_checkpoint(cfg: Int4Config) -> dict[str, Any]:
    """Write `cfg.out` as the pack-quantized INT4 version of `cfg.hf`; return a summary."""
    started = time.perf_counter()
    out = hf_writer.check_new_output(cfg.out)
    config = hf_writer.read_config(cfg.hf)
    if config.get("quantization_config"):
        raise BadInputError(f"{cfg.hf} is already quantized "
                            f"({config['quantization_config'].get('quant_method')}); "
                            "run `rltool convert dequant` first")
    fmt = Int4Format(group_size=cfg.group_size, symmetric=cfg.symmetric,
                     ignore=tuple(cfg.ignore) if cfg.ignore is not None
                     else default_ignore(config))
    tensors = ckpt_io.checkpoint_tensors(cfg.hf)
    chosen = [i for i in tensors.values()
              if fmt.quantizes(i.name, tuple(i.shape), floating=i.dtype in _FLOAT_CODES)]
    for info in chosen:  # every refusal before anything is written
        check_group(info.name, tuple(info.shape), cfg.group_size)
    hf_writer.limit_heap_retention()
    errors: dict[str, float] | None = {} if cfg.verify else None
    quantized = {i.name for i in chosen}
    jobs = [_quantize_job(i, fmt, errors) if i.name in quantized else _copy_job(i)
            for i in tensors.values()]
    config["quantization_config"] = fmt.quantization_config()
    return _publish_quantized(cfg, out, jobs, config, tensors, errors, started,
                              quantized=len(quantized), group_size=cfg.group_size,
                              symmetric=cfg.symmetric, ignore=list(fmt.ignore))


def read_int4_tensor(infos: dict[str, Any], name: str, read: Any, *, where: str
                     ) -> Int4Tensor:
    """Weight `name`'s INT4 tensors (`infos`: the checkpoint's names; `read(name)` a tensor),
    their dtypes and shapes checked against each other and `weight_shape`."""
    import torch

    p = name.removesuffix("weight")
    packed, scale = read(p + PACKED), read(p + SCALE)
    zp = read(p + ZERO_POINT) if p + ZERO_POINT in infos else None
    shape = [int(v) for v in read(p + SHAPE).tolist()]
    ok = (packed.dtype == torch.int32 and packed.dim() == 2 and scale.is_floating_point()
          and len(shape) == 2 and scale.dim() == 2 and scale.shape[0] == shape[0]
          and packed.shape == (shape[0], -(-shape[1] // PER_WORD)) and scale.shape[1] > 0
          and shape[1] % scale.shape[1] == 0
          and (zp is None or (zp.dtype == torch.int32
                              and zp.shape == (-(-shape[0] // PER_WORD), scale.shape[1]))))
    if not ok:
        raise CheckpointError(f"{where}: the INT4 tensors of {name} do not fit together "
                              f"(weight_shape {shape}, packed {list(packed.shape)}, scale "
                              f"{list(scale.shape)}); restore the checkpoint")
    return Int4Tensor(packed=packed, scale=scale, zero_point=zp, shape=(shape[0], shape[1]))


def dequantize_checkpoint(cfg: DequantConfig) -> dict[str, Any]:
    """Write `cfg.out` as the dequantized version of the INT4 checkpoint `cfg.hf`."""
    import torch

    started = time.perf_counter()
    out = hf_writer.check_new_output(cfg.out)
    config = hf_writer.read_config(cfg.hf)
    fmt = read_format(config["quantization_config"], where=str(cfg.hf))
    dtype = getattr(torch, torch_dtype_name(cfg.dtype))
    tensors = ckpt_io.checkpoint_tensors(cfg.hf)
    hf_writer.limit_heap_retention()
    jobs = []
    for info in tensors.values():
        base, _, suffix = info.name.rpartition(".")
        if suffix in (SCALE, ZERO_POINT, SHAPE):
            if f"{base}.{PACKED}" not in tensors:
                raise CheckpointError(f"{info.name} has no matching {PACKED} in {cfg.hf}")
            continue
        if suffix != PACKED:
            jobs.append(_copy_job(info))
            continue
        name = base + ".weight"
        missing = [s for s in (SCALE, SHAPE) if f"{base}.{s}" not in tensors]
        if not fmt.symmetric and f"{base}.{ZERO_POINT}" not in tensors:
            missing.append(ZERO_POINT)
        if missing:
            raise CheckpointError(f"{info.name} lacks {', '.join(missing)} in {cfg.hf}")

        def run(name: str = name) -> list[torch.Tensor]:
            q = read_int4_tensor(tensors, name, lambda n: st_read.read_tensor(tensors[n]),
                                 where=str(cfg.hf))
            return [dequantize_int4(q, dtype=dtype)]

        shape = (info.shape[0], tensors[f"{base}.{SCALE}"].shape[1] * fmt.group_size)
        jobs.append(hf_writer.Job(outputs=[(name, st.dtype_code(dtype), shape)], run=run))
    return _publish_dequantized(cfg, out, jobs, config, started)
