"""The paged runner's KV cache: how many pages it gets and the pool and page table built on them.

On CUDA the pool is sized once, after the weights are loaded, from what `--mem-fraction-static`
leaves (fraction x total memory, minus what is in use); on CPU from the batch and context
lengths. `--max-total-tokens` caps either.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from rltool.engine.model_spec import ModelSpec
from rltool.engine.moe import RoutedExperts
from rltool.engine.paged import KVPool, PageTable
from rltool.errors import EngineError


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

    def bytes_per_token(self, spec: ModelSpec, dtype: torch.dtype) -> int:
        return KVPool.bytes_per_token(spec, dtype=dtype, kv_cache_dtype=self.kv_cache_dtype)

    def build(self, spec: ModelSpec, *, device: torch.device, dtype: torch.dtype,
              context_length: int) -> tuple[KVPool, PageTable]:
        """The pool and its page table, as large as the budget allows (an MoE model's routed
        expert ids take their bytes per token too)."""
        per_token = self.bytes_per_token(spec, dtype) + RoutedExperts.bytes_per_token(spec.moe)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            budget = free - total * (1.0 - self.mem_fraction_static)
            tokens = int(budget // per_token)
        else:
            tokens = self.max_running * min(context_length, 4096)
        if self.max_total_tokens:
            tokens = min(tokens, self.max_total_tokens)
        num_pages = tokens // self.page_size
        if num_pages < 2:
            raise EngineError(f"no room for a KV pool ({tokens} tokens) after the weights; raise "
                              "--mem-fraction-static")
        pool = KVPool(num_layers=spec.num_layers, num_pages=num_pages, page_size=self.page_size,
                      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=dtype,
                      device=device, kv_cache_dtype=self.kv_cache_dtype)
        table = PageTable(num_pages=num_pages, page_size=self.page_size,
                          max_requests=self.max_running,
                          max_pages_per_request=-(-context_length // self.page_size),
                          device=device, prefix_cache=self.prefix_cache)
        pool.routed = RoutedExperts.make(spec.moe, spec.num_layers,
                                         slots=num_pages * self.page_size, device=device)
        return pool, table
