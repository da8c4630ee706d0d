"""Read back what W&B's offline mode wrote: the history rows and config of a `run-<id>.wandb`
file (a LevelDB-style log of protobuf Records: a 7-byte file header, then 32 KiB blocks of
records, each with a 7-byte header: CRC32C, little-endian length, chunk type)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the block's tail is too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    return out


def finished_records(log_file: Path, *, timeout_s: float = 60.0) -> list[Any]:
    """The parsed records once the file ends with the run's `exit` record: W&B's writer process
    still flushes the file for a moment after `finish()` returns."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while True:
        parsed = [pb.Record.FromString(raw) for raw in records(log_file)]
        if parsed and parsed[-1].WhichOneof("record_type") == "exit":
            return parsed
        assert time.monotonic() < deadline, f"{log_file} has no exit record after {timeout_s}s"
        time.sleep(0.1)


def history_and_config(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The logged rows ({key: value}) and the run config of an offline run directory."""
    (log_file,) = Path(run_dir).glob("run-*.wandb")
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for record in finished_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item if not item.key.startswith("_")})
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                config[item.key] = json.loads(item.value_json)
    return history, config
