"""Write an HF safetensors checkpoint from a list of jobs, streaming, in parallel, published atomically.

A job knows the tensors it will produce (name, dtype code, shape) before it runs, so every shard's
header and the index are planned up front and each shard is written tensor by tensor: besides the
tensor being written, at most max(2 * workers jobs, READ_AHEAD_BYTES) of results are in memory.
Jobs run on a thread pool (torch kernels and the native kernels release the GIL), results are
written in plan order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltool import atomic
from rltool.io import header as st
from rltool.io import writer as st_write
from rltool.errors import BadInputError, CheckpointError
from rltool.io.hf_dir import CONFIG_NAME, copy_side_files
from rltool.progress import Progress

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Entry = tuple[str, str, tuple[int, ...]]  # (name, safetensors dtype code, shape)
RESOLVED_CONFIG = "rltool_convert.toml"  # the convert command's resolved config, inside its output
# Output bytes that jobs may produce ahead of the writer (beyond 2 x workers jobs): measured on
# a 0.5B model, the FP8 workers otherwise idled while the embeddings were written.
READ_AHEAD_BYTES = 256 << 20


@dataclass
class Job:
    """Produces the tensors `outputs` describes, in that order, when `run()` is called;
    `release`, if given, receives those tensors once they are written (to recycle buffers)."""

    outputs: list[Entry]
    run: Callable[[], list[torch.Tensor]]
    release: Callable[[list[torch.Tensor]], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(st.tensor_nbytes(dtype, shape) for _, dtype, shape in self.outputs)


class BufferPool:
    """Output tensors recycled by shape and dtype between jobs (thread-safe).

    Each fresh tensor-sized allocation is a new mapping whose every page faults on its first write
    and is unmapped again once written (with threads, a TLB shootdown): for FP8 conversion that
    was ~10% of the CPU time. Only as many buffers exist as jobs are in flight at once.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        import torch

        with self._lock:
            free = self._free.get((tuple(shape), dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype)

    def give(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)


_M_MMAP_THRESHOLD = -3  # glibc malloc.h


def limit_heap_retention(*, threshold_bytes: int = 1 << 20) -> None:
    """Serve allocations above `threshold_bytes` with mmap, so freed tensors go back to the OS.

    glibc raises its mmap threshold after each large free (up to 32 MB), after which tensor-sized
    buffers come from the heap and stay resident once freed: converting a 1.26 GB model measured
    ~0.3 GB of such garbage in the peak RSS. Setting the threshold explicitly turns that off for
    the process (a no-op on other C libraries).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).mallopt(_M_MMAP_THRESHOLD, threshold_bytes)
    except (OSError, AttributeError):
        log.debug("mallopt unavailable; freed memory may stay resident")


def read_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(hf_dir) / CONFIG_NAME
    if not path.exists():
        raise CheckpointError(f"{hf_dir} has no config.json; pass an HF checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def check_new_output(out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.exists():
        raise BadInputError(f"{out} already exists; choose a new --out directory")
    return out


def _ordered_results(jobs: list[Job], pool: ThreadPoolExecutor, *, window: int,
                     window_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Run `jobs` on `pool` ahead of the writer, yield their tensors in order. Beyond the one
    being written, jobs run ahead while fewer than `window` are pending or their outputs total at
    most `window_bytes`, so that small jobs keep the workers busy while a large tensor (an
    embedding) is written: in-flight memory is one job plus max(window jobs, window_bytes)."""
    pending: deque[tuple[Job, Future]] = deque()
    queued = deque(jobs)
    ahead_bytes = 0

    def refill() -> None:
        nonlocal ahead_bytes
        while queued and (len(pending) < window
                          or ahead_bytes + queued[0].nbytes <= window_bytes):
            job = queued.popleft()
            pending.append((job, pool.submit(job.run)))
            ahead_bytes += job.nbytes

    refill()
    while pending:
        job, fut = pending.popleft()
        ahead_bytes -= job.nbytes
        tensors = fut.result()
        refill()
        if len(tensors) != len(job.outputs):
            raise CheckpointError(f"internal: job for {job.outputs[0][0]} returned {len(tensors)} "
                                  f"tensors, planned {len(job.outputs)}")
        for (name, _, _), tensor in zip(job.outputs, tensors, strict=True):
            yield name, tensor
        if job.release is not None:  # the consumer asked for the next tensor: these are written
            job.release(tensors)
        del tensors


def _counted(tensors: Iterator[tuple[str, torch.Tensor]],
             progress: Progress) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, each counted (in MB) once the writer comes back for the next one."""
    for name, tensor in tensors:
        yield name, tensor
        progress.advance(tensor.numel() * tensor.element_size() / 1e6)


@contextlib.contextmanager
def _intra_op_threads(workers: int) -> Iterator[None]:
    """Give each of `workers` concurrent jobs its share of the cores for torch's own (OpenMP)
    threads, restored after: every worker running ops with a full-size team oversubscribed a
    2-core machine (torch FP8 path: 3.2 s with 2 x 2 threads, 2.3 s with 2 x 1)."""
    import torch

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // workers))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def publish_checkpoint(out: Path, jobs: list[Job], *, config: dict[str, Any],
                       side_files_from: str | os.PathLike, stage_config: Any, workers: int,
                       max_shard_mb: float) -> dict[str, Any]:
    """Publish a complete HF checkpoint at `out` (atomic): side files copied from
    `side_files_from`, the jobs' shards and index, the resolved stage config, and config.json last
    (the directory's completeness marker for HF loaders). Returns write_checkpoint's result."""
    from rltool.config import write_resolved

    with atomic.publish_dir(out) as tmp:
        copy_side_files(side_files_from, tmp)
        written = write_checkpoint(tmp, jobs, workers=workers,
                                   max_shard_bytes=int(max_shard_mb * 10**6))
        write_resolved(stage_config, tmp / RESOLVED_CONFIG)
        atomic.write_json(tmp / CONFIG_NAME, config)
    return written


def write_checkpoint(tmp_dir: Path, jobs: list[Job], *, workers: int,
                     max_shard_bytes: int) -> dict[str, Any]:
    """Write `jobs` into shards under `tmp_dir` (a directory being published) plus the index.

    Returns {"files": [...], "total_size": bytes}. A job's outputs never straddle two shards.
    """
    names = [e[0] for job in jobs for e in job.outputs]
    if len(set(names)) != len(names):
        raise CheckpointError("internal: two jobs write the same tensor name")
    groups: list[list[Job]] = []
    used = 0
    for job in jobs:
        if not groups or (groups[-1] and used + job.nbytes > max_shard_bytes):
            groups.append([])
            used = 0
        groups[-1].append(job)
        used += job.nbytes
    files = [st.SINGLE_NAME] if len(groups) == 1 else st.shard_file_names(len(groups))
    weight_map: dict[str, str] = {}
    total = 0
    with _intra_op_threads(workers), ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="convert") as pool, Progress(
            "convert", total=sum(job.nbytes for job in jobs) / 1e6, unit="MB") as progress:
        for fname, group in zip(files, groups, strict=True):
            entries = [e for job in group for e in job.outputs]
            with atomic.atomic_path(tmp_dir / fname) as path:
                total += st_write.write_streaming(
                    path, entries, _counted(_ordered_results(group, pool, window=2 * workers,
                                                             window_bytes=READ_AHEAD_BYTES),
                                            progress),
                    metadata={"format": "pt"})
            weight_map.update({e[0]: fname for e in entries})
            log.info("wrote %s (%d tensors)", fname, len(entries))
    atomic.write_json(tmp_dir / st.INDEX_NAME, st.index_json(weight_map, total_size=total))
    return {"files": files, "total_size": total}
