"""INT4 quantization-aware training (`--int4-qat`, the torch backend): every forward of the
trainer's model runs the weights that `rltool convert int4` quantizes by default for this model
through fake INT4 quantization, so that the policy learns under the rounding the engine applies
to an INT4 checkpoint (slime's INT4 QAT).

Fake quantization is `fake_quantize_int4` of rltool.convert.int4 (the converter's own rounding,
`dequantize_int4(quantize_int4(w))` without packing the codes, so the weights a forward sees are
bit for bit those an engine dequantizes from the `convert int4` checkpoint of the same weights in
the compute dtype), with a straight-through
gradient: d fake(w) / dw = 1, the gradient of the loss with respect to the fake-quantized weight
goes to w unchanged. The parameters stay unquantized: the optimizer steps them, checkpoints and
published versions hold them (`[sync] precision = "int4"` quantizes them at publish).

Which weights: `Int4Format.quantizes` of the default format of the model's config (every linear
weight but lm_head for dense models; only the routed experts for MoE models), under their names
in the model, which are the checkpoint's. transformers' fused experts (a 3-D `experts.gate_up_proj`
[E, 2I, H] and `experts.down_proj` [E, H, I]) hold the checkpoint's per-expert `gate_proj`,
`up_proj` and `down_proj` weights row by row, and groups run along a row, so quantizing the
[E * rows, K] view is quantizing each expert's weights.

How: a forward pre-hook on each owning module puts the fake-quantized tensor in the parameter's
place for that module's forward, and a forward hook (also run when the forward raises) puts the
parameter back. Hooks, not a parametrization, so that parameter and state-dict names, the
optimizer's parameters and DDP / FSDP's views of them stay the ones of the plain model; activation
recomputation re-runs the hooks with the forward.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rltool.convert import int4
from rltool.errors import ConfigError

# transformers' fused expert parameters -> the checkpoint's per-expert linears they concatenate
# along the rows (the checkpoint names are `<experts>.<e>.<proj>.weight`).
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def qat_format(config: dict[str, Any], *, group_size: int, symmetric: bool) -> int4.Int4Format:
    """The format QAT mimics: `rltool convert int4 --group-size G [--asymmetric]` without
    `--ignore` for a model of this config.json."""
    return int4.Int4Format(group_size=group_size, symmetric=symmetric,
                           ignore=int4.default_ignore(config))


def fake_quantize(w: torch.Tensor, *, fmt: int4.Int4Format, dtype: torch.dtype) -> torch.Tensor:
    """w cast to `dtype`, quantized and dequantized as `rltool convert int4` quantizes a
    checkpoint in that dtype and an engine dequantizes it (rows of the last dimension; a 3-D
    fused expert tensor is its [E * rows, K] view). No gradient: see `straight_through`."""
    src = w.detach().to(dtype).reshape(-1, w.shape[-1])
    return int4.fake_quantize_int4(src, group_size=fmt.group_size, symmetric=fmt.symmetric,
                                   dtype=dtype).view(w.shape)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, fmt: int4.Int4Format,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.param_dtype = w.dtype
        return fake_quantize(w, fmt=fmt, dtype=dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.to(ctx.param_dtype), None, None


def straight_through(w: torch.Tensor, *, fmt: int4.Int4Format, dtype: torch.dtype
                     ) -> torch.Tensor:
    """`fake_quantize(w)` whose gradient with respect to w is the identity (cast back to w's
    dtype)."""
    return _StraightThrough.apply(w, fmt, dtype)


@dataclass(frozen=True)
class Target:
    """One fake-quantized parameter: `module.<attr>`, named `name` in the model."""

    module: torch.nn.Module
    attr: str
    name: str


def _named_direct_parameters(model: torch.nn.Module
                             ) -> Iterator[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    seen: set[int] = set()  # a tied weight once, under its first name (as named_parameters)
    for mname, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield mname, module, attr, p


def find_targets(model: torch.nn.Module, fmt: int4.Int4Format) -> list[Target]:
    """The parameters `rltool convert int4` in `fmt` would store INT4 for this model's
    checkpoint. Raises ConfigError, naming the tensor and the fix, for one whose in-features
    `fmt.group_size` does not divide, or a fused expert tensor of an unknown layout."""
    targets = []
    for mname, module, attr, p in _named_direct_parameters(model):
        name = f"{mname}.{attr}" if mname else attr
        floating = p.is_floating_point()
        if p.dim() == 3 and mname.rsplit(".", 1)[-1] == "experts":
            projs = FUSED_EXPERTS.get(attr)
            if projs is None:
                raise ConfigError(f"--int4-qat: {name} is a fused expert tensor of an unknown "
                                  "layout; train this model without --int4-qat")
            chosen = {fmt.quantizes(f"{mname}.0.{proj}.weight", tuple(p.shape[1:]),
                                    floating=floating) for proj in projs}
            if len(chosen) > 1:
                raise ConfigError(f"--int4-qat: {name} fuses linears of which only some are "
                                  "INT4 in the checkpoint; train without --int4-qat")
            if not chosen.pop():
                continue
        elif not fmt.quantizes(name, tuple(p.shape), floating=floating):
            continue
        if p.shape[-1] % fmt.group_size:
            raise ConfigError(f"--int4-qat-group-size {fmt.group_size}: {name} has "
                              f"{p.shape[-1]} in-features, not a multiple of it; choose a group "
                              "size that divides the in-features of every quantized weight")
        targets.append(Target(module=module, attr=attr, name=name))
    return targets


class Int4QAT:
    """The hooks that fake-quantize `targets` in every forward; `remove()` takes them away."""

    def __init__(self, targets: list[Target], *, fmt: int4.Int4Format, dtype: torch.dtype):
        self.fmt, self.dtype = fmt, dtype
        self.names = [t.name for t in targets]
        by_module: dict[torch.nn.Module, list[str]] = {}
        for t in targets:
            by_module.setdefault(t.module, []).append(t.attr)
        self._held: dict[int, dict[str, Any]] = {}
        self._hooks = []
        for module, attrs in by_module.items():
            self._hooks.append(module.register_forward_pre_hook(
                functools.partial(self._swap_in, tuple(attrs))))
            self._hooks.append(module.register_forward_hook(
                functools.partial(self._swap_out, tuple(attrs)), always_call=True))

    def _swap_in(self, attrs: tuple[str, ...], module: torch.nn.Module, _args: Any) -> None:
        # the parameter as the forward finds it (FSDP's unsharded one inside a sharded layer)
        held = {a: module._parameters[a] for a in attrs}
        self._held[id(module)] = held
        for a, p in held.items():
            module._parameters[a] = straight_through(p, fmt=self.fmt, dtype=self.dtype)

    def _swap_out(self, attrs: tuple[str, ...], module: torch.nn.Module, _args: Any,
                  _out: Any) -> None:
        held = self._held.pop(id(module), None)
        if held is not None:
            module._parameters.update(held)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def apply_int4_qat(model: torch.nn.Module, *, config: dict[str, Any], group_size: int,
                   symmetric: bool, dtype: torch.dtype) -> Int4QAT:
    """Fake-quantize, in every forward of `model` (a transformers causal LM, before any head of
    rltool's own is added), the weights `rltool convert int4 --group-size group_size` writes INT4
    for a checkpoint of it with `config` (its config.json), in the compute `dtype`."""
    fmt = qat_format(config, group_size=group_size, symmetric=symmetric)
    targets = find_targets(model, fmt)
    if not targets:
        raise ConfigError("--int4-qat: `rltool convert int4` would quantize no weight of this "
                          "model (its default ignore list leaves none); drop --int4-qat")
    return Int4QAT(targets, fmt=fmt, dtype=dtype)


def for_backend(model: Any, options: Any) -> Int4QAT | None:
    """The torch backend's QAT hooks on its transformers `model` as its BackendConfig `options`
    ask (None without --int4-qat); the compute dtype is --dtype's."""
    if not options.int4_qat:
        return None
    return apply_int4_qat(model, config=model.config.to_dict(),
                          group_size=options.int4_qat_group_size,
                          symmetric=options.int4_qat_symmetric,
                          dtype=torch.bfloat16 if options.dtype == "bf16" else torch.float32)
