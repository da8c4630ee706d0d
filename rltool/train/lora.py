"""LoRA on the torch backend's transformers model (`--lora-rank R`): low-rank adapters on the
frozen base, in PEFT's numerics and on-disk layout, so that PEFT, vLLM and SGLang load what the
trainer publishes.

A target linear y = W x + b gets two children, `lora_A` (nn.Linear in -> r, no bias) and
`lora_B` (r -> out, no bias), and a forward hook that adds `lora_B(lora_A(dropout(x))) * scale`
to its output, scale = lora_alpha / r: PEFT's `LoraLayer.forward`, the same operations in the
same order. lora_A starts Kaiming-uniform (a = sqrt(5), PEFT's default), lora_B at zero, so the
first forward is the base's. Children and a hook, not a wrapper module, so that the base's
parameter and state-dict names stay the plain model's (`model.layers.0.self_attn.q_proj.weight`)
and the adapter's are PEFT's without its prefix (`...q_proj.lora_A.weight`); INT4 QAT's hooks
on the same module (rltool.train.int4_qat) and activation recomputation keep working.

The base is frozen (requires_grad False): only the adapters get gradients and optimizer state.
`disabled()` turns every adapter off for a forward: the base model, which is the KL reference
under LoRA (no second copy of the base).

On disk (docs/formats.md, "LoRA adapter"): `adapter_config.json` + `adapter_model.safetensors`
with keys `base_model.model.<module path>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r].
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rltool import atomic
from rltool.errors import CheckpointError, ConfigError
from rltool.io.hf_dir import ADAPTER_CONFIG as CONFIG_FILE
from rltool.io.hf_dir import ADAPTER_WEIGHTS as WEIGHTS_FILE

ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_key(name: str) -> bool:
    return name.endswith(SUFFIXES)


def target_paths(model: torch.nn.Module, targets: list[str], *, defaults: bool) -> list[str]:
    """Module paths of the nn.Linear modules that get adapters: those whose last name component
    is in `targets`, or every linear but the output embedding for `all-linear`. A named target
    that matches no linear is refused (with the defaults, only when none matches: a model may
    lack some of them), naming the linears the model has."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [(path, m) for path, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and m is not output]
    names = sorted({path.rsplit(".", 1)[-1] for path, _ in linears})
    if targets == [ALL_LINEAR]:
        found = [path for path, _ in linears]
    else:
        found = [path for path, _ in linears if path.rsplit(".", 1)[-1] in targets]
        missing = [t for t in targets if t not in names]
        if missing and (not defaults or not found):
            raise ConfigError(f"--lora-target-modules {','.join(missing)}: no linear module of "
                              f"this model has that name; it has {','.join(names)} (or pass "
                              f"{ALL_LINEAR})")
    if not found:
        raise ConfigError("--lora-target-modules: this model has no linear module to adapt")
    return found


class LoRA:
    """The adapters of one model (see the module docstring). `paths`: the target modules."""

    def __init__(self, model: torch.nn.Module, *, rank: int, alpha: float, dropout: float,
                 targets: list[str], defaults: bool = False, seed: int = 0):
        """`seed`: lora_A's initial values, the same on every rank (FSDP shards each rank's own
        values; DDP would broadcast rank 0's) and apart from torch's global stream."""
        if rank < 1:
            raise ConfigError(f"--lora-rank {rank}: a LoRA rank is >= 1")
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scale = alpha / rank
        self.targets = targets
        self.paths = target_paths(model, targets, defaults=defaults)
        self.enabled = True
        model.requires_grad_(False)
        generator = torch.Generator().manual_seed(seed)
        for path in self.paths:
            linear = model.get_submodule(path)
            # fp32 on the host (the generator's device): the backend moves the model after
            a = torch.nn.Linear(linear.in_features, rank, bias=False, device="meta")
            b = torch.nn.Linear(rank, linear.out_features, bias=False, device="meta")
            a.weight = torch.nn.Parameter(torch.empty(rank, linear.in_features))
            b.weight = torch.nn.Parameter(torch.zeros(linear.out_features, rank))
            torch.nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5), generator=generator)
            linear.add_module("lora_A", a)
            linear.add_module("lora_B", b)
            linear.add_module("lora_dropout", torch.nn.Dropout(dropout) if dropout
                              else torch.nn.Identity())
            linear.register_forward_hook(self._add_update)

    def _add_update(self, module: torch.nn.Module, args: tuple[Any, ...],
                    output: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return output
        x = args[0].to(module.lora_A.weight.dtype)
        return (output + module.lora_B(module.lora_A(module.lora_dropout(x))) * self.scale
                ).to(output.dtype)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Every adapter off: forwards run the base model."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def peft_config(self, base_model_dir: str | os.PathLike) -> dict[str, Any]:
        """adapter_config.json: PEFT's LoraConfig fields for these adapters."""
        modules = sorted({path.rsplit(".", 1)[-1] for path in self.paths})
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank,
                "lora_alpha": alpha, "lora_dropout": self.dropout,
                "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
                "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
                "base_model_name_or_path": str(Path(base_model_dir).resolve())}

    def check_config(self, config: dict[str, Any], *, where: Path,
                     base_model_dir: str | os.PathLike) -> None:
        """Refuse an adapter_config.json other than these adapters' (the fields that change
        what the adapter computes), naming the flags that would match it."""
        own = self.peft_config(base_model_dir)
        fields = ("peft_type", "r", "lora_alpha", "target_modules", "bias", "use_rslora",
                  "fan_in_fan_out")
        got = {k: sorted(v) if k == "target_modules" and isinstance(v, list) else v
               for k, v in config.items() if k in fields}
        if config.get("use_dora") or config.get("modules_to_save"):
            got["use_dora/modules_to_save"] = True
        differs = [k for k in (*fields, "use_dora/modules_to_save") if got.get(k) != own.get(k)]
        if differs:
            raise CheckpointError(
                f"{where}: a LoRA adapter with {differs[0]} {got.get(differs[0])!r}, these "
                f"adapters have {own.get(differs[0])!r}; for a plain LoRA adapter (no bias, "
                "rsLoRA, DoRA or extra modules) pass --lora-rank "
                f"{config.get('r')} --lora-alpha {config.get('lora_alpha')} "
                f"--lora-target-modules {','.join(map(str, config.get('target_modules') or []))}")

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records to refuse a resume under other adapters."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": self.targets}


def peft_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a model state dict, under PEFT's saved names."""
    return {PEFT_PREFIX + k: v for k, v in state.items() if is_adapter_key(k)}


def model_tensors(peft: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's saved names -> the model's (the inverse of `peft_tensors`)."""
    odd = [k for k in peft if not k.startswith(PEFT_PREFIX)]
    if odd:
        raise CheckpointError(f"LoRA adapter tensor {odd[0]!r} is not named {PEFT_PREFIX}<module "
                              "path>...: not an adapter of a causal LM in PEFT's layout")
    return {k[len(PEFT_PREFIX):]: v for k, v in peft.items()}


def merged(state: Mapping[str, torch.Tensor], *, scale: float) -> dict[str, torch.Tensor]:
    """The full HF state of base + adapters: each adapted W becomes W + scale * (B @ A) (in
    float32, cast back to W's dtype); the adapter tensors are left out."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):
            module = key[:-len(".lora_A.weight")]
            w, b = out[module + ".weight"], state[module + ".lora_B.weight"]
            out[module + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def write_adapter(out: Path, *, tensors: Mapping[str, torch.Tensor], config: dict[str, Any],
                  dtype: torch.dtype = torch.float32) -> None:
    """Fill the directory `out` with the PEFT adapter: its config and the tensors (model names,
    cast to `dtype`), each file written atomically."""
    from safetensors.torch import save_file

    atomic.write_json(out / CONFIG_FILE, config)
    with atomic.atomic_path(out / WEIGHTS_FILE) as part:
        save_file({k: v.detach().to("cpu", dtype).contiguous()
                   for k, v in peft_tensors(tensors).items()}, str(part))


def publish_adapter(final: Path, *, tensors: Mapping[str, torch.Tensor],
                    config: dict[str, Any], dtype: torch.dtype = torch.float32) -> Path:
    """A LoRA policy version: the directory `final` with exactly the adapter's two files, built
    under a temporary name and renamed (never replacing one)."""
    if final.exists():
        raise CheckpointError(f"{final} already exists; a published version is never replaced")
    with atomic.publish_dir(final) as tmp:
        write_adapter(tmp, tensors=tensors, config=config, dtype=dtype)
    return final


def read_adapter(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, the tensors under the model's names) of an adapter directory."""
    from safetensors.torch import load_file

    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
        tensors = load_file(str(directory / WEIGHTS_FILE))
    except Exception as e:  # OSError, JSON's ValueError, safetensors' own SafetensorError
        raise CheckpointError(f"{directory}: unreadable LoRA adapter ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{directory / CONFIG_FILE}: not a JSON object (PEFT's LoraConfig)")
    try:
        return config, model_tensors(tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: {e}") from e


def for_backend(model: torch.nn.Module, options: Any) -> LoRA | None:
    """The adapters `options` (a BackendConfig) asks for on `model`, or None with LoRA off."""
    if not options.lora_rank:
        return None
    from rltool.train.config import LORA_DEFAULT_TARGETS

    return LoRA(model, rank=options.lora_rank, alpha=options.lora_alpha_value,
                dropout=options.lora_dropout, targets=list(options.lora_target_modules),
                defaults=tuple(options.lora_target_modules) == LORA_DEFAULT_TARGETS,
                seed=options.seed)
