"""Run the train stage in several processes: `rltool train --nproc-per-node N` re-launches itself
under torchrun with the resolved config, so every rank sees exactly the same TrainConfig."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rltool.train.config import TrainConfig


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_command(config_file: Path, *, nproc_per_node: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc_per_node}", "-m", "rltool", "train", "--config",
            str(config_file), *extra]


def launch(cfg: TrainConfig, *, nproc_per_node: int, extra_args: list[str] | None = None) -> int:
    """Run `cfg` under torchrun with `nproc_per_node` processes; returns the exit code of rank 0's
    launcher (the first failing rank's code when one fails)."""
    import tomli_w

    with tempfile.TemporaryDirectory(prefix="rltool-train-") as tmp:
        config_file = Path(tmp) / "train.toml"
        config_file.write_text(tomli_w.dumps({"train": cfg.model_dump(mode="json",
                                                                      exclude_none=True)}))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = torchrun_command(config_file, nproc_per_node=nproc_per_node,
                               extra=list(extra_args or []))
        return subprocess.run(cmd, env=env, check=False).returncode


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
