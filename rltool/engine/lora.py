"""LoRA adapters in the builtin engine: PEFT's on-disk layout read into the engine's fused
layout, and the adapter compute inside the dense model's linears.

An adapter directory is PEFT's (docs/formats.md): `adapter_config.json` (peft_type LORA, r,
lora_alpha, target_modules) and `adapter_model.safetensors` with
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] per targeted
module. A linear then computes y = x W^T + scale * (x A^T) B^T with scale = lora_alpha / r, as
PEFT's LoRA layer does.

The engine fuses q/k/v into one projection and gate/up into another, so an adapter is kept per
fused linear: A stacked over the parts ([parts * R, in]), B block-diagonal ([out, parts * R]),
R being --max-lora-rank and every block zero beyond the adapter's rank. One x A^T B^T then gives
each part exactly its own module's update (the other blocks add zeros), and every adapter has the
same shapes: the device buffers the forward reads (`LoraLayers`, allocated once, read by the
CUDA graphs) take any adapter by a copy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rltool.engine.model_spec import ModelSpec
from rltool.errors import BadInputError
from rltool.io.hf_dir import ADAPTER_CONFIG as CONFIG_FILE
from rltool.io.hf_dir import ADAPTER_WEIGHTS as WEIGHTS_FILE

# transformers module name -> (the engine's fused linear, part index within it)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "down_proj": ("down", 0)}
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                 r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight")
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_lora_name(name: str) -> bool:
    """Whether a tensor name is a PEFT LoRA tensor (as a LoRA weight sync sends them)."""
    return name.endswith(LORA_SUFFIXES)


def is_adapter_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


@dataclass(frozen=True)
class LoraShapes:
    """The served model's fused linears, as the adapter buffers mirror them: (layer, key) ->
    (the parts' output sizes, input size)."""
    linears: dict[tuple[int, str], tuple[tuple[int, ...], int]]
    max_rank: int
    pin: bool = False  # host copies in pinned memory (a CUDA engine: asynchronous uploads)

    @classmethod
    def of(cls, s: ModelSpec, *, max_rank: int, sparse: frozenset[int],
           pin: bool = False) -> "LoraShapes":
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        h, inter = s.hidden_size, s.intermediate_size
        out: dict[tuple[int, str], tuple[tuple[int, ...], int]] = {}
        for i in range(s.num_layers):
            out[(i, "qkv")] = ((q, kv, kv), h)
            out[(i, "o")] = ((h,), q)
            if i not in sparse:  # a sparse MoE layer's experts take no adapter
                out[(i, "gate_up")] = ((inter, inter), h)
                out[(i, "down")] = ((h,), inter)
        return cls(linears=out, max_rank=max_rank, pin=pin)

    def empty(self, key: tuple[int, str], *, device: torch.device | str, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero A [parts * R, in] and B [out, parts * R] of one fused linear (pinned when
        `pin` and on the host)."""
        parts, fan_in = self.linears[key]
        width = len(parts) * self.max_rank
        pin = self.pin and torch.device(device).type == "cpu"
        return (torch.zeros(width, fan_in, device=device, dtype=dtype, pin_memory=pin),
                torch.zeros(sum(parts), width, device=device, dtype=dtype, pin_memory=pin))


@dataclass(frozen=True)
class Slot:
    """Where one checked PEFT tensor goes: fused linear `key`, matrix `which` ("A" or "B"),
    the part's block (`rows`, `cols`) in it, and the tensor's rank."""
    key: tuple[int, str]
    which: str
    rows: slice
    cols: slice
    rank: int


def locate(name: str, tensor: torch.Tensor, shapes: LoraShapes) -> Slot:
    """The block PEFT tensor `name` fills; BadInputError naming the problem when the name or
    shape does not fit the served model."""
    layer, module, which = parse_name(name)
    fused, part = MODULES[module]
    if (layer, fused) not in shapes.linears:
        raise BadInputError(f"LoRA tensor {name!r} targets no linear of the served model "
                            "(a layer it lacks, or a sparse MoE layer's experts)")
    parts, fan_in = shapes.linears[(layer, fused)]
    R = shapes.max_rank
    rank = tensor.shape[0] if which == "A" else tensor.shape[-1]
    want = (rank, fan_in) if which == "A" else (parts[part], rank)
    if tensor.dim() != 2 or tuple(tensor.shape) != want:
        raise BadInputError(f"LoRA tensor {name!r} has shape {list(tensor.shape)}, the served "
                            f"model expects {list(want)} (rank first for lora_A, last for "
                            "lora_B)")
    if rank > R:
        raise BadInputError(f"LoRA tensor {name!r} has rank {rank}, above --max-lora-rank "
                            f"{R}; restart the engine with --max-lora-rank {rank}")
    cols = slice(part * R, part * R + R)
    if which == "A":
        return Slot((layer, fused), which, cols, slice(None), rank)
    row = sum(parts[:part])
    return Slot((layer, fused), which, slice(row, row + parts[part]), cols, rank)


@dataclass
class LoraAdapter:
    """One adapter in the fused layout, on the host in the model dtype: (layer, key) -> (A, B)
    for the linears it targets. `tag` identifies this content for the prefix cache."""
    name: str
    path: str | None
    rank: int
    scaling: float
    tag: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cover: tuple[int, Any] | None = None  # `coverage` of the config it came with (None: none)

    def put(self, name: str, tensor: torch.Tensor, shapes: LoraShapes, dtype: torch.dtype) -> None:
        """Check one PEFT tensor (`locate`) and copy it into its block."""
        self.write(locate(name, tensor, shapes), tensor, shapes, dtype)

    def write(self, slot: Slot, tensor: torch.Tensor, shapes: LoraShapes,
              dtype: torch.dtype) -> None:
        """Copy a tensor `locate` checked into its block, in one copy from wherever it lives
        (cast to the adapter's dtype), and zero the block beyond its rank."""
        if slot.key not in self.weights:
            self.weights[slot.key] = shapes.empty(slot.key, device="cpu", dtype=dtype)
        a, b = self.weights[slot.key]
        block = (a if slot.which == "A" else b)[slot.rows, slot.cols]
        if slot.which == "A":
            block[:slot.rank].copy_(tensor)
            block[slot.rank:].zero_()
        else:
            block[:, :slot.rank].copy_(tensor)
            block[:, slot.rank:].zero_()


def parse_name(name: str) -> tuple[int, str, str]:
    """(layer, transformers module, "A" or "B") of a PEFT LoRA tensor name."""
    m = KEY.fullmatch(name)
    if m is None:
        raise BadInputError(f"tensor {name!r} is not a LoRA tensor the engine serves: it takes "
                            "base_model.model.model.layers.<i>.(self_attn|mlp).<q|k|v|o|gate|up|"
                            "down>_proj.lora_(A|B).weight")
    return int(m.group(1)), m.group(2), m.group(3)


def read_config(path: Path) -> Any:
    """The JSON of an adapter directory's adapter_config.json (unchecked: `check_config`)."""
    where = path / CONFIG_FILE
    try:
        return json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise BadInputError(f"{where}: not a readable adapter config ({e})") from e


def check_config(cfg: Any, *, where: str) -> tuple[int, float]:
    """(rank, scaling) of PEFT LoraConfig fields `cfg` (from disk, or a tensor sync's
    lora_config), refusing what the engine does not compute (DoRA, rsLoRA, per-module rank or
    alpha patterns, biases, fan-in-fan-out); the tensors say which modules it targets."""
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise BadInputError(f"{where}: peft_type must be LORA; save the adapter with PEFT's "
                            "LoraConfig")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not (isinstance(r, int) and r > 0 and isinstance(alpha, (int, float))):
        raise BadInputError(f"{where}: r must be a positive integer and lora_alpha a number")
    unsupported = [k for k in ("use_dora", "use_rslora", "fan_in_fan_out") if cfg.get(k)]
    unsupported += [k for k in ("rank_pattern", "alpha_pattern") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise BadInputError(f"{where}: {', '.join(unsupported)} not served by the builtin engine; "
                            "save a plain LoRA adapter (bias none, one rank and alpha)")
    return r, alpha / r


def coverage(cfg: dict[str, Any]) -> tuple[int, Any]:
    """What of the model an adapter of checked config `cfg` covers: its rank and target modules
    (a list in any order, or PEFT's regular expression). Adapters of one coverage fill the same
    blocks of the fused layout, so one replaces another block by block."""
    targets = cfg.get("target_modules")
    return cfg["r"], tuple(sorted(targets)) if isinstance(targets, list) else targets


def read_adapter(path: Path, *, name: str, tag: int, shapes: LoraShapes,
                 dtype: torch.dtype) -> LoraAdapter:
    """An adapter directory read into the fused layout, every tensor checked before it is kept;
    on any thread (it touches nothing the forward reads)."""
    from safetensors import safe_open

    cfg = read_config(path)
    rank, scaling = check_config(cfg, where=str(path / CONFIG_FILE))
    if rank > shapes.max_rank:
        raise BadInputError(f"{path}: adapter rank {rank} is above --max-lora-rank "
                            f"{shapes.max_rank}; restart the engine with --max-lora-rank {rank}")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise BadInputError(f"{path} has no {WEIGHTS_FILE}; save the adapter with PEFT's "
                            "save_pretrained (safetensors)")
    adapter = LoraAdapter(name=name, path=str(path), rank=rank, scaling=scaling, tag=tag,
                          cover=coverage(cfg))
    try:
        with safe_open(str(weights), framework="pt") as sf:
            tensors = {key: sf.get_tensor(key) for key in sf.keys()}
    except Exception as e:  # safetensors' own error types: one line for the client
        raise BadInputError(f"{weights}: unreadable adapter weights ({type(e).__name__}: {e}); "
                            "write them again with PEFT's save_pretrained") from e
    for key, tensor in tensors.items():
        adapter.put(key, tensor, shapes, dtype)
    return adapter


def cache_tokens(tokens: list[int], tag: int) -> list[int]:
    """The prefix cache's key for `tokens` computed under the adapter content `tag` (0: the base
    model): the first token id carries the tag, so the radix tree keeps each adapter's prefixes
    on paths of their own and a prefix never serves another adapter or the base."""
    if tag == 0 or not tokens:
        return tokens
    return [tokens[0] + (tag << 32)] + tokens[1:]


class LoraLayers:
    """The adapter the forward computes with: device buffers for every fused linear, padded to
    --max-lora-rank, and its scaling; allocated once with the model, rewritten in place by
    `load` (zeros: the base model, whose outputs the zero update leaves bit for bit).

    `exact` (the engine's deterministic mode without CUDA graphs): the forward computes each
    module's update apart, as the trainer's PEFT-numerics hook does (rltool.train.lora), from
    per-module copies at the adapter's own rank made at each switch, so its outputs equal the
    trainer's bit for bit; a stacked A's GEMM differs from the separate ones in the last bits.
    Otherwise the stacked pair, one GEMM each, in the fixed buffers the CUDA graphs read."""

    def __init__(self, shapes: LoraShapes, *, device: torch.device, dtype: torch.dtype,
                 exact: bool = False):
        self.shapes = shapes
        self.weights = {key: shapes.empty(key, device=device, dtype=dtype)
                        for key in shapes.linears}
        self.scaling = torch.zeros((), device=device, dtype=torch.float32)
        self.tag = 0
        self.exact = exact
        # exact: (layer, key) -> each part's (A [rank, in], B [out, rank]) and its scale
        self.modules: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.scale, self.rank = 0.0, 0

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())

    @torch.no_grad()
    def load(self, adapter: LoraAdapter | None) -> None:
        """Copy `adapter` (None: the base model) into the buffers: asynchronous from pinned
        host memory, in stream order before the next forward (a later copy, such as the next
        bucket of a sync, overwrites what an earlier one read mid-change)."""
        for key, (a, b) in self.weights.items():
            src = adapter.weights.get(key) if adapter is not None else None
            if src is None:
                a.zero_()
                b.zero_()
            else:
                a.copy_(src[0], non_blocking=True)
                b.copy_(src[1], non_blocking=True)
        self.scaling.fill_(adapter.scaling if adapter is not None else 0.0)
        self.tag = adapter.tag if adapter is not None else 0
        if self.exact:
            self.modules = self._split(adapter, adapter.weights) if adapter is not None else {}
            self.scale = adapter.scaling if adapter is not None else 0.0
            self.rank = adapter.rank if adapter is not None else 0

    @torch.no_grad()
    def update(self, adapter: LoraAdapter, keys: set[tuple[int, str]]) -> None:
        """`adapter` into buffers that hold it but for the fused linears `keys`, which alone
        are copied (a sync's bucket; `load` otherwise)."""
        for key in keys:
            for dst, src in zip(self.weights[key], adapter.weights[key]):
                dst.copy_(src, non_blocking=True)
        self.scaling.fill_(adapter.scaling)
        self.tag = adapter.tag
        if self.exact:
            if adapter.rank != self.rank:  # every module's copy is cut at the rank
                self.modules, self.rank = self._split(adapter, adapter.weights), adapter.rank
            else:
                self.modules = {**self.modules, **self._split(adapter, keys)}
            self.scale = adapter.scaling

    def _split(self, adapter: LoraAdapter, keys: Iterable[tuple[int, str]]
               ) -> dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each part's A and B of `adapter`'s fused linears `keys` at its rank, contiguous on
        the device."""
        R, r = self.shapes.max_rank, adapter.rank
        out = {}
        for key in keys:
            a, b = adapter.weights[key]
            parts, rows = self.shapes.linears[key][0], 0
            out[key] = []
            for i, n in enumerate(parts):
                device = self.scaling.device
                out[key].append((a[i * R:i * R + r].to(device, copy=True).contiguous(),
                                 b[rows:rows + n, i * R:i * R + r].to(device, copy=True)
                                 .contiguous()))
                rows += n
        return out

    def add(self, layer: int, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + scale * (x A^T) B^T for fused linear `key` of `layer` (PEFT's order of ops)."""
        if self.exact:
            parts = self.modules.get((layer, key))
            if parts is None:
                return y
            update = torch.cat([F.linear(F.linear(x, a), b) for a, b in parts], dim=-1)
            return y + update * self.scale
        ab = self.weights.get((layer, key))
        if ab is None:
            return y
        return y + F.linear(F.linear(x, ab[0]), ab[1]) * self.scaling
