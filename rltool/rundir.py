"""The run directory: each path of docs/formats.md's layout, plus state.json, engines.json, metrics.

```
RUN/config.toml  state.json  engines.json
RUN/weights/weight_vNNNNNN/      RUN/train/ckpt/step-NNNNNN/
RUN/rollouts/step-NNNNNN/        RUN/eval/step-NNNNNN/
RUN/metrics/<stage>.jsonl        RUN/trace/<role>-<pid>.jsonl   RUN/profile/   RUN/logs/
RUN/train/step-NNNNNN.toml       RUN/report/   RUN/engine_local/   RUN/engine_local_eval/
```
No other module builds these paths by hand.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltool import atomic
from rltool.errors import BadInputError

PHASES = ("rollout", "train", "publish", "sync", "eval")
VERSION_FILE = "rltool_version.json"  # {"version": N} inside a weights directory
_WEIGHT_RE = re.compile(r"^weight_v(\d{6,})$")
_STEP_RE = re.compile(r"^step-(\d{6,})$")
log = logging.getLogger(__name__)


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

    @property
    def tracking(self) -> Path:
        """The experiment trackers' ids (rltool.tracking), so a resumed run continues them."""
        return self.root / "tracking.json"

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
    def profile(self) -> Path:
        """`rltool profile`'s output (the Chrome trace)."""
        return self.root / "profile"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def report(self) -> Path:
        """`rltool report`'s default output (index.html and the plots)."""
        return self.root / "report"

    @property
    def local_weights(self) -> Path:
        """Host-local checkpoint directory engines pull delta versions into."""
        return self.root / "engine_local"

    @property
    def eval_local_weights(self) -> Path:
        """The async loop's eval engine's own pull directory (it loads versions on its own
        schedule, so it never shares the training engines')."""
        return self.root / "engine_local_eval"

    def weight_version(self, version: int) -> Path:
        return self.weights / weight_dir_name(version)

    def ckpt_step(self, step: int) -> Path:
        return self.ckpt / step_dir_name(step)

    def rollout_step(self, step: int) -> Path:
        return self.rollouts / step_dir_name(step)

    def eval_step(self, step: int) -> Path:
        return self.eval / step_dir_name(step)

    def train_config(self, step: int) -> Path:
        """The trainer's config of loop step `step` when it runs as a process of its own."""
        return self.root / "train" / f"{step_dir_name(step)}.toml"

    def metrics_file(self, stage: str) -> Path:
        return self.metrics / f"{stage}.jsonl"

    def log_file(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def create(self) -> "RunDir":
        for d in (self.weights, self.ckpt, self.rollouts, self.eval, self.metrics, self.trace,
                  self.logs):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def read_state(self) -> dict[str, Any] | None:
        data = read_json_file(self.state, what="state.json")
        if data is not None and not isinstance(data, dict):
            raise BadInputError(f"state.json at {self.state} is not a JSON object; restore or "
                                "delete it")
        return data

    def write_state(self, state: dict[str, Any], *, fsync: bool = True) -> None:
        atomic.write_json(self.state, state, fsync=fsync)

    def read_engines(self) -> list[dict[str, Any]]:
        data = read_json_file(self.engines, what="engines.json")
        if data is None:
            return []
        if not isinstance(data, dict) or not isinstance(data.get("engines"), list):
            raise BadInputError(f"engines.json at {self.engines} has no \"engines\" list; "
                                "restore or delete it")
        return list(data["engines"])

    def write_engines(self, engines: list[dict[str, Any]]) -> None:
        atomic.write_json(self.engines, {"engines": engines})


def declared_version(weights_dir: str | os.PathLike) -> int | None:
    """The policy version a weights directory declares: `rltool_version.json` {"version": N},
    else its name weight_vNNNNNN; None when it declares none."""
    from rltool.errors import CheckpointError

    weights_dir = Path(weights_dir)
    marker = read_json_file(weights_dir / VERSION_FILE, what=VERSION_FILE)
    if marker is not None:
        if not (isinstance(marker, dict) and isinstance(marker.get("version"), int)):
            raise CheckpointError(f"{weights_dir / VERSION_FILE} must be {{\"version\": <int>}}; "
                                  "fix or delete it")
        return marker["version"]
    return parse_weight_dir_name(weights_dir.name)


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
    (see `read_metrics`). Opening a file whose last line was torn (its previous writer was killed
    mid-write) truncates it to its last complete line, so the first new row starts on a line of
    its own instead of being glued onto the torn one and lost to readers.
    """

    RESERVED = ("step", "policy_version", "time")

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered O_APPEND: each line goes out in one write() call, never split by a buffer
        # boundary, so a reader sees whole lines or a torn last line only. O_RDWR rather than
        # O_WRONLY so the torn tail of a previous writer can be found and cut.
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            _cut_torn_tail(self._fd, self.path)
        except BaseException:
            os.close(self._fd)
            raise

    def log(self, metrics: dict[str, Any], *, step: int, policy_version: int) -> dict[str, Any]:
        clash = [k for k in self.RESERVED if k in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved; pass them as arguments")
        if self._fd is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        row = {"step": step, "policy_version": policy_version, "time": time.time(), **metrics}
        data = (json.dumps(row) + "\n").encode()
        written = os.write(self._fd, data)
        while written < len(data):  # a short write (signal, full disk): finish the line
            written += os.write(self._fd, data[written:])
        return row

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cut_torn_tail(fd: int, path: Path, *, chunk_bytes: int = 1 << 16) -> None:
    """Truncate the file open at `fd` after its last newline (to empty if it has none).

    Safe because a metrics file has a single writer: nobody else is mid-line while we open it.
    """
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    end = size
    keep = 0
    while end > 0:
        start = max(0, end - chunk_bytes)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        end = start
    log.warning("%s: cutting a torn last line (%d bytes) left by a killed writer", path,
                size - keep)
    os.ftruncate(fd, keep)
    os.fsync(fd)


def drop_metric_rows_after(path: str | os.PathLike, step: int) -> None:
    """Rewrite the metrics file at `path` (atomically, torn lines left out) without its rows of
    steps after `step`, if it has any. Only while no writer has the file open."""
    rows = read_metrics(path)
    kept = [r for r in rows if not isinstance(r.get("step"), int) or r["step"] <= step]
    if len(kept) < len(rows):
        atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete lines of a JSONL metrics file.

    A torn last line (its writer is still writing or died mid-write) is skipped; so is a torn line
    in the middle, which appears when a writer died mid-line and a resumed run appended after it.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    lines.pop()  # "" after the final newline, or the torn last line
    rows = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: skipping a torn metrics line", path, number)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
