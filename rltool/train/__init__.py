"""Trainer backends (torch; megatron later), the RL algorithms in `algo/`, and the DP schedule.

`rltool.train.run(cfg)` is the train stage as a library call (see rltool.train.stage); this
module stays light so importing `rltool.train.*` pulls in torch only where needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltool.train.config import TrainConfig
    from rltool.train.stage import TrainResult


def run(cfg: "TrainConfig") -> "TrainResult":
    from rltool.train.stage import run as run_stage

    return run_stage(cfg)
