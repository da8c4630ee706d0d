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

Metrics (`TierStats`, `/get_server_info` `hicache`): hits per tier, bytes and copy time each way
(CUDA events on the copy stream, read once they have passed; wall time on CPU), the tier's host
bookkeeping, and what a cost model of the tier needs from the rest of the engine: time to first
token per request and each prefill forward's time against its tokens (rltool.profile
.serving_check checks the HiCache model with them).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rltool.errors import BadInputError

GB = 10**9
TTFT_WINDOW = 4096  # requests whose time to first token the percentiles are taken over


@dataclass
class TierStats:
    """Counters of the prefix cache's two tiers and of what they save (`/get_server_info`
    `hicache`): hits per tier, traffic and copy time each way, the tier's host-side bookkeeping,
    prefill time per token and time to first token. Kept by the runner across release/resume."""
    device_hit_tokens: int = 0  # prompt tokens served from pages on the device
    host_hit_tokens: int = 0  # prompt tokens served from pages reloaded from the host tier
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    io_to_host_s: float = 0.0  # copy time (CUDA: events on the copy stream; CPU: wall)
    io_to_device_s: float = 0.0
    reloads: int = 0  # batched reloads (one per request that got host pages back)
    book_s: float = 0.0  # host wall time of the tier's matching, moves and copy launches
    host_pages: int = 0  # the host pool's size
    host_pages_used: int = 0
    requests: int = 0  # finished requests that got a first token
    prompt_tokens: int = 0  # their prompt tokens
    ttft_s: float = 0.0  # their summed time from arrival to first token
    # Prefill forwards (CUDA: events; CPU: wall) and the sums a least-squares fit of their
    # seconds against their tokens takes: its slope is the marginal prefill cost of a token,
    # what a cache hit saves (the mean also carries each forward's fixed cost).
    prefill_forwards: int = 0
    prefill_tokens: int = 0  # tokens prefilled (computed, not served from a cache)
    prefill_s: float = 0.0
    prefill_tokens_sq: float = 0.0  # sum of tokens^2 over forwards
    prefill_token_s: float = 0.0  # sum of tokens * seconds over forwards
    _ttfts: collections.deque = field(default_factory=lambda: collections.deque(
        maxlen=TTFT_WINDOW), repr=False)
    _timed: list = field(default_factory=list, repr=False)  # (start, end, add) on CUDA
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """The counters, with the derived `io_s`, `ttft_*_s` and `prefill_s_per_token` (the
        mean)."""
        self.settle()
        with self._lock:
            out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
            ttfts = sorted(self._ttfts)
        out.update(io_s=self.io_to_host_s + self.io_to_device_s,
                   ttft_mean_s=self.ttft_s / self.requests if self.requests else None,
                   ttft_p50_s=_percentile(ttfts, 0.50), ttft_p99_s=_percentile(ttfts, 0.99),
                   prefill_s_per_token=(self.prefill_s / self.prefill_tokens
                                        if self.prefill_tokens else None))
        return out

    def record_request(self, req: Any) -> None:
        """Count a finished request (a rltool.engine.request.Request) that got a first token."""
        if req.t_first_token is None:
            return
        ttft = req.t_first_token - req.t_arrival
        with self._lock:
            self.requests += 1
            self.prompt_tokens += len(req.prompt_ids)
            self.ttft_s += ttft
            self._ttfts.append(ttft)

    def prefill(self, tokens: int, device: torch.device) -> contextlib.AbstractContextManager:
        """Time one prefill forward of `tokens` tokens."""
        self.prefill_forwards += 1
        self.prefill_tokens += tokens
        self.prefill_tokens_sq += tokens * tokens

        def add(seconds: float) -> None:
            self.prefill_s += seconds
            self.prefill_token_s += seconds * tokens
        return self.timed(device, add)

    def adder(self, counter: str) -> Callable[[float], None]:
        """A function adding its seconds to `counter`."""
        return lambda seconds: setattr(self, counter, getattr(self, counter) + seconds)

    @contextlib.contextmanager
    def timed(self, device: torch.device | None, add: Callable[[float], None]
              ) -> Iterator[None]:
        """Pass the time of the work the block queues to `add`: on CUDA the time between two
        events on the current stream (passed by `settle` once they have passed), else wall."""
        if device is None or device.type != "cuda":
            t0 = time.perf_counter()
            yield
            add(time.perf_counter() - t0)
            return
        self.settle()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        with self._lock:
            self._timed.append((start, end, add))

    def settle(self) -> None:
        """Add the time of finished CUDA work to its counter (also called on the HTTP thread)."""
        with self._lock:
            pending = []
            for start, end, add in self._timed:
                if end.query():
                    add(start.elapsed_time(end) / 1e3)
                else:
                    pending.append((start, end, add))
            self._timed = pending


def _percentile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of an ascending list (None when empty)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(math.ceil(q * len(ordered)) - 1, 0))]


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

    def _paged(self, t: torch.Tensor, d: int) -> torch.Tensor:
        return t.unflatten(d, (-1, self.page_size))

    def to_host(self, copies: list[tuple[int, int]]) -> float:
        """Copy device page -> host page for each pair, batched: one gather per tensor on the
        device, then one copy per run of consecutive host pages (the pairs taken in host-page
        order, so pages demoted leaf first still make runs). Returns the host wall time the
        copies took (0 on CUDA, where they run on the copy stream)."""
        if not copies:
            return 0.0
        copies = sorted(copies, key=lambda c: c[1])
        dev_pages = [c[0] for c in copies]
        host_pages = [c[1] for c in copies]
        t0 = time.perf_counter()
        with self._side("io_to_host_s") as device:
            idx = torch.tensor(dev_pages, dtype=torch.long).to(device, non_blocking=True)
            for (t, d), h in zip(self._dev, self._host):
                page_major = self._paged(t, d).index_select(d, idx).movedim(d, 0).contiguous()
                for i, j, n in _runs(host_pages):
                    h[j:j + n].copy_(page_major[i:i + n], non_blocking=True)
        self.stats.bytes_to_host += len(copies) * self.bytes_per_page
        return 0.0 if self.cuda else time.perf_counter() - t0

    def to_device(self, copies: list[tuple[int, int]]) -> float:
        """Copy host page -> device page for each pair (host page, device page), batched: one
        copy per run of consecutive host pages (in host-page order) into a device buffer, then
        one scatter per tensor. Returns the host wall time the copies took (0 on CUDA)."""
        if not copies:
            return 0.0
        copies = sorted(copies)
        host_pages = [c[0] for c in copies]
        dev_pages = [c[1] for c in copies]
        t0 = time.perf_counter()
        with self._side("io_to_device_s") as device:
            idx = torch.tensor(dev_pages, dtype=torch.long).to(device, non_blocking=True)
            for (t, d), h in zip(self._dev, self._host):
                staged = torch.empty((len(copies),) + tuple(h.shape[1:]), dtype=h.dtype,
                                     device=device)
                for i, j, n in _runs(host_pages):
                    staged[i:i + n].copy_(h[j:j + n], non_blocking=True)
                self._paged(t, d).index_copy_(d, idx, staged.movedim(0, d))
        self.stats.bytes_to_device += len(copies) * self.bytes_per_page
        return 0.0 if self.cuda else time.perf_counter() - t0

    def page(self, host_page: int) -> list[torch.Tensor]:
        """The host copy of one page, per tensor (tests compare it with the device page)."""
        return [h[host_page] for h in self._host]

    def device_page(self, page: int) -> list[torch.Tensor]:
        return [self._paged(t, d).select(d, page) for t, d in self._dev]

    @contextlib.contextmanager
    def _side(self, counter: str) -> Iterator[torch.device]:
        """Run the block's copies on the copy stream (CUDA), timed into `counter`."""
        if not self.cuda:
            with self.stats.timed(None, self.stats.adder(counter)):
                yield torch.device("cpu")
            return
        device = self._dev[0][0].device
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream), self.stats.timed(device,
                                                               self.stats.adder(counter)):
            yield device
        torch.cuda.current_stream().wait_stream(self._stream)


def write_back(table: Any, num_pages: int) -> list[int]:
    """Demote `num_pages` device pages of `table`'s prefix cache (a PageTable's) to the host
    tier, their copies queued before anything can write them; returns the device pages freed."""
    t0 = time.perf_counter()
    freed, copies = table.cache.demote(num_pages)
    copy_s = table.host.to_host(copies)
    table.stats.book_s += time.perf_counter() - t0 - copy_s
    return freed


def reload_prefix(table: Any, path: list, tokens: list[int], max_pages: int, *, tail: bool,
                  spare: int) -> tuple[list, Any]:
    """Bring the host-tier pages that continue `path` (a device match, locked) along `tokens`
    back into device pages of `table` (a PageTable), at most `max_pages` and as many as are free
    beyond `spare`, in one batched copy. Returns them, locked, and, with `tail` (the reuse ends
    inside the next page), that page too if it was on the host: reloaded, not locked, for the
    caller's copy-on-write of its first tokens."""
    t0 = time.perf_counter()
    cache = table.cache
    found = cache.match_host(path, tokens)[:max_pages + tail]
    cache.lock(found)  # not dropped from the host pool while room is made
    room = max(table.free_pages - spare, 0) if found else 0
    cache.unlock(found[room:])
    found = found[:room]
    if not found:
        table.stats.book_s += time.perf_counter() - t0
        return [], None
    t_alloc = time.perf_counter()
    pages = table._alloc(len(found))  # a write-back it runs counts its own time
    t0 += time.perf_counter() - t_alloc
    copy_s = table.host.to_device(cache.promote(found, pages))
    shared, extra = found[:max_pages], found[max_pages:]
    cache.unlock(extra)  # attached: nothing to free
    table.stats.host_hit_tokens += len(shared) * table.page_size
    table.stats.reloads += 1
    table.stats.book_s += time.perf_counter() - t0 - copy_s
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
