"""Paged KV cache: the page allocator, the per-request page table, and the pool's tensors.

Bookkeeping is plain Python and device-independent: a request owns a list of page ids and a token
count; token j of a request lives in pool slot `pages[j // page_size] * page_size + j % page_size`.
The device mirror of the page table (`req_to_page`, [max_requests + 1, max_pages_per_request]) is
written incrementally (only new pages, one scatter per step), so a decode step never rebuilds it.

Page 0 and table row 0 are scratch: padded rows of a CUDA-graph batch point at them, read one junk
token and write their junk KV there, so graph replay needs no branches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rltool.convert.fp8 import E4M3_MAX, SCALE_FLOOR
from rltool.engine.host_kv import HostKV, TierStats, reload_prefix, write_back
from rltool.engine.radix_cache import Node, RadixCache
from rltool.errors import EngineError


STAGING_CAPACITY = 4096  # page-table updates one flush stages in pinned memory


class OutOfPagesError(EngineError):
    """The KV pool has no free page for a request (the scheduler retracts or waits)."""


class PageAllocator:
    """Free list of page ids 1..num_pages-1; page 0 is the scratch page."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise EngineError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        # Popped from the end: low ids first, so a fresh engine fills the pool from its start.
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} KV pages, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class PageEntry:
    row: int  # row of req_to_page
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is (or is being) written
    shared: list[Node] = field(default_factory=list)  # prefix-cache nodes it holds a reference on
    epoch: int = 0  # the prefix cache's epoch when its KV started


class PageTable:
    """Which pages each request owns, and the device-side copy the attention kernels read."""

    def __init__(self, *, num_pages: int, page_size: int, max_requests: int,
                 max_pages_per_request: int, device: torch.device | str,
                 prefix_cache: bool = False, host_pages: int = 0,
                 stats: TierStats | None = None):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(page_size=page_size, host_pages=host_pages) if prefix_cache else None
        self.host: HostKV | None = None  # the host tier's pool, attached once the KV pool exists
        self.stats = stats if stats is not None else TierStats()
        self.max_pages_per_request = max_pages_per_request
        self.entries: dict[str, PageEntry] = {}
        self._rows = list(range(max_requests, 0, -1))  # row 0 is scratch
        self.req_to_page = torch.zeros(max_requests + 1, max_pages_per_request, dtype=torch.int32,
                                       device=device)
        self._pending: list[tuple[int, int, int]] = []  # (row, page index, page id)
        # Pinned staging for the scatter, used alternately: a copy from pageable memory would
        # wait for the device to finish queued work, which breaks overlapped decoding. Flat, so
        # the n updates of a flush are one contiguous slice (a strided slice of pinned memory is
        # first gathered into pageable memory, with the same wait).
        self._staging = ([(torch.empty(3 * STAGING_CAPACITY, dtype=torch.long).pin_memory(),
                           torch.cuda.Event()) for _ in range(2)]
                         if torch.device(device).type == "cuda" else [])
        self._flushes = 0

    @property
    def free_pages(self) -> int:
        """Pages a request can get: free ones and those the prefix cache would evict."""
        return self.allocator.available + (self.cache.evictable() if self.cache else 0)

    def has_free(self, n: int) -> bool:
        """Whether `n` pages can be had; counts the cache's evictable pages (a walk of the tree)
        only when the free list alone is short, so the decode step's check stays O(1)."""
        return self.allocator.available >= n or self.free_pages >= n

    def _alloc(self, n: int) -> list[int]:
        short = n - self.allocator.available
        if short > 0 and self.host is not None:
            self.allocator.free(write_back(self, short))
        elif short > 0 and self.cache is not None:
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(n)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def extra_pages(self, rid: str, length: int) -> int:
        """Pages `rid` would need to hold `length` tokens (0 if it already can)."""
        entry = self.entries.get(rid)
        have = len(entry.pages) if entry is not None else 0
        return max(self.pages_for(length) - have, 0)

    def add(self, rid: str) -> PageEntry:
        if rid in self.entries:
            return self.entries[rid]
        if not self._rows:
            raise EngineError("no free page-table row; more requests than --max-running-requests")
        entry = PageEntry(row=self._rows.pop(), epoch=self.cache.epoch if self.cache else 0)
        self.entries[rid] = entry
        return entry

    def extend(self, rid: str, length: int) -> PageEntry:
        """Grow `rid` to hold `length` tokens, allocating pages as needed (all or nothing)."""
        entry = self.entries[rid]
        need = self.pages_for(length)
        if need > self.max_pages_per_request:
            raise EngineError(f"request {rid} needs {need} pages; at most "
                              f"{self.max_pages_per_request} fit its page-table row")
        new = self._alloc(need - len(entry.pages)) if need > len(entry.pages) else []
        for page in new:
            self._pending.append((entry.row, len(entry.pages), page))
            entry.pages.append(page)
        entry.length = max(entry.length, length)
        return entry

    def slots(self, rid: str, start: int, end: int) -> list[int]:
        """Pool slots of tokens [start, end) of `rid`."""
        pages, ps = self.entries[rid].pages, self.page_size
        return [pages[j // ps] * ps + j % ps for j in range(start, end)]

    def block_slots(self, rows: torch.Tensor, positions: torch.Tensor, steps: int
                    ) -> torch.Tensor:
        """Pool slots [steps - 1, B] of the `steps` - 1 tokens after `positions` of the requests in
        page-table `rows` (pages reserved and flushed), looked up in `req_to_page` on the device:
        no host work per request."""
        ps = self.page_size
        pos = positions + torch.arange(1, steps, device=positions.device).unsqueeze(1)
        pages = self.req_to_page[rows, torch.div(pos, ps, rounding_mode="floor")]
        return pages.long() * ps + pos % ps

    def remove(self, rid: str) -> None:
        entry = self.entries.pop(rid, None)
        if entry is None:
            return
        shared = entry.shared
        # Its own pages: those past its cached prefix, or copies of pages the cache already held.
        self.allocator.free([p for i, p in enumerate(entry.pages)
                             if i >= len(shared) or shared[i].page != p])
        if self.cache is not None:
            self.allocator.free(self.cache.unlock(shared))
        self._rows.append(entry.row)

    # ----- prefix cache ------------------------------------------------------------------------

    def reuse_prefix(self, rid: str, tokens: list[int], *, max_tokens: int, pool: "KVPool",
                     spare: int = 0) -> int:
        """Start the new request `rid` on the cached KV of the longest cached prefix of `tokens`
        (at most `max_tokens` tokens): the cached pages of its full pages, shared, and, when the
        prefix ends inside a cached page, a fresh page of its own into which `pool` copies that
        page's first tokens (copy-on-write: the request appends to its copy; skipped unless a page
        is free beyond the `spare` ones kept for running requests). Returns the tokens reused."""
        if self.cache is None or rid in self.entries:
            return 0
        ps = self.page_size
        max_tokens = max(max_tokens, 0)
        entry = self.add(rid)
        nodes = self.cache.match(tokens)[:max_tokens // ps]
        self.cache.lock(nodes)
        self.stats.device_hit_tokens += len(nodes) * ps
        tail = None  # a page reloaded only to copy its first tokens from
        if self.host is not None:
            more, tail = reload_prefix(self, nodes, tokens, max_tokens // ps - len(nodes),
                                       tail=max_tokens % ps > 0, spare=spare)
            nodes = nodes + more
        entry.shared = nodes
        for node in nodes:
            self._pending.append((entry.row, len(entry.pages), node.page))
            entry.pages.append(node.page)
        entry.length = len(nodes) * ps
        source, n = self.cache.partial(nodes, tokens[entry.length:entry.length + ps],
                                       max_tokens - entry.length)
        if source is None:
            return entry.length
        self.cache.lock([source])  # neither counted nor evicted as room for its own copy
        page = self._alloc(1)[0] if self.has_free(1 + spare) else None
        self.cache.unlock([source])  # attached: nothing to free
        if page is None:
            return entry.length
        # The copy is queued before anything else can take the source page.
        self._pending.append((entry.row, len(entry.pages), page))
        entry.pages.append(page)
        entry.length += n
        pool.copy_tokens(source.page, page, n, page_size=ps)
        if source is tail:
            self.stats.host_hit_tokens += n
        else:
            self.stats.device_hit_tokens += n
        return entry.length

    def cache_prefix(self, rid: str, tokens: list[int]) -> None:
        """Offer the full pages of `tokens` (whose KV `rid` has written) to the prefix cache;
        KV begun before the last flush or weight update is never offered."""
        entry = self.entries.get(rid)
        if self.cache is None or entry is None or entry.epoch != self.cache.epoch:
            return
        path, _ = self.cache.insert(tokens[:entry.length], entry.pages)
        self.cache.lock(path)
        self.allocator.free(self.cache.unlock(entry.shared))
        entry.shared = path

    def flush_prefix_cache(self) -> None:
        """Empty the prefix cache (pages still read by requests are freed when they finish)."""
        if self.cache is not None:
            self.allocator.free(self.cache.clear())

    def clear(self) -> None:
        for rid in list(self.entries):
            self.remove(rid)
        self._pending.clear()

    def flush(self) -> None:
        """Write the page ids allocated since the last flush into `req_to_page` (one scatter)."""
        if not self._pending:
            return
        n = len(self._pending)
        host = torch.from_numpy(np.asarray(list(zip(*self._pending)), dtype=np.int64))
        self._pending.clear()
        copied = None
        if self._staging and n <= STAGING_CAPACITY:
            self._flushes += 1
            staging, copied = self._staging[self._flushes % 2]
            copied.synchronize()  # the copy queued from this buffer two flushes ago has run
            pinned = staging[:3 * n].view(3, n)
            pinned.copy_(host)
            host = pinned
        dev = host.to(self.req_to_page.device, non_blocking=True)
        if copied is not None:
            copied.record()
        self.req_to_page.index_put_((dev[0], dev[1]), dev[2].to(torch.int32))


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


class KVPool:
    """K and V for every layer: [layers, num_pages * page_size, kv_heads, head_dim] each, in the
    model dtype, or (kv_cache_dtype fp8_e4m3) in float8_e4m3fn with one float32 scale per token
    and KV head for each of K and V (`k_scale`, `v_scale` [layers, slots, kv_heads]), computed
    when the token's KV is written: `quantize_kv`."""

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 kv_cache_dtype: str = "auto", kv_layers: tuple[int, ...] | None = None):
        """`kv_layers`: the model layers that have KV, in order (a hybrid's attention layers;
        default all `num_layers`); `layer(i)` takes the model's layer index."""
        self._slot = ({layer: j for j, layer in enumerate(kv_layers)}
                      if kv_layers is not None else None)
        num_layers = len(kv_layers) if kv_layers is not None else num_layers
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.fp8 = kv_cache_dtype == "fp8_e4m3"
        store = torch.float8_e4m3fn if self.fp8 else dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if self.fp8:
            self.k_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.ones(shape[:3], dtype=torch.float32, device=device)
        # An MoE model's routed experts per slot, kept with their KV (rltool.engine.moe)
        self.routed: Any = None

    @staticmethod
    def bytes_per_token(spec: Any, *, dtype: torch.dtype, kv_cache_dtype: str) -> int:
        """K and V of one token in every layer of a model (`spec`: num_layers, num_kv_heads,
        head_dim; a hybrid's `kv_layers`): 2 * layers * kv_heads * head_dim * element bytes,
        or with fp8_e4m3 2 * layers * kv_heads * (head_dim + 4) (the float32 scales)."""
        per_head = (spec.head_dim + 4 if kv_cache_dtype == "fp8_e4m3"
                    else spec.head_dim * torch.empty((), dtype=dtype).element_size())
        layers = len(getattr(spec, "kv_layers", range(spec.num_layers)))
        return 2 * layers * spec.num_kv_heads * per_head

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                     torch.Tensor | None]:
        """(k, v, k_scale, v_scale) of layer i (scales None unless FP8)."""
        if self._slot is not None:
            i = self._slot[i]
        if not self.fp8:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    def gather(self, i: int, slots: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer i at `slots`, in `dtype` (dequantized when FP8)."""
        k, v, ks, vs = self.layer(i)
        if not self.fp8:
            return k[slots], v[slots]
        return dequantize_kv(k[slots], ks[slots], dtype), dequantize_kv(v[slots], vs[slots], dtype)

    def nbytes(self) -> int:
        scales = 2 * self.k_scale.numel() * 4 if self.fp8 else 0
        return 2 * self.k.numel() * self.k.element_size() + scales

    def copy_tokens(self, src_page: int, dst_page: int, n: int, *, page_size: int) -> None:
        """Copy the KV (and FP8 scales, routed experts) of the first `n` tokens of page
        `src_page` into page `dst_page`, every layer (queued on the current stream, so it lands
        before any later forward reads it)."""
        src, dst = src_page * page_size, dst_page * page_size
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[:, dst:dst + n] = t[:, src:src + n]
        if self.routed is not None:
            self.routed.ids[dst:dst + n] = self.routed.ids[src:src + n]


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, KVH, D] -> (e4m3 [T, KVH, D], float32 scale [T, KVH]): per token and head,
    scale = max(max_d |x|, 1e-12) / 448, q = clamp(x / scale, ±448) rounded to nearest even."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=SCALE_FLOOR) / E4M3_MAX
    return (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                         req_to_page: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                         page_size: int, max_len: int, scale: float,
                         k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference paged decode attention (pure torch; the CPU decode path). q [B, H, D];
    k/v_cache [slots, KVH, D]; rows [B] page-table rows; seq_lens [B] tokens to attend to (the new
    one included); k/v_scale [slots, KVH] for an FP8 cache. Returns [B, H, D] in q's dtype,
    computed in fp32 (FP8 K/V dequantized to fp32 first). The K/V of each row are
    gathered through its pages into [B, KVH, max_len, D] and attended with one masked SDPA call
    (half the time of the einsum formulation on CPU, which copies for its permutes); the gather
    is one index_select over the flattened slots (a third less time than indexing with the
    [B, max_len] slot tensor on CPU, the same values)."""
    pos = torch.arange(max_len, device=q.device)
    pages = req_to_page[rows.long()][:, pos // page_size].long()  # [B, max_len]
    slots = (pages * page_size + pos % page_size).view(-1)
    shape = (pages.shape[0], max_len, *k_cache.shape[1:])
    k = k_cache.index_select(0, slots).view(shape).float()  # [B, L, KVH, D]
    v = v_cache.index_select(0, slots).view(shape).float()
    if k_scale is not None:
        k = k * k_scale.index_select(0, slots).view(shape[:3])[..., None]
        v = v * v_scale.index_select(0, slots).view(shape[:3])[..., None]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, KVH, L, D]
    valid = pos.unsqueeze(0) < seq_lens.unsqueeze(1).long()  # [B, L]
    out = F.scaled_dot_product_attention(q.float().unsqueeze(2), k, v,
                                         attn_mask=valid[:, None, None, :], scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2).to(q.dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [G, n, H, D], k/v [G, L, KVH, D] -> [G, n, H, D]; causal unless `mask` [n, L] is given."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def host_tensor(values: list, dtype: Any = np.int64) -> torch.Tensor:
    """A CPU tensor from (nested) Python lists through numpy: torch.tensor on lists costs ~5x
    more, and on the decode path it is paid for every request of every step."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))
