"""What every benchmark shares: the machine it ran on, the load average, timing, the JSON record.

A benchmark is a workload on top of this module:

    run = harness.Run("dp_schedule")            # name, start time, load average before
    rows = ...                                  # the measurements
    harness.print_table(["case", "ms"], [[r["case"], r["ms"]] for r in rows])
    run.finish({"results": rows}, out=args.out)

`finish` adds the name, the date, the machine (CPU, cores, GPU, python and torch versions) and the
load average before and after, writes the record atomically when `out` is given (a directory: the
file `NAME-DATE-DEVICE.json` in it; a path ending in `.json`: that file) and prints it as the one
JSON line that ends stdout (bulky `detail`, such as every run's rows, goes to the file only).
Human progress goes to stderr.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rltool import atomic
from rltool.errors import BadInputError


def gpu_name() -> str | None:
    """The first visible CUDA device's name, or None without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def device_tag(device: str = "cpu") -> str:
    """The DEVICE part of a result file's name: the card (`h100`, `h200`) on CUDA, `cpuN` (N
    cores) on the CPU."""
    if device.startswith("cuda"):
        name = gpu_name()
        if name is None:
            raise RuntimeError("device cuda but no CUDA device is visible")
        # "NVIDIA H100 80GB HBM3" -> h100; "NVIDIA H200" -> h200
        model = re.search(r"\b[A-Z]+\d{2,4}[A-Z]*\b", name)
        return (model.group(0) if model else name.split()[-1]).lower()
    return f"cpu{os.cpu_count()}"


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else its architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine and software a figure came from."""
    import torch

    gpu = gpu_name()
    info = {"platform": platform.platform(), "cpu": cpu_model(),
            "cores": os.cpu_count(), "gpu": gpu,
            "gpus": torch.cuda.device_count() if gpu else 0,
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    if gpu:  # cuDNN's version decides whether torch's SDPA tries cuDNN attention first
        info.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return info


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def sync(device: Any = None) -> None:
    """Wait for the CUDA device's queued work (CUDA calls return at launch: a timer must stop
    after the work, not after the launch); nothing on the CPU."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    if device is not None and torch.device(device).type != "cuda":
        return
    torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], *, repeats: int, device: Any = None,
          before: Callable[[], Any] | None = None) -> tuple[list[float], Any]:
    """Seconds of each of `repeats` calls of `fn` (each between two device syncs; `before()`
    runs untimed before each call) and the last call's result."""
    times, result = [], None
    for _ in range(repeats):
        if before is not None:
            before()
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times, result


def median_s(fn: Callable[[], Any], *, repeats: int, device: Any = None,
             before: Callable[[], Any] | None = None) -> float:
    """The median of `timed`'s seconds."""
    return statistics.median(timed(fn, repeats=repeats, device=device, before=before)[0])


def require_device(device: str) -> None:
    """BadInputError when `device` is `cuda` and no CUDA device is visible."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise BadInputError("--device cuda but no CUDA device is visible; use --device cpu")


def require_positive(args: Any, *flags: str) -> None:
    """BadInputError naming the first of `flags` (`--new-tokens` reads `args.new_tokens`) whose
    value is below 1."""
    for flag in flags:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:
            raise BadInputError(f"{flag} must be >= 1, got {value}")


def parse_quick_workload(argv: list[str] | None, *, name: str, doc: str,
                         quick_help: str) -> Any:
    """The options of a benchmark with a full (GPU) and a `--quick` workload: `--device`,
    `--quick` (helped by `quick_help`), `--out`. BadInputError for `--device cuda` without a CUDA
    device, and for `--device cpu` without `--quick` (the full workload needs a GPU)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}",
                                     description=doc.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--quick", action="store_true",
                        help=f"{quick_help}; the only one on the CPU.")
    parser.add_argument("--out", default=None,
                        help=f"Write the record to DIR/{name}-DATE-DEVICE.json.")
    args = parser.parse_args(argv)
    require_device(args.device)
    if args.device == "cpu" and not args.quick:
        raise BadInputError("--device cpu runs the --quick workload only (the full one needs a "
                            "GPU); add --quick")
    return args


def parse_or_report(parse: Callable[[list[str] | None], Any], argv: list[str] | None) -> Any:
    """`parse(argv)`, or None after printing its BadInputError as one `Error: ...` line on stderr
    (the caller then exits 2)."""
    try:
        return parse(argv)
    except BadInputError as e:
        print(f"Error: {e}", file=sys.stderr)
        return None


def progress(message: str) -> None:
    """A timestamped line on stderr, so a run cut short shows how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain table on stdout: columns as wide as their widest cell, floats to 4 figures."""
    cells = [list(header)] + [[_cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


class Run:
    """One run of a benchmark: its name, device, start time and the load average at its start."""

    def __init__(self, name: str, *, device: str = "cpu", tag: str | None = None):
        self.name = name
        self.device = device
        self.tag = tag or device_tag(device)  # DEVICE in the result file's name
        self.started = datetime.now(timezone.utc)
        self.load_before = load_average()

    def path(self, out: str | os.PathLike, *, variant: str = "") -> Path:
        """Where the record goes: `out` itself when it names a .json file, else
        `out/NAME[-VARIANT]-DATE-DEVICE.json`."""
        out = Path(out)
        if out.suffix == ".json":
            return out
        name = f"{self.name}-{variant}" if variant else self.name
        return out / f"{name}-{self.started:%Y-%m-%d}-{self.tag}.json"

    def record(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`fields` under the run's name, date, machine and load averages."""
        return {"benchmark": self.name, "date": self.started.isoformat(),
                "device": self.device, "machine": machine(),
                "load_avg_before": self.load_before, "load_avg_after": load_average(),
                **fields}

    def write(self, record: dict[str, Any], out: str | os.PathLike, *,
              variant: str = "") -> Path:
        """Write a finished record atomically (a run cut short keeps what it wrote)."""
        path = self.path(out, variant=variant)
        path.parent.mkdir(parents=True, exist_ok=True)
        # not atomic.write_json: its sorted keys fail on a record keyed by batch size and name
        atomic.write_text(path, json.dumps(record, indent=1, default=str) + "\n")
        return path

    def finish(self, fields: dict[str, Any], *, out: str | os.PathLike | None = None,
               detail: dict[str, Any] | None = None, variant: str = "") -> dict[str, Any]:
        """Build the record, write it (with `detail`, e.g. every run's rows) when `out` is given,
        and print it (without `detail`) as stdout's last line."""
        record = self.record(fields)
        if out is not None:
            path = self.write({**record, **(detail or {})}, out, variant=variant)
            print(f"results: {path}", file=sys.stderr)
        print(json.dumps(record, default=str), flush=True)
        return record
