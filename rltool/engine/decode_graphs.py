"""The decode step as CUDA graphs: one per batch-size bucket, captured largest first in one memory
pool, all reading their inputs from the columns of one device buffer.

A step's inputs are written on the host into one of two pinned staging buffers, used alternately,
and copied to the device buffer in one contiguous (so asynchronous) copy: the host waits for the
device only when it is two steps ahead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class DecodeGraphs:
    """The captured graphs (`captured`: bucket -> (graph, its output)), the device input buffer
    `meta` [rows, max_bs] they read, and its pinned staging buffers."""

    def __init__(self, device: torch.device, *, rows: int, max_bs: int):
        self.device = device
        self.meta = torch.zeros(rows, max_bs, dtype=torch.long, device=device)
        self.meta[3] = 1  # sequence lengths: padded rows attend to one junk token
        self.captured: dict[int, tuple[Any, torch.Tensor]] = {}
        self._host = [(torch.zeros(rows, max_bs, dtype=torch.long, device="cpu").pin_memory(),
                       torch.cuda.Event()) for _ in range(2)]
        self._calls = 0
        self._current = self._host[0]

    def capture(self, forward: Callable[[torch.Tensor], torch.Tensor],
                buckets: list[int]) -> None:
        """Capture `forward(meta columns)` for each bucket, largest first, in one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(buckets):
            meta = self.meta[:, :bs]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernel, warms cuBLAS
                    forward(meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = forward(meta)
            self.captured[bs] = (graph, out)
        torch.cuda.synchronize(self.device)

    def get(self, bucket: int | None) -> tuple[Any, torch.Tensor] | None:
        return self.captured.get(bucket)

    def staging(self) -> np.ndarray:
        """The next pinned staging buffer, once the copy queued from it two steps ago has run."""
        self._calls += 1
        self._current = self._host[self._calls % 2]
        self._current[1].synchronize()
        return self._current[0].numpy()

    def upload(self) -> torch.Tensor:
        """The whole staging buffer copied to `meta`, asynchronously: the graphs read their
        bucket's columns, nothing reads the others."""
        staging, copied = self._current
        self.meta.copy_(staging, non_blocking=True)
        copied.record()
        return self.meta
