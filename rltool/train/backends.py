"""Build the trainer backend a config names (`backend = "torch"` or `"megatron"`)."""

from __future__ import annotations

import os
from typing import Any

from rltool.train.config import BackendConfig


def build_backend(model_dir: str | os.PathLike, *, options: BackendConfig, trainable: bool = True,
                  value_head: bool = False) -> Any:
    """A TorchBackend or a MegatronBackend (rltool.train.backend.TrainerBackend) for `model_dir`."""
    if options.backend == "megatron":
        from rltool.train.megatron_backend import MegatronBackend

        return MegatronBackend(model_dir, options=options, trainable=trainable,
                               value_head=value_head)
    from rltool.train.torch_backend import TorchBackend

    return TorchBackend(model_dir, options=options, trainable=trainable, value_head=value_head)
