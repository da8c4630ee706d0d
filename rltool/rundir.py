"""The run directory: every path of DESIGN.md's layout, plus state.json, engines.json and metrics.

```
RUN/config.toml  state.json  engines.json
RUN/weights/weight_vNNNNNN/      RUN/train/ckpt/step-NNNNNN/
RUN/rollouts/step-NNNNNN/        RUN/eval/step-NNNNNN/
RUN/metrics/<stage>.jsonl        RUN/trace/<role>.jsonl     RUN/logs/
```
No other module builds these paths by hand.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltool import atomic
from rltool.errors import BadInputError

PHASES = ("rollout", "train", "publish", "sync", "eval")
_WEIGHT_RE = re.compile(r"^weight_v(\d{6,})$")
_STEP_RE = re.compile(r"^step-(\d{6,})$")


def weight_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def parse_weight_dir_name(name: str) -> int | None:
    m = _WEIGHT_RE.match(name)
    return int(m.group(1)) if m else None


def parse_step_dir_name(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    # files
    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def engines(self) -> Path:
        return self.root / "engines.json"

    # folders
    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def ckpt(self) -> Path:
        return self.root / "train" / "ckpt"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def trace(self) -> Path:
        return self.root / "trace"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def local_weights(self) -> Path:
        """Host-local checkpoint directory engines pull delta versions into."""
        return self.root / "engine_local"

    def weight_version(self, version: int) -> Path:
        return self.weights / weight_dir_name(version)

    def ckpt_step(self, step: int) -> Path:
        return self.ckpt / step_dir_name(step)

    def rollout_step(self, step: int) -> Path:
        return self.rollouts / step_dir_name(step)

    def eval_step(self, step: int) -> Path:
        return self.eval / step_dir_name(step)

    def metrics_file(self, stage: str) -> Path:
        return self.metrics / f"{stage}.jsonl"

    def trace_file(self, role: str) -> Path:
        return self.trace / f"{role}.jsonl"

    def log_file(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def create(self) -> "RunDir":
        for d in (self.weights, self.ckpt, self.rollouts, self.eval, self.metrics, self.trace,
                  self.logs):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def read_state(self) -> dict[str, Any] | None:
        return read_json_file(self.state, what="state.json")

    def write_state(self, state: dict[str, Any]) -> None:
        atomic.write_json(self.state, state)

    def read_engines(self) -> list[dict[str, Any]]:
        data = read_json_file(self.engines, what="engines.json")
        return [] if data is None else list(data["engines"])

    def write_engines(self, engines: list[dict[str, Any]]) -> None:
        atomic.write_json(self.engines, {"engines": engines})


def list_versions(parent: str | os.PathLike) -> list[int]:
    """Published weight versions under a `--publish` parent, ascending (temporaries ignored)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = (parse_weight_dir_name(p.name) for p in parent.iterdir() if p.is_dir())
    return sorted(v for v in found if v is not None)


def read_json_file(path: Path, *, what: str) -> Any:
    """Read a JSON file; None when missing; BadInputError naming the file when corrupt."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInputError(f"{what} at {path} is not valid JSON ({e}); restore or delete it") from e


class MetricsWriter:
    """Single-writer JSONL metrics: one complete line per write, flushed.

    Every line carries `step`, `policy_version` and `time`. Readers skip a partial last line
    (see `read_metrics`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], *, step: int, policy_version: int) -> dict[str, Any]:
        row = {"step": step, "policy_version": policy_version, "time": time.time(), **metrics}
        self._f.write(json.dumps(row, sort_keys=False) + "\n")
        self._f.flush()
        return row

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete lines of a JSONL metrics file (a torn last line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and not text.endswith("\n"):
        lines.pop()  # a torn last line: its writer is still writing or died mid-write
    return [json.loads(line) for line in lines if line]
