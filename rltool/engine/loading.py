"""Loading a checkpoint into the builtin engine, where every reason it cannot be served is a
one-line CheckpointError (exit 2 from `rltool serve`, 400 from a weight route) rather than a
library traceback.

The builtin engine serves plain HF checkpoints in fp32/bf16 and block-FP8 ones (rltool.engine.quant,
what `rltool convert fp8` writes). Other quantizations are refused up front with the two ways to
serve them; anything else that cannot be loaded (corrupt shards, unknown architectures) is
reported with the library's own first line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rltool.engine import quant
from rltool.errors import CheckpointError

_MAX_REASON_CHARS = 300


def check_servable(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json, after checking the builtin engine can serve it."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json; pass a HF checkpoint directory as "
                              "--model")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON ({e}); restore the checkpoint") \
            from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a JSON object; restore the checkpoint")
    quant.read_format(config, where=str(path))  # block FP8 or nothing
    return config


def eos_token_ids(path: Path, config: dict[str, Any], tokenizer: Any) -> set[int]:
    """Every end-of-sequence id of a checkpoint: config.json's, the tokenizer's and
    generation_config.json's."""
    ids: set[int] = set()
    sources = [config.get("eos_token_id"), tokenizer.eos_token_id]
    gen = path / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return loading(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(str(path)))


def loading(path: Path, what: str, load: Any) -> Any:
    """`load()`, with any failure caused by the checkpoint as a one-line CheckpointError."""
    try:
        return load()
    except (MemoryError, torch.OutOfMemoryError, CheckpointError):
        raise  # already one line, or this host is short of memory (a runtime failure)
    except Exception as e:  # transformers/safetensors raise many unrelated types for bad input
        raise CheckpointError(f"cannot load the {what} of {path}: {one_line(e)}") from e


def one_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message, capped in length."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    if len(text) > _MAX_REASON_CHARS:
        text = text[:_MAX_REASON_CHARS - 3] + "..."
    return f"{type(error).__name__}: {text}"

