"""LoRA RL in the loop: with `[train] lora_rank > 0` (and not `lora_merge_on_publish`) a policy
version is the trainer's adapter, and every sync moves the adapter only.

The engines serve the frozen base (version 0, loaded once at start) with `--enable-lora
--max-lora-rank R` (R >= the rank; the loop adds both flags to its own engines and refuses
external ones whose /get_server_info says otherwise), and each sync replaces their policy
adapter, the one requests without `lora_path` run:

  disk     weight_vNNNNNN/ is a PEFT adapter directory (adapter_config.json,
           adapter_model.safetensors, the version marker), loaded by /update_weights_from_disk.
  delta    a delta of the adapter on the previous adapter version (rltool.delta), which
           /pull_weights materialises bit for bit before the engine loads the directory. The
           first adapter version is full: its base, version 0, is the base model, which shares
           no tensor with an adapter.
  tensor   the adapter's tensors under PEFT's names (`base_model.model.<module>.lora_A.weight`)
           through the in-memory transport (shared memory, CUDA IPC, a gloo broadcast or the
           in-process engine's copy), each bucket with the adapter's config (`tensor_config`:
           r, lora_alpha, target_modules), from which the engine takes the scale lora_alpha / r
           and, when r or target_modules differ from its policy adapter's (an engine that served
           another run), starts that adapter afresh.

Every mode replaces the engine's policy adapter exactly: nothing of an adapter of a larger rank or
more target modules stays (docs/serve.md, "LoRA adapters").
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltool.errors import BadInputError, ConfigError

if TYPE_CHECKING:
    from rltool.loop.config import LoopSettings

def is_adapter_run(settings: LoopSettings) -> bool:
    """Whether the run's versions are LoRA adapters (not merged full weights)."""
    train = settings.train
    return train.lora_rank > 0 and not train.lora_merge_on_publish


def engine_args(settings: LoopSettings, args: list[str]) -> list[str]:
    """`args` with `--enable-lora` and `--max-lora-rank <rank>` added for an adapter run (a
    --max-lora-rank of the user's is kept: check_settings refused one below the rank)."""
    if not is_adapter_run(settings):
        return args
    out = list(args)
    if "--enable-lora" not in out:
        out.append("--enable-lora")
    if _max_lora_rank(out) is None:
        out += ["--max-lora-rank", str(settings.train.lora_rank)]
    return out


def _max_lora_rank(args: list[str]) -> int | None:
    """The `--max-lora-rank N` (or `--max-lora-rank=N`) of engine arguments, None when absent."""
    for i, arg in enumerate(args):
        if arg == "--max-lora-rank" or arg.startswith("--max-lora-rank="):
            value = arg.partition("=")[2] or (args[i + 1] if i + 1 < len(args) else "")
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"[loop] engine_args --max-lora-rank {value!r} is not an "
                                  "integer: give the adapter rank the engines allow") from None
    return None


def check_settings(settings: LoopSettings) -> None:
    """The loop-level refusals of an adapter run (ConfigError naming the fix)."""
    if not is_adapter_run(settings):
        return
    train, args = settings.train, list(settings.loop.engine_args)
    rank = train.lora_rank
    served = _max_lora_rank(args)
    if served is not None and served < rank:
        raise ConfigError(f"[loop] engine_args --max-lora-rank {served} is below [train] "
                          f"lora_rank {rank}: raise it to {rank} or drop it (the loop sets it)")
    if settings.sync.precision in ("fp8", "int4"):
        raise ConfigError(f"[sync] precision {settings.sync.precision} quantizes full weights, "
                          "a LoRA version is its adapter: drop precision or set [train] "
                          "lora_merge_on_publish = true")


def check_server_info(url: str, info: dict[str, Any], *, rank: int) -> None:
    """Refuse an external engine that cannot serve the run's adapters (BadInputError)."""
    if info.get("engine") != "builtin":
        raise BadInputError(f"engine {url} is not rltool's builtin engine, which alone takes an "
                            "adapter by a weight sync: set [train] lora_merge_on_publish = true")
    if not info.get("enable_lora"):
        raise BadInputError(f"engine {url} serves without LoRA and [train] lora_rank is {rank}: "
                            f"restart it with --enable-lora --max-lora-rank {rank}, or set "
                            "[train] lora_merge_on_publish = true")
    served = info.get("max_lora_rank")
    if not isinstance(served, int) or served < rank:
        raise BadInputError(f"engine {url} serves LoRA ranks up to {served}, [train] lora_rank "
                            f"is {rank}: restart it with --max-lora-rank {rank}")


def tensor_config(settings: LoopSettings) -> dict[str, Any] | None:
    """The adapter config an engine's LoRA tensor sync takes with the tensors (PEFT's
    LoraConfig fields that set what it computes), None for a run whose versions are not
    adapters."""
    if not is_adapter_run(settings):
        return None
    train = settings.train
    alpha = train.lora_alpha_value
    return {"r": train.lora_rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "target_modules": list(train.lora_target_modules)}


def engine_tensors(trainer: Any) -> list[tuple[str, Any]]:
    """The resident trainer's adapter under PEFT's names (what an engine's LoRA sync takes),
    fp32 host copies in a stable order."""
    from rltool.train.lora import peft_tensors

    return sorted(peft_tensors(trainer.backend.export_adapter()).items())


def policy_tensors(trainer: Any, settings: LoopSettings) -> list[tuple[str, Any]]:
    """What an engine takes in memory as the trainer's policy: the adapter in an adapter run,
    else the full weights (host copies)."""
    return engine_tensors(trainer) if is_adapter_run(settings) else trainer.named_tensors()


def tensor_bytes(named: list[tuple[str, Any]], dtype: Any) -> int:
    """Bytes of `named` as the transport writes them (in `dtype`)."""
    return sum(t.numel() * dtype.itemsize for _, t in named)


def publish(src: Any, settings: LoopSettings, *, publish_dir: Path, version: int,
            base_version: int | None, in_memory: str | None, to_disk: bool,
            dtype: str) -> dict[str, Any]:
    """Publish adapter version `version` by the run's [sync] (rltool.delta.publish): `src` is
    the resident trainer (its adapter, written in `dtype`, bf16 also under [sync] precision
    bf16) or a checkpoint's adapter directory. Nothing is written for an in-memory version off
    the save steps."""
    import torch

    from rltool.delta.publish import decide_transport, publish_version
    from rltool.io.checkpoint import is_delta_dir
    from rltool.rundir import weight_dir_name
    from rltool.train.lora import is_adapter_key, write_adapter

    sync = settings.sync.model_copy(update={"precision": None})  # the adapter's dtype says it
    memory = decide_transport(sync, in_memory=in_memory)
    if memory is not None and not to_disk:
        return publish_version({}, sync, publish_dir=publish_dir, version=version,
                               in_memory=in_memory, to_disk=False)
    base = publish_dir / weight_dir_name(base_version or 0)
    if memory is None and sync.sync in ("delta", "auto") and not (
            base_version and (is_delta_dir(base) or (base / "adapter_config.json").is_file())):
        sync = sync.model_copy(update={"sync": "full"})  # the base model: no delta to take
    if isinstance(src, Path):
        return publish_version(src, sync, publish_dir=publish_dir, version=version,
                               base_version=base_version, in_memory=in_memory, to_disk=to_disk)
    stage = publish_dir / f".{weight_dir_name(version)}.adapter.tmp"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        state = {k: v for k, v in src.backend.export_adapter().items() if is_adapter_key(k)}
        bf16 = dtype == "bf16" or settings.sync.precision == "bf16"
        write_adapter(stage, tensors=state, config=src.backend.lora.peft_config(src.model_dir),
                      dtype=torch.bfloat16 if bf16 else torch.float32)
        return publish_version(stage, sync, publish_dir=publish_dir, version=version,
                               base_version=base_version, in_memory=in_memory, to_disk=to_disk)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
