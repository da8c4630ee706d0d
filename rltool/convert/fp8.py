"""Block-wise FP8 (DeepSeek-V3 style) quantization of HF checkpoints, and its inverse.

Format (what SGLang / vLLM load, what slime writes; docs/formats.md):
a quantized linear weight `<p>.weight` [N, K] becomes float8_e4m3fn of the same shape plus
`<p>.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)]. Per block: scale = max(|w|, 1e-12) / 448
in fp32, q = clamp(w / scale, ±448) cast to e4m3, and dequantization is `q.float() * scale_inv` (the
stored value is the multiplier despite its name). Edge blocks use only their real elements; an
all-zero block gets scale 1e-12/448 and q = 0, never NaN. Embeddings, lm_head, norms, router/gate
weights, biases and other non-2-D tensors keep their dtype.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator

from rltool.config import StageConfig, WeightDtype, torch_dtype_name
from rltool.convert import fp8_native, hf_writer
from rltool.io import checkpoint as ckpt_io
from rltool.io import header as st
from rltool.io import reader as st_read
from rltool.errors import BadInputError, CheckpointError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

E4M3_MAX = 448.0
SCALE_FLOOR = 1e-12
# Substrings of tensor names never quantized (slime's list): embeddings, heads, norms, MoE routers,
# and special projections of MTP / linear-attention layers.
SKIP_SUBSTRINGS = ("norm", "embed", "router", "mlp.gate.", "lm_head", "eh_proj", "weights_proj",
                   "conv1d", "A_log", "dt_bias", "in_proj_a", "in_proj_b")
_FLOAT_CODES = ("F32", "F16", "BF16")
SCALE_SUFFIX = "_scale_inv"


def _default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class Fp8Config(StageConfig):
    """`rltool convert fp8`: quantize an HF checkpoint to block-wise FP8."""

    hf: Path = Field(description="Source HF checkpoint directory (bf16/fp16/fp32 safetensors).")
    out: Path = Field(description="New output directory (must not exist).")
    block: tuple[int, int] = Field(default=(128, 128), description="Block size [rows, cols].")
    workers: int = Field(default_factory=_default_workers, ge=1,
                         description="Worker threads (default: CPU count, at most 8).")
    verify: bool = Field(default=False,
                         description="Measure each tensor's relative dequantization error.")
    max_shard_mb: float = Field(default=5000.0, gt=0, description="Largest output shard, in MB.")

    @field_validator("block")
    @classmethod
    def _positive_block(cls, v: tuple[int, int]) -> tuple[int, int]:
        if v[0] < 1 or v[1] < 1:
            raise ValueError("block sizes must be positive, e.g. --block 128 128")
        return v


class DequantConfig(StageConfig):
    """`rltool convert dequant`: turn a block-FP8 checkpoint back into bf16 (or fp32)."""

    hf: Path = Field(description="Source block-FP8 HF checkpoint directory.")
    out: Path = Field(description="New output directory (must not exist).")
    dtype: WeightDtype = Field(default="bf16", description="dtype of the dequantized weights.")
    workers: int = Field(default_factory=_default_workers, ge=1,
                         description="Worker threads (default: CPU count, at most 8).")
    max_shard_mb: float = Field(default=5000.0, gt=0, description="Largest output shard, in MB.")


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a float tensor of this name and shape is quantized (2-D weights, not skipped)."""
    return (name.endswith(".weight") and len(shape) == 2
            and not any(s in name for s in SKIP_SUBSTRINGS))


def should_quantize(info: st.TensorInfo) -> bool:
    return info.dtype in _FLOAT_CODES and quantizable(info.name, info.shape)


def quantization_config(block: tuple[int, int], not_converted: list[str]) -> dict[str, Any]:
    """config.json's quantization_config of a block-FP8 checkpoint."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": sorted(not_converted)}


def quantize_state(tensors: dict[str, torch.Tensor], block: tuple[int, int], *,
                   workers: int | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The block-FP8 version of a state dict (HF names, float tensors, as a checkpoint stores
    them): what `rltool convert fp8` writes for a checkpoint of these tensors, and its
    quantization_config. `workers` threads (default: CPU count, at most 8; the native kernel
    releases the GIL). Raises CheckpointError for a weight holding inf or NaN."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    quantized = [n for n, t in tensors.items()
                 if t.is_floating_point() and quantizable(n, tuple(t.shape))]
    with ThreadPoolExecutor(workers or _default_workers()) as pool:
        results = dict(zip(quantized, pool.map(lambda n: quantize_blocks(tensors[n], block),
                                               quantized)))
    out: dict[str, torch.Tensor] = {}
    skipped = []
    for name, t in tensors.items():
        if name not in results:
            if name.endswith(".weight") and t.dim() == 2:
                skipped.append(name.removesuffix(".weight"))
            out[name] = t
            continue
        q, scale = results[name]
        if not torch.isfinite(scale).all():
            raise CheckpointError(f"{name} holds inf or NaN values; its FP8 blocks would be NaN")
        out[name], out[name + SCALE_SUFFIX] = q, scale
    return out, quantization_config(block, skipped)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def _pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] -> [nb, bn, kb, bk], zero-padded (zeros never change a block's max |w|)."""
    n, k = w.shape
    nb, kb = scale_shape(w.shape, block)
    if (n, k) != (nb * block[0], kb * block[1]):
        padded = w.new_zeros(nb * block[0], kb * block[1])
        padded[:n, :k] = w
        w = padded
    return w.view(nb, block[0], kb, block[1])


def quantize_blocks(w: torch.Tensor, block: tuple[int, int], *,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight: (q float8_e4m3fn [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]).

    The native kernel (csrc/fp8.c, ~3x faster per core, no GIL) when it is built and takes `w`
    (a CPU bf16/fp16/fp32 tensor), else `quantize_blocks_torch`; both give the same bits.
    `out`: an optional float8_e4m3fn [N, K] tensor to write q into.
    """
    result = fp8_native.quantize(w, block, out=out)
    return result if result is not None else quantize_blocks_torch(w, block, out=out)


def quantize_blocks_torch(w: torch.Tensor, block: tuple[int, int], *,
                          out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch implementation (any device, any float dtype). On CPU one row of blocks at a time
    so the fp32 temporaries stay in cache (about 2x faster than whole-tensor ops there); on
    another device `quantize_blocks_whole`, whose scales stay on that device. Same bits."""
    import torch

    if w.device.type != "cpu":
        return quantize_blocks_whole(w, block, out=out)
    n, k = w.shape
    bn, bk = block
    nb, kb = scale_shape(w.shape, block)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device) if out is None else out
    scale = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        rows = w[i * bn:(i + 1) * bn].to(torch.float32, copy=True)  # never modify the input
        if k != kb * bk:  # zero padding never changes a block's max |w|
            rows = torch.nn.functional.pad(rows, (0, kb * bk - k))
        blocks = rows.view(rows.shape[0], kb, bk)
        s = blocks.abs().amax(dim=(0, 2)).clamp_(min=SCALE_FLOOR).div_(E4M3_MAX)
        scale[i] = s
        blocks.div_(s[None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
        q[i * bn:(i + 1) * bn] = rows[:, :k]  # the cast to e4m3 rounds to nearest even
    return q, scale


def quantize_blocks_whole(w: torch.Tensor, block: tuple[int, int], *,
                          out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_blocks_torch` over the whole tensor at once: a handful of kernels per weight on
    a GPU (the row-at-a-time loop launches several per row of blocks and copies each row's
    scales to the host), the same fp32 operations per element, so the same bits. q and the
    scales are on `w`'s device."""
    import torch

    n, k = w.shape
    blocks = _pad_to_blocks(w.to(torch.float32, copy=True), block)  # never modify the input
    # divided by a tensor: CUDA turns a division by a Python number into a multiplication by its
    # rounded reciprocal, which puts some scales one ulp off the host's
    e4m3_max = torch.full((), E4M3_MAX, device=w.device)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_(min=SCALE_FLOOR).div_(e4m3_max)
    blocks.div_(scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device) if out is None else out
    q.copy_(blocks.view(blocks.shape[0] * block[0], -1)[:n, :k])  # rounds to nearest even
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *,
                      dtype: torch.dtype) -> torch.Tensor:
    """`q.float() * scale_inv` per block, in `dtype`: the native kernel for CPU float32 / bfloat16
    outputs when built, else `dequantize_blocks_torch` (same bits for every non-NaN value)."""
    result = fp8_native.dequantize(q, scale_inv, block, dtype=dtype)
    return result if result is not None else dequantize_blocks_torch(q, scale_inv, block,
                                                                     dtype=dtype)


def dequantize_blocks_torch(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *,
                            dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    blocks = _pad_to_blocks(q.float(), block)
    w = (blocks * scale_inv[:, None, :, None].float()).view(blocks.shape[0] * block[0],
                                                           blocks.shape[2] * block[1])
    return w[:n, :k].to(dtype).contiguous()


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| in float64 (0 for an all-zero exact tensor that is matched)."""
    diff = (approx.double() - exact.double()).norm().item()
    ref = exact.double().norm().item()
    return diff / ref if ref > 0 else diff


def _quantize_job(info: st.TensorInfo, block: tuple[int, int],
                  errors: dict[str, float] | None, pool: hf_writer.BufferPool) -> hf_writer.Job:
    import torch

    def run() -> list[torch.Tensor]:
        w = st_read.read_tensor(info)
        q, scale = quantize_blocks(w, block, out=pool.take(info.shape, torch.float8_e4m3fn))
        if not torch.isfinite(scale).all():  # a block's max |w| is inf or NaN
            raise CheckpointError(f"{info.name} holds inf or NaN values; fix the checkpoint "
                                  "before quantizing (its FP8 blocks would be NaN)")
        if errors is not None:
            deq = dequantize_blocks(q, scale, block, dtype=torch.float32)
            errors[info.name] = relative_error(deq, w)
        return [q, scale]

    return hf_writer.Job(outputs=[(info.name, "F8_E4M3", info.shape),
                                  (info.name + SCALE_SUFFIX, "F32", scale_shape(info.shape, block))],
                         run=run, release=lambda tensors: pool.give(tensors[0]))


def _copy_job(info: st.TensorInfo) -> hf_writer.Job:
    return hf_writer.Job(outputs=[(info.name, info.dtype, info.shape)],
                         run=lambda: [st_read.read_tensor(info)])


def _publish_quantized(cfg: Any, out: Path, jobs: list[hf_writer.Job], config: dict[str, Any],
                       tensors: dict[str, st.TensorInfo], errors: dict[str, float] | None,
                       started: float, **summary: Any) -> dict[str, Any]:
    """Write a quantize run's checkpoint; its summary (`summary`'s keys after out and tensors),
    with the relative errors when verified."""
    written = hf_writer.publish_checkpoint(out, jobs, config=config, side_files_from=cfg.hf,
                                           stage_config=cfg, workers=cfg.workers,
                                           max_shard_mb=cfg.max_shard_mb)
    result = {"out": str(out), "tensors": len(tensors), **summary,
              "bytes_in": sum(i.nbytes for i in tensors.values()),
              "bytes_out": written["total_size"], "files": written["files"],
              "seconds": round(time.perf_counter() - started, 3)}
    if errors is not None:
        result["relative_error"] = dict(sorted(errors.items()))
        result["max_relative_error"] = max(errors.values(), default=0.0)
    return result


def _publish_dequantized(cfg: DequantConfig, out: Path, jobs: list[hf_writer.Job],
                         config: dict[str, Any], started: float) -> dict[str, Any]:
    """Write a dequantize run's checkpoint, its config without quantization_config and with
    cfg.dtype; its summary."""
    del config["quantization_config"]
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = torch_dtype_name(cfg.dtype)
    written = hf_writer.publish_checkpoint(out, jobs, config=config, side_files_from=cfg.hf,
                                           stage_config=cfg, workers=cfg.workers,
                                           max_shard_mb=cfg.max_shard_mb)
    return {"out": str(out), "tensors": len(jobs), "bytes_out": written["total_size"],
            "files": written["files"], "seconds": round(time.perf_counter() - started, 3)}


def quantize_checkpoint(cfg: Fp8Config) -> dict[str, Any]:
    """Write `cfg.out` as the block-FP8 version of `cfg.hf`; return a summary (and errors if verify)."""
    started = time.perf_counter()
    out = hf_writer.check_new_output(cfg.out)
    config = hf_writer.read_config(cfg.hf)
    if config.get("quantization_config"):
        raise BadInputError(f"{cfg.hf} is already quantized ({config['quantization_config']}); "
                            "run `rltool convert dequant` first")
    tensors = ckpt_io.checkpoint_tensors(cfg.hf)
    hf_writer.limit_heap_retention()
    errors: dict[str, float] | None = {} if cfg.verify else None
    jobs, skipped_modules = [], []
    pool = hf_writer.BufferPool()
    for info in tensors.values():
        if should_quantize(info):
            jobs.append(_quantize_job(info, cfg.block, errors, pool))
        else:
            if info.name.endswith(".weight") and len(info.shape) == 2:
                skipped_modules.append(info.name.removesuffix(".weight"))
            jobs.append(_copy_job(info))
    config["quantization_config"] = quantization_config(cfg.block, skipped_modules)
    return _publish_quantized(cfg, out, jobs, config, tensors, errors, started,
                              quantized=sum(len(j.outputs) == 2 for j in jobs))


def _dequant_job(weight: st.TensorInfo, scale: st.TensorInfo, block: tuple[int, int],
                 dtype: torch.dtype) -> hf_writer.Job:
    def run() -> list[torch.Tensor]:
        return [dequantize_blocks(st_read.read_tensor(weight), st_read.read_tensor(scale), block,
                                  dtype=dtype)]

    return hf_writer.Job(outputs=[(weight.name, st.dtype_code(dtype), weight.shape)], run=run)


def dequantize_checkpoint(cfg: DequantConfig) -> dict[str, Any]:
    """Write `cfg.out` as the dequantized version of the block-FP8 checkpoint `cfg.hf`."""
    import torch

    started = time.perf_counter()
    out = hf_writer.check_new_output(cfg.out)
    config = hf_writer.read_config(cfg.hf)
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8" or "weight_block_size" not in qc:
        raise BadInputError(f"{cfg.hf} is not a block-FP8 checkpoint (config.json has no "
                            "quantization_config with quant_method fp8 and weight_block_size)")
    block = tuple(qc["weight_block_size"])
    dtype = getattr(torch, torch_dtype_name(cfg.dtype))
    tensors = ckpt_io.checkpoint_tensors(cfg.hf)
    hf_writer.limit_heap_retention()
    jobs = []
    for info in tensors.values():
        if info.name.endswith(SCALE_SUFFIX):
            if info.name.removesuffix(SCALE_SUFFIX) not in tensors:
                raise CheckpointError(f"{info.name} has no matching weight in {cfg.hf}")
            continue
        if info.dtype != "F8_E4M3":
            jobs.append(_copy_job(info))
            continue
        scale = tensors.get(info.name + SCALE_SUFFIX)
        if scale is None or len(info.shape) != 2:
            raise CheckpointError(f"FP8 tensor {info.name} has no {SCALE_SUFFIX} companion")
        if scale.shape != scale_shape(info.shape, block) or scale.dtype != "F32":
            raise CheckpointError(
                f"{scale.name} is {scale.dtype}{list(scale.shape)}, expected "
                f"F32{list(scale_shape(info.shape, block))} for block {list(block)}")
        jobs.append(_dequant_job(info, scale, block, dtype))
    return _publish_dequantized(cfg, out, jobs, config, started)
