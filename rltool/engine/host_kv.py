"""The host KV tier (`--enable-hierarchical-cache`): prefix-cache pages evicted from the device
pool live on in host memory until a prompt that shares them brings them back.

Which pages are where is the radix cache's business (rltool.engine.radix_cache: a node holds a
device page, a host page, never both); this module holds the host tensors and moves KV between
the two pools. Each host page stores one device page's KV in every layer, page-major: the KV of
host page h is one contiguous block of each host tensor, so a run of consecutive host pages is
one copy. Pinned memory on CUDA (asynchronous copies), plain memory on CPU.

Write policy: write-back on eviction. A page is copied to the host only when the device pool
needs its room (never on insert), and a reload moves it back (the host copy is freed: the tiers
are exclusive, so a page costs memory in one of them only).

Ordering on CUDA: copies run on one side stream. It first waits for the work queued on the
current stream (the KV a device page holds, or a finished request's last writes into a page now
reused, must land first); the current stream then waits for the copies before its next kernel
reads or overwrites those pages. Both directions share the side stream, so a reload reading host
page h lands before a later eviction writes h. What overlaps: the copies with the host's own
work (building the next batch), and a reload with decode work already queued ahead of it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from rltool.errors import BadInputError

GB = 10**9


@dataclass
class TierStats:
    """Counters of the prefix cache's two tiers (`/get_server_info` `hicache`)."""
    device_hit_tokens: int = 0  # prompt tokens served from pages on the device
    host_hit_tokens: int = 0  # prompt tokens served from pages reloaded from the host tier
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    io_s: float = 0.0  # time the copies took (CUDA: measured with events on the side stream)
    host_pages: int = 0  # the host pool's size
    host_pages_used: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def host_pool_pages(*, device_pages: int, bytes_per_page: int, ratio: float,
                    size_gb: float, available_bytes: int | None = None) -> int:
    """Host pages for `--hicache-ratio` (a multiple of the device pool) or `--hicache-size` GB
    (when > 0, it wins); refused when they need more than `available_bytes` (the host's
    available memory), as SGLang refuses, rather than failing or swapping mid-allocation."""
    pages = int(size_gb * GB // bytes_per_page) if size_gb > 0 else int(device_pages * ratio)
    if pages < 1:
        raise BadInputError(f"the host KV tier holds no page ({bytes_per_page} bytes each); raise "
                            "--hicache-ratio or --hicache-size")
    if available_bytes is not None and pages * bytes_per_page > available_bytes:
        raise BadInputError(f"the host KV tier needs {pages * bytes_per_page / GB:.2f} GB, the "
                            f"host has {available_bytes / GB:.2f} GB available; lower "
                            "--hicache-ratio or --hicache-size")
    return pages


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostKV:
    """Host copies of the device pool's per-slot tensors (`pool` is a KVPool) for `num_pages`
    host pages of `page_size` tokens."""

    def __init__(self, pool: Any, *, num_pages: int, page_size: int, stats: TierStats):
        self.page_size = page_size
        self.num_pages = num_pages
        self.stats = stats
        stats.host_pages = num_pages
        # (device tensor, its slot dimension): K, V, FP8 scales [layers, slots, ...]; an MoE
        # model's routed expert ids [slots, ...]
        self._dev = [(t, 1) for t in (pool.k, pool.v, pool.k_scale, pool.v_scale)
                     if t is not None]
        if pool.routed is not None:
            self._dev.append((pool.routed.ids, 0))
        # Bytes are bytes: FP8 as uint8 (index_copy_ has no FP8 kernel on CPU)
        self._dev = [(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t, d)
                     for t, d in self._dev]
        device = pool.k.device
        self.cuda = device.type == "cuda"
        self._host = []
        for t, d in self._dev:
            page_shape = list(t.shape[:d]) + [page_size] + list(t.shape[d + 1:])
            self._host.append(torch.empty([num_pages] + page_shape, dtype=t.dtype,
                                          pin_memory=self.cuda))
        self.bytes_per_page = sum(h[0].numel() * h.element_size() for h in self._host)
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._timed: list[tuple[Any, Any]] = []  # CUDA event pairs not yet added to io_s
        self._lock = threading.Lock()  # settle also runs on the HTTP thread (server info)

    def _paged(self, t: torch.Tensor, d: int) -> torch.Tensor:
        return t.unflatten(d, (-1, self.page_size))

    def to_host(self, copies: list[tuple[int, int]]) -> None:
        """Copy device page -> host page for each pair, batched: one gather per tensor on the
        device, then one copy per run of consecutive host pages."""
        if not copies:
            return
        dev_pages = [c[0] for c in copies]
        host_pages = [c[1] for c in copies]
        with self._side() as device:
            idx = torch.tensor(dev_pages, dtype=torch.long).to(device, non_blocking=True)
            for (t, d), h in zip(self._dev, self._host):
                page_major = self._paged(t, d).index_select(d, idx).movedim(d, 0).contiguous()
                for i, j, n in _runs(host_pages):
                    h[j:j + n].copy_(page_major[i:i + n], non_blocking=True)
        self.stats.bytes_to_host += len(copies) * self.bytes_per_page

    def to_device(self, copies: list[tuple[int, int]]) -> None:
        """Copy host page -> device page for each pair (host page, device page), batched: one
        copy per run of consecutive host pages into a device buffer, then one scatter per
        tensor."""
        if not copies:
            return
        host_pages = [c[0] for c in copies]
        dev_pages = [c[1] for c in copies]
        with self._side() as device:
            idx = torch.tensor(dev_pages, dtype=torch.long).to(device, non_blocking=True)
            for (t, d), h in zip(self._dev, self._host):
                staged = torch.empty((len(copies),) + tuple(h.shape[1:]), dtype=h.dtype,
                                     device=device)
                for i, j, n in _runs(host_pages):
                    staged[i:i + n].copy_(h[j:j + n], non_blocking=True)
                self._paged(t, d).index_copy_(d, idx, staged.movedim(0, d))
        self.stats.bytes_to_device += len(copies) * self.bytes_per_page

    def page(self, host_page: int) -> list[torch.Tensor]:
        """The host copy of one page, per tensor (tests compare it with the device page)."""
        return [h[host_page] for h in self._host]

    def device_page(self, page: int) -> list[torch.Tensor]:
        return [self._paged(t, d).select(d, page) for t, d in self._dev]

    def settle(self) -> None:
        """Add the time of finished CUDA copies to `io_s`."""
        with self._lock:
            pending = []
            for start, end in self._timed:
                if end.query():
                    self.stats.io_s += start.elapsed_time(end) / 1e3
                else:
                    pending.append((start, end))
            self._timed = pending

    def _side(self) -> "_Side":
        return _Side(self)


class _Side:
    """Runs the copies of one batch on the side stream (CUDA) and times them."""

    def __init__(self, host: HostKV):
        self.host = host

    def __enter__(self) -> torch.device:
        host = self.host
        if not host.cuda:
            self.t0 = time.perf_counter()
            return torch.device("cpu")
        host.settle()
        host._stream.wait_stream(torch.cuda.current_stream())
        self.ctx = torch.cuda.stream(host._stream)
        self.ctx.__enter__()
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        return host._dev[0][0].device

    def __exit__(self, *exc: Any) -> None:
        host = self.host
        if not host.cuda:
            host.stats.io_s += time.perf_counter() - self.t0
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.ctx.__exit__(*exc)
        with host._lock:
            host._timed.append((self.start, end))
        torch.cuda.current_stream().wait_stream(host._stream)


def reload_prefix(table: Any, path: list, tokens: list[int], max_pages: int, *, tail: bool,
                  spare: int) -> tuple[list, Any]:
    """Bring the host-tier pages that continue `path` (a device match, locked) along `tokens`
    back into device pages of `table` (a PageTable), at most `max_pages` and as many as are free
    beyond `spare`, in one batched copy. Returns them, locked, and, with `tail` (the reuse ends
    inside the next page), that page too if it was on the host: reloaded, not locked, for the
    caller's copy-on-write of its first tokens."""
    cache = table.cache
    found = cache.match_host(path, tokens)[:max_pages + tail]
    cache.lock(found)  # not dropped from the host pool while room is made
    room = max(table.free_pages - spare, 0) if found else 0
    cache.unlock(found[room:])
    found = found[:room]
    if not found:
        return [], None
    table.host.to_device(cache.promote(found, table._alloc(len(found))))
    shared, extra = found[:max_pages], found[max_pages:]
    cache.unlock(extra)  # attached: nothing to free
    table.stats.host_hit_tokens += len(shared) * table.page_size
    return shared, extra[0] if extra else None


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index in `pages`, first page, length) of each run of consecutive page ids."""
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if out and out[-1][1] + out[-1][2] == p and out[-1][0] + out[-1][2] == i:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, p, 1))
    return out
