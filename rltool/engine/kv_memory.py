"""The paged runner's KV cache: how many pages it gets and the pool and page table built on them.

On CUDA the pool is sized once, after the weights are loaded, from what `--mem-fraction-static`
leaves (fraction x total memory, minus what is in use), and `--max-total-tokens` caps it; on CPU
`--max-total-tokens` is its size, by default the batch times the context length (at most
4096 tokens each). A request whose prompt + max_new_tokens exceeds the pool is refused when it
is submitted (`check_fits`); one that fits always runs, alone if need be, since decode retracts
the newest requests when pages run short.

A hybrid model (Gated DeltaNet layers) also gets a recurrent-state pool of K slots
(rltool.engine.state_pool). With `--mamba-full-memory-ratio r` the cache budget B (on CPU the
KV of the default pool plus a slot per running request) splits into B/(1+r) for N tokens of KV
(c_A bytes each) and rB/(1+r) for K slots (c_R bytes each), K at most `--max-running-requests`;
on CUDA r defaults to SGLang's 0.9, on CPU without it K = --max-running-requests. With the
prefix cache the K slots also hold its state snapshots (rltool.engine.hybrid_prefix) while
running requests leave them free; the host tier is refused for a hybrid (its pages would go
without their snapshots).

With the prefix cache and `--enable-hierarchical-cache` the pages the prefix cache evicts move
to a host pool (rltool.engine.host_kv) of `--hicache-ratio` times the device pool's pages, or
`--hicache-size` GB.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from rltool.engine.host_kv import HostKV, TierStats, available_host_bytes, host_pool_pages
from rltool.engine.hybrid_prefix import HybridPageTable
from rltool.engine.linear_attention import SSM_DTYPES
from rltool.engine.model_spec import ModelSpec
from rltool.engine.moe import RoutedExperts
from rltool.engine.paged import KVPool, PageTable
from rltool.engine.state_pool import StatePool
from rltool.errors import BadInputError, EngineError

log = logging.getLogger(__name__)
CUDA_MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's default


def check_fits(prompt_len: int, max_new_tokens: int, *, pool_tokens: int) -> None:
    """Refuse a request the KV pool could never hold alone (BadInputError): retraction makes
    room for a request that fits, never for one that outgrows the whole pool."""
    need = prompt_len + max_new_tokens
    if need > pool_tokens:
        raise BadInputError(f"the prompt ({prompt_len} tokens) + max_new_tokens "
                            f"({max_new_tokens}) needs {need} tokens of KV cache, the pool holds "
                            f"{pool_tokens}: raise --max-total-tokens or --mem-fraction-static, "
                            "or ask for fewer tokens")


@dataclass(frozen=True)
class KvMemory:
    """The KV cache's settings: pages of `page_size` tokens for up to `max_running` requests,
    stored in the model dtype or FP8 (`kv_cache_dtype`), with or without the prefix cache."""
    page_size: int
    max_running: int
    mem_fraction_static: float
    max_total_tokens: int | None
    kv_cache_dtype: str
    prefix_cache: bool
    mamba_full_memory_ratio: float | None = None
    mamba_ssm_dtype: str | None = None  # fp32 or bf16; None: the config's
    hicache: bool = False  # the host tier (only with the prefix cache)
    hicache_ratio: float = 2.0
    hicache_size_gb: float = 0.0

    def bytes_per_token(self, spec: ModelSpec, dtype: torch.dtype) -> int:
        return KVPool.bytes_per_token(spec, dtype=dtype, kv_cache_dtype=self.kv_cache_dtype)

    def ssm_dtype(self, spec: ModelSpec) -> torch.dtype:
        """The recurrent state's dtype: --mamba-ssm-dtype, else config.json's (FP8 KV never
        changes it)."""
        return SSM_DTYPES[self.mamba_ssm_dtype or spec.linear.ssm_dtype]

    def state_bytes(self, spec: ModelSpec, dtype: torch.dtype) -> int:
        """c_R: bytes of one recurrent-state slot (0 for a model without GDN layers)."""
        if spec.linear is None:
            return 0
        return spec.linear.state_bytes(ssm_dtype=self.ssm_dtype(spec), conv_dtype=dtype)

    def build(self, spec: ModelSpec, *, device: torch.device, dtype: torch.dtype,
              context_length: int, stats: TierStats | None = None
              ) -> tuple[KVPool, PageTable, StatePool | None]:
        """The pool and its page table, as large as the budget allows (an MoE model's routed
        expert ids take their bytes per token too), and a hybrid's state pool."""
        if spec.linear is not None and self.hicache and self.prefix_cache:
            raise BadInputError("--enable-hierarchical-cache moves KV pages to the host without "
                                "the recurrent-state snapshots a hybrid linear-attention model's "
                                "prefix needs; drop --enable-hierarchical-cache")
        per_token = self.bytes_per_token(spec, dtype) + RoutedExperts.bytes_per_token(spec.moe)
        per_slot = self.state_bytes(spec, dtype)
        ratio = self.mamba_full_memory_ratio
        slots = self.max_running
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            budget = free - total * (1.0 - self.mem_fraction_static)
            tokens = int(budget // per_token)
            if per_slot:
                ratio = ratio or CUDA_MAMBA_FULL_MEMORY_RATIO
        else:  # no memory to measure: --max-total-tokens is the pool's size
            tokens = self.max_total_tokens or self.max_running * min(context_length, 4096)
            budget = tokens * per_token + self.max_running * per_slot
        if per_slot and ratio is not None:
            tokens = int(budget / (1 + ratio) // per_token)
            slots = min(int(ratio * budget / (1 + ratio) // per_slot), self.max_running)
            if slots < 1:
                raise EngineError(f"no room for a recurrent-state slot ({per_slot} bytes) in "
                                  f"{ratio * budget / (1 + ratio):.0f} bytes; raise "
                                  "--mamba-full-memory-ratio or --mem-fraction-static")
        if self.max_total_tokens:
            tokens = min(tokens, self.max_total_tokens)
        num_pages = tokens // self.page_size
        if num_pages < 2:
            raise EngineError(f"no room for a KV pool ({tokens} tokens) after the weights; raise "
                              "--mem-fraction-static")
        pool = KVPool(num_layers=spec.num_layers, num_pages=num_pages, page_size=self.page_size,
                      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=dtype,
                      device=device, kv_cache_dtype=self.kv_cache_dtype,
                      kv_layers=spec.kv_layers if spec.linear is not None else None)
        host_pages = 0
        if self.hicache and self.prefix_cache:
            host_pages = host_pool_pages(device_pages=num_pages, ratio=self.hicache_ratio,
                                         bytes_per_page=per_token * self.page_size,
                                         size_gb=self.hicache_size_gb,
                                         available_bytes=available_host_bytes())
        states = None
        if spec.linear is not None:
            states = StatePool(spec.linear, num_slots=slots, max_requests=self.max_running,
                               conv_dtype=dtype, ssm_dtype=self.ssm_dtype(spec), device=device)
        sizes = dict(num_pages=num_pages, page_size=self.page_size, max_requests=self.max_running,
                     max_pages_per_request=-(-context_length // self.page_size), device=device,
                     stats=stats)
        if states is not None and self.prefix_cache:
            table: PageTable = HybridPageTable(states=states, **sizes)
        else:
            table = PageTable(prefix_cache=self.prefix_cache, host_pages=host_pages, **sizes)
        pool.routed = RoutedExperts.make(spec.moe, spec.num_layers,
                                         slots=num_pages * self.page_size, device=device)
        if host_pages:
            table.host = HostKV(pool, num_pages=host_pages, page_size=self.page_size,
                                stats=table.stats)
        log.info("KV pool: %d pages of %d tokens (%.2f GiB)", num_pages, self.page_size,
                 pool.nbytes() / 2**30)
        if states is not None:
            log.info("recurrent-state pool: %d slots of %d bytes (%.2f GiB)", states.num_slots,
                     states.bytes_per_slot, states.nbytes() / 2**30)
        return pool, table, states
