"""The decode step as CUDA graphs: per batch-size bucket, one of the forward alone and, where the
step samples inside it, two of forward + sample + advance (rltool.engine.decode_sample: the plain
race, and the race over draw logits); all captured largest first in one memory pool, all reading
their inputs from the columns of one device buffer.

A step's inputs are written on the host into one of two pinned staging buffers, used alternately,
and copied to the device buffer in one contiguous (so asynchronous) copy: the host waits for the
device only when it is two steps ahead.

Every capture of the process runs on one side stream per device (`capture_stream`): cuBLAS keeps a
workspace (32 MiB on Hopper) for each stream it has run on until the process ends, and torch's
`Stream()` hands out the next of 32 pooled streams on each call, so a stream per capture (every
engine build, and every resume after a release) left up to 1 GiB allocated behind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class DecodeGraphs:
    """The captured graphs (`captured`: bucket -> (graph, its output), the forward alone;
    `sampled[draw]`: the same for the steps that sample inside the graph, without and with draw
    logits), the device input buffer `meta` [rows, max_bs] they read, and its pinned staging
    buffers. `initial` [rows] is a padded column's value, which `meta` holds between captures."""

    def __init__(self, device: torch.device, *, initial: np.ndarray, max_bs: int):
        self.device = device
        rows = len(initial)
        self._initial = torch.from_numpy(initial.astype(np.int64)).unsqueeze(1)
        self.meta = self._initial.repeat(1, max_bs).to(device)
        self.captured: dict[int, tuple[Any, Any]] = {}
        self.sampled: dict[bool, dict[int, tuple[Any, Any]]] = {False: {}, True: {}}
        self._pool = torch.cuda.graph_pool_handle()
        self._host = [(torch.zeros(rows, max_bs, dtype=torch.long, device="cpu").pin_memory(),
                       torch.cuda.Event()) for _ in range(2)]
        self._calls = 0
        self._current = self._host[0]

    def capture(self, forward: Callable[[torch.Tensor], Any], buckets: list[int], *,
                into: dict[int, tuple[Any, Any]]) -> None:
        """Capture `forward(meta columns)` for each bucket, largest first, into `into`. The
        warm-up runs may write `meta` (a step that advances its inputs): it is reset after."""
        stream = capture_stream(self.device)
        for bs in reversed(buckets):
            meta = self.meta[:, :bs]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernels, warms cuBLAS
                    forward(meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                out = forward(meta)
            into[bs] = (graph, out)
            self.meta.copy_(self._initial.expand_as(self.meta))
        torch.cuda.synchronize(self.device)

    def staging(self) -> np.ndarray:
        """The next pinned staging buffer, once the copy queued from it two steps ago has run."""
        self._calls += 1
        self._current = self._host[self._calls % 2]
        self._current[1].synchronize()
        return self._current[0].numpy()

    def upload(self, rows: int) -> torch.Tensor:
        """The staging buffer's first `rows` rows copied to `meta`, asynchronously (contiguous:
        whole rows): the graphs read their bucket's columns, nothing reads the others."""
        staging, copied = self._current
        self.meta[:rows].copy_(staging[:rows], non_blocking=True)
        copied.record()
        return self.meta


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every graph capture on `device` runs on (see the module docstring)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capture_stream(index)


@functools.cache
def _capture_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)
