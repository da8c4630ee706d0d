"""The paged model runner: the engine's own model over a paged KV pool, on CUDA or CPU, as the
scheduler drives it (rltool.engine.paged_scheduler).

It loads the model and answers for it (weights, tokenizer, limits), and holds the collaborators
that do the work: the KV cache's sizing (rltool.engine.kv_memory), the forwards over the pool
(rltool.engine.paged_forward: packed prefill, decode, a full pass beside the pool) and the decode
steps (rltool.engine.decode_step: their inputs, multi-step blocks, and on CUDA a graph per
batch-size bucket, rltool.engine.decode_graphs).

Memory on CUDA: weights, then the KV pool sized from what is left, then the graphs. `release`
frees all three; `resume` reloads the weights from the checkpoint last loaded and recaptures the
graphs.

Every method runs on the scheduler thread.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from pathlib import Path
from typing import Any

import torch

from rltool import batch_invariant
from rltool.engine import quant
from rltool.engine.compile_watch import CompileWatch
from rltool.engine.decode_step import Decoder
from rltool.engine.dense_model import DenseLM, load_model
from rltool.engine.host_kv import TierStats
from rltool.engine.hybrid_model import check_hybrid_flags, load_hybrid
from rltool.engine.kv_memory import KvMemory
from rltool.engine.lora import cache_tokens, is_adapter_dir, is_lora_name
from rltool.engine.lora_registry import LoraRegistry
from rltool.engine.loading import check_servable, eos_token_ids, load_tokenizer, loading
from rltool.engine.model_checkpoint import load_checkpoint
from rltool.engine.model_spec import read_spec
from rltool.engine.paged import KV_CACHE_DTYPES, KVPool, PageTable
from rltool.engine.paged_forward import PagedForward
from rltool.engine.state_pool import StatePool
from rltool.errors import BadInputError
from rltool.faults import kill_point

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PagedRunner:
    paged = True

    def __init__(self, model_path: str | Path, *, device: str = "cuda", dtype: str = "bf16",
                 weight_version: str = "default", max_running: int = 64, page_size: int = 16,
                 mem_fraction_static: float = 0.85, max_total_tokens: int | None = None,
                 cuda_graph_max_bs: int = 256, disable_cuda_graph: bool = False,
                 prefix_cache: bool = True, deterministic: bool = False,
                 kv_cache_dtype: str = "auto", mamba_full_memory_ratio: float | None = None,
                 mamba_ssm_dtype: str | None = None, hicache: bool = False,
                 hicache_ratio: float = 2.0, hicache_size_gb: float = 0.0,
                 prefill_attention: str = "grouped", enable_lora: bool = False,
                 max_lora_rank: int = 16, graph_sampling: bool = True):
        if dtype not in DTYPES:
            raise BadInputError(f"unknown --dtype {dtype!r}; choose fp32 or bf16")
        if prefill_attention not in ("grouped", "varlen"):
            raise BadInputError(f"unknown --prefill-attention {prefill_attention!r}; choose "
                                "grouped or varlen")
        self.prefill_attention = prefill_attention
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BadInputError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose auto or "
                                "fp8_e4m3")
        self.model_path = Path(model_path)
        self.tokenizer_path = self.model_path
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_version = weight_version
        self.config_json = check_servable(self.model_path)
        self.spec = read_spec(self.model_path)
        check_hybrid_flags(self.spec, ratio=mamba_full_memory_ratio, ssm_dtype=mamba_ssm_dtype)
        # --enable-lora: the adapters (rltool.engine.lora_registry), None without LoRA
        self.lora = None
        if enable_lora:
            fmt = quant.read_format(self.config_json, where=str(self.model_path))
            self.lora = LoraRegistry(self.spec, max_rank=max_lora_rank, dtype=DTYPES[dtype],
                                     device=self.device, quantized=fmt is not None)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, self.config_json, self.tokenizer)
        self.deterministic = deterministic
        # The Triton kernels (sampler, batch-invariant ops) run on CUDA, and on CPU under
        # TRITON_INTERPRET=1 (tests). Deterministic without them (CPU): a forward per request.
        self.triton_kernels = self.device.type == "cuda" or batch_invariant.INTERPRETED
        self.invariant_kernels = deterministic and self.triton_kernels
        # Deterministic: a reused prefix would compute a prompt's tail in another attention
        # layout than a fresh prefill, so whether a prompt hit the cache would change its numbers.
        self.kv = KvMemory(page_size=page_size, max_running=max_running,
                           mem_fraction_static=mem_fraction_static,
                           max_total_tokens=max_total_tokens, kv_cache_dtype=kv_cache_dtype,
                           prefix_cache=prefix_cache and not deterministic,
                           mamba_full_memory_ratio=mamba_full_memory_ratio,
                           mamba_ssm_dtype=mamba_ssm_dtype, hicache=hicache,
                           hicache_ratio=hicache_ratio, hicache_size_gb=hicache_size_gb)
        self.tier_stats = TierStats()  # the prefix cache's tiers, kept across release/resume
        self.kv_bytes_per_token = self.kv.bytes_per_token(self.spec, DTYPES[dtype])
        self.state_bytes_per_slot = self.kv.state_bytes(self.spec, DTYPES[dtype])
        # An MoE layer sizes its expert GEMMs on the host (rltool.engine.moe): no graph capture.
        # A hybrid's GDN layers find each row's state slot on the device (slot_of_row), so its
        # decode replays like a dense model's.
        self._use_graphs = (self.device.type == "cuda" and not disable_cuda_graph
                            and self.spec.moe is None)
        self._graph_max_bs = min(cuda_graph_max_bs, max_running)
        # Overlapped decode steps sample inside their forward (and CUDA graph) where the Triton
        # sampler runs; off: after it, as separate launches (the benchmarks' baseline).
        self.graph_sampling = graph_sampling and self.triton_kernels
        self.model: DenseLM | None = None
        self.pool: KVPool | None = None
        self.table: PageTable | None = None
        self.states: StatePool | None = None  # a hybrid model's recurrent states
        self._forward: PagedForward | None = None
        self.decoder: Decoder | None = None
        self.compiles = CompileWatch()  # compilations since the warm-up of each build
        self._build()

    @property
    def context_length(self) -> int:
        return self.spec.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def prefix_cache(self) -> bool:
        return self.kv.prefix_cache

    @property
    def graphs(self) -> dict[int, tuple[Any, torch.Tensor]]:
        """The decode step's CUDA graphs by batch-size bucket (none: eager, or released)."""
        graphs = self.decoder.graphs if self.decoder is not None else None
        return graphs.captured if graphs is not None else {}

    # ----- memory --------------------------------------------------------------------------

    def _build(self) -> None:
        """Load the weights, build the KV pool, capture the decode graphs and warm up; one log
        line gives each phase's seconds (where an engine's start goes)."""
        t0 = time.perf_counter()
        load = load_hybrid if self.spec.linear is not None else functools.partial(
            load_model, fp8_resident=self.device.type == "cuda" and not self.deterministic)
        self.model = loading(self.model_path, "model", lambda: load(
            self.model_path, device=self.device, dtype=DTYPES[self.dtype], spec=self.spec))
        self.weight_info = quant.describe(self.model.fp8_keys, quant.read_format(
            self.config_json, where=str(self.model_path)), self.dtype)
        if self.deterministic:  # transformers' ops one by one (the trainer's), invariant kernels
            self.model.fused = False
        if self.lora is not None:  # before the graphs: they are captured with LoRA on
            # exact: per-module adapter tensors the forward re-reads, which graphs would not
            self.lora.attach(self.model, exact=self.deterministic and not self._use_graphs)
            log.info("LoRA adapter buffers (rank %d): %.2f GiB", self.lora.shapes.max_rank,
                     self.lora.layers.nbytes() / 2**30)
        self.model.rope_table(self.context_length)
        t_weights = time.perf_counter()
        self.pool, self.table, self.states = self.kv.build(self.spec, device=self.device,
                                                           dtype=DTYPES[self.dtype],
                                                           context_length=self.context_length,
                                                           stats=self.tier_stats)
        self.max_total_num_tokens = (self.table.allocator.num_pages - 1) * self.page_size
        self.num_state_slots = self.states.num_slots if self.states is not None else 0
        self._forward = PagedForward(self.model, self.pool, self.table, watch=self.compiles,
                                     deterministic=self.deterministic, states=self.states,
                                     varlen=self.prefill_attention == "varlen")
        self.decoder = Decoder(self._forward, self.table, max_bs=self._graph_max_bs,
                               sample=self.graph_sampling)
        t_pool = time.perf_counter()
        with self.invariant():
            if self._use_graphs:
                self.decoder.capture_graphs()
            t_graphs = time.perf_counter()
            self._forward.warm_up()
        t_end = time.perf_counter()
        log.info("engine built in %.2f s: weights (%.2f GiB) %.2f s, KV pool %.2f s, %d decode "
                 "graphs %.2f s, warm-up %.2f s", t_end - t0, self.model.nbytes() / 2**30,
                 t_weights - t0, t_pool - t_weights, self.decoder.num_graphs(),
                 t_graphs - t_pool, t_end - t_graphs)

    @property
    def released(self) -> bool:
        return self.model is None

    def release(self) -> None:
        """Free weights, KV pool and CUDA graphs (the scheduler has retracted every request)."""
        self.model = self.pool = self.table = self.states = None
        if self.lora is not None:
            self.lora.detach()
        self.tier_stats.host_pages_used = 0
        self._forward = self.decoder = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def resume(self) -> None:
        if self.model is None:
            self._build()

    # ----- weights -------------------------------------------------------------------------

    def load_weights(self, path: str | Path) -> int:
        """Copy a HF checkpoint's tensors into the live model, all or nothing (names, shapes),
        and drop the policy adapter (requests without lora_path run the new base); a LoRA
        adapter directory replaces the policy adapter instead. Returns how many tensors (fused
        linears for an adapter) were loaded."""
        if self.model is None:
            raise BadInputError("weights are released; call /resume_memory_occupation first")
        if is_adapter_dir(Path(path)):  # a LoRA sync: the policy adapter, never the base weights
            if self.lora is None:
                raise BadInputError(f"{path} is a LoRA adapter; start the engine with "
                                    "--enable-lora to serve adapters")
            return self.lora.install_policy(Path(path))
        n = load_checkpoint(self.model, Path(path),
                            before_copy=lambda: kill_point("engine.copy_param"))
        if self.lora is not None:  # new base weights: the policy adapter trained on others goes
            self.lora.clear_policy()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.model_path = Path(path)
        return n

    def load_named_tensors(self, named: list[tuple[str, Any]], *, block: Any = None,
                           lora_config: Any = None) -> int:
        """Copy named HF tensors (any subset, e.g. a bucket of an in-memory update; with `block`,
        FP8 weights and their scales) into their slices of the fused layout after checking every
        name, shape and dtype (all or nothing). Views of a sender's buffer are copied, not kept.
        `lora_config`: with LoRA tensors, the adapter's PEFT config (its scale)."""
        if self.model is None:
            raise BadInputError("weights are released; call /resume_memory_occupation first")
        lora = [is_lora_name(name) for name, _ in named]
        if any(lora):
            if self.lora is None or not all(lora):
                raise BadInputError("LoRA tensors (lora_A/lora_B) need an engine started with "
                                    "--enable-lora, in an update holding only LoRA tensors")
            return self.lora.sync_policy(named, lora_config)
        if lora_config is not None:
            raise BadInputError("lora_config comes with LoRA tensors (lora_A/lora_B); drop it "
                                "from an update of base weights")
        named = named if block is None else quant.pair_scales(named, (block[0], block[1]))
        keep = self.model.checked_tensors(named, update_dtype=DTYPES[self.dtype])
        n = self.model.load_tensors(keep)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sender may reuse its buffer after we answer
        return n

    def use_lora(self, name: str | None) -> None:
        """Run the next forwards with adapter `name` (None: the policy adapter)."""
        if self.lora is not None:
            self.lora.activate(name)

    # ----- bookkeeping used by the scheduler -----------------------------------------------

    def free_pages(self) -> int:
        return self.table.free_pages if self.table is not None else 0

    def has_free_pages(self, n: int) -> bool:
        return self.table is not None and self.table.has_free(n)

    def extra_pages(self, rid: str, length: int) -> int:
        return self.table.extra_pages(rid, length)

    def remove(self, rid: str) -> None:
        if self.table is not None:
            self.table.remove(rid)
        if self.states is not None:
            self.states.free(rid)

    def clear(self) -> None:
        if self.table is not None:
            self.table.clear()
        if self.states is not None:
            self.states.clear()

    def claim_state(self, rid: str) -> bool:
        """A hybrid model's recurrent-state slot for `rid` (held until `remove`); False when
        every slot is held (the request waits). Always True for other models."""
        return self.states is None or self.states.claim(rid)

    def cache_sizes(self) -> dict[str, int]:
        """c_A (KV bytes per token), c_R (bytes per recurrent-state slot), K slots, N tokens."""
        return {"c_A": self.kv_bytes_per_token, "c_R": self.state_bytes_per_slot,
                "K": self.num_state_slots, "N": self.max_total_num_tokens}

    def _cache_key(self, tokens: list[int], lora: str | None) -> list[int]:
        return cache_tokens(tokens, self.lora.tag(lora)) if self.lora is not None else tokens

    def reuse_prefix(self, rid: str, tokens: list[int], *, max_tokens: int,
                     spare: int = 0, lora: str | None = None) -> int:
        """`lora`: the request's adapter (its prefixes are cached apart from other adapters')."""
        return self.table.reuse_prefix(rid, self._cache_key(tokens, lora), max_tokens=max_tokens,
                                       pool=self.pool, spare=spare)

    def cached_prefix_length(self, tokens: list[int]) -> int:
        """Tokens of the longest cached page-aligned prefix of `tokens` (0 without the cache),
        host-tier pages included (a reload is cheaper than a prefill)."""
        cache = self.table.cache if self.table is not None else None
        if cache is None:
            return 0
        path = cache.match(tokens)
        return (len(path) + len(cache.match_host(path, tokens))) * self.page_size

    def cache_prefix(self, rid: str, tokens: list[int], *, lora: str | None = None) -> None:
        self.table.cache_prefix(rid, self._cache_key(tokens, lora))

    def cache_stats(self) -> dict[str, Any]:
        """Hits per tier (tokens), bytes and copy seconds each way, prefill seconds per token and
        time to first token (rltool.engine.host_kv.TierStats; `host_pages` 0: no host tier)."""
        table = self.table
        if table is not None and table.host is not None:
            self.tier_stats.host_pages_used = table.cache.host_used
        return self.tier_stats.as_dict()

    def flush_prefix_cache(self) -> None:
        if self.table is not None:
            self.table.flush_prefix_cache()

    # ----- forwards ------------------------------------------------------------------------

    def invariant(self) -> contextlib.AbstractContextManager:
        """Deterministic mode: matmuls, means and log-softmaxes through the batch-invariant
        kernels (rltool.batch_invariant) while the block runs; otherwise nothing."""
        if not self.invariant_kernels:
            return contextlib.nullcontext()
        return batch_invariant.enabled(self.device.type)

    @torch.no_grad()
    def prefill(self, chunks: list[tuple[str, list[int], int]], *, want: list[bool]
                ) -> torch.Tensor | None:
        """Write the KV of each chunk (rid, token ids, first position) into the pool in one packed
        forward. Returns float32 logits of the last token of each chunk with want[i], in order."""
        tokens = sum(len(c[1]) for c in chunks)
        with self.invariant(), self.tier_stats.prefill(tokens, self.device):
            return self._forward.prefill(chunks, want=want)

    @torch.no_grad()
    def decode(self, rids: list[str], token_ids: list[int] | None, *,
               prev_tokens: torch.Tensor | None = None,
               src_rows: list[int] | None = None, steps: int = 1) -> torch.Tensor | None:
        """One decode step: token_ids[i] is fed to request rids[i] (its KV grows by one token), or,
        with `prev_tokens` (a device tensor of the last step's samples), prev_tokens[src_rows[i]],
        so the step can be queued before the host has seen those tokens. Returns logits [B, V]
        (on CUDA in the model dtype, in a graph's output buffer: valid until the next call), or
        None after `sample_next` (the tokens are `sampled()`).
        `steps` > 1 starts a block of that many steps over the batch: the KV of all of them is
        reserved now (the caller checked the pages are free); `decode_next` runs the others.
        Nothing here waits for the device unless the host is two steps ahead (pinned host
        buffers, used alternately)."""
        with self.invariant():
            return self.decoder.step(rids, token_ids, prev_tokens=prev_tokens,
                                     src_rows=src_rows, steps=steps)

    @torch.no_grad()
    def decode_next(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The next step of the block `decode(steps=...)` began, fed `tokens` ([B], on device)."""
        with self.invariant():
            return self.decoder.next(tokens)

    def sample_next(self, rows: Any) -> None:
        """The next `decode` (and the later steps of its block) samples inside its forward with
        these sampling rows (rltool.engine.decode_sample.sample_rows_of), where `graph_sampling`
        is on; None: it returns logits only."""
        if self.decoder is not None:
            self.decoder.sample_next(rows)

    def sampled(self) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """(tokens [B], logprobs [B] on the device, whether a CUDA graph drew them) of the last
        decode step, if it sampled inside its forward; None otherwise."""
        return self.decoder.sampled if self.decoder is not None else None

    @torch.no_grad()
    def full_pass_logits(self, token_ids: list[int], *, start: int) -> torch.Tensor:
        """Logits [T - start, V] (float32, on the runner's device) predicting token_ids[start:],
        from one unpadded causal pass over the whole sequence, without touching the KV pool."""
        with self.invariant():
            return self.model.logits(self._forward.full_pass(token_ids)[start - 1:-1])

    @torch.no_grad()
    def hidden_states(self, token_ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """transformers' `output_hidden_states` of the same pass (the embeddings, each decoder
        layer's output, the last one after the final norm: [T, hidden] each), float32 logits."""
        states: list[torch.Tensor] = []
        with self.invariant():
            hidden = self._forward.full_pass(token_ids, collect=states)
            return states, self.model.logits(hidden)
