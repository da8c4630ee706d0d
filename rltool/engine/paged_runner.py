"""The paged model runner: the engine's own model over a paged KV pool, on CUDA or CPU.

Prefill is packed: a step's chunks form one token stream (no padding) through the projections and
MLPs; attention runs per group of equal-length fresh chunks (one causal SDPA call), continuations
of a cached prefix as decode rows (DECODE_QUERIES). Decode runs the running batch as one step over
the paged pool: on CUDA with the Triton split-KV kernel, in a CUDA graph per batch-size bucket (its
output written already quantized for an FP8 o_proj); on CPU with the torch reference attention
(rltool.engine.decode_rows).

Memory on CUDA: weights, then the KV pool sized once from what `--mem-fraction-static` leaves
(fraction x total memory, minus what is in use), then the graphs. `release` frees all three;
`resume` reloads the weights from the checkpoint last loaded and recaptures the graphs.

Every method runs on the scheduler thread.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltool import batch_invariant
from rltool.engine import quant
from rltool.engine.decode_rows import paged_attention, per_request_attention
from rltool.engine.dense_model import DenseLM, fp8_input, load_model
from rltool.engine.model_checkpoint import load_checkpoint
from rltool.engine.model_spec import read_spec
from rltool.engine.loading import check_servable, eos_token_ids, load_tokenizer, loading
from rltool.engine.moe import RoutedExperts
from rltool.engine.paged import KV_CACHE_DTYPES, KVPool, PageTable, host_tensor, sdpa
from rltool.errors import BadInputError, EngineError
from rltool.faults import kill_point

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                 320, 384, 448, 512)
# input ids, positions, page-table rows, sequence lengths, output slots, and the row of the previous
# step's sampled tokens each input id is taken from (when they stay on the device)
META_ROWS = 6
# Deterministic mode: every decode attention call splits a request's KV this many ways, so its
# reduction order depends on its own length only, never on the batch.
DETERMINISTIC_SPLITS = 8
# Chunks of at most this many tokens over a cached prefix attend as decode rows, all in one call;
DECODE_QUERIES = 64  # longer ones (chunked prefill) gather their prefix for an SDPA of their own


class PagedRunner:
    paged = True

    def __init__(self, model_path: str | Path, *, device: str = "cuda", dtype: str = "bf16",
                 weight_version: str = "default", max_running: int = 64, page_size: int = 16,
                 mem_fraction_static: float = 0.85, max_total_tokens: int | None = None,
                 cuda_graph_max_bs: int = 256, disable_cuda_graph: bool = False,
                 prefix_cache: bool = True, deterministic: bool = False,
                 kv_cache_dtype: str = "auto"):
        if dtype not in DTYPES:
            raise BadInputError(f"unknown --dtype {dtype!r}; choose fp32 or bf16")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BadInputError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose auto or "
                                "fp8_e4m3")
        self.kv_cache_dtype = kv_cache_dtype
        self.model_path = Path(model_path)
        self.tokenizer_path = self.model_path
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_version = weight_version
        self.config_json = check_servable(self.model_path)
        self.spec = read_spec(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.context_length = self.spec.max_position_embeddings
        self.vocab_size = self.spec.vocab_size
        self.eos_token_ids = eos_token_ids(self.model_path, self.config_json, self.tokenizer)
        self.max_running = max_running
        self.page_size = page_size
        self.mem_fraction_static = mem_fraction_static
        self.max_total_tokens = max_total_tokens
        # An MoE layer sizes its expert GEMMs on the host (rltool.engine.moe): no graph capture.
        self.use_graphs = (self.device.type == "cuda" and not disable_cuda_graph
                           and self.spec.moe is None)
        self.deterministic = deterministic
        # The Triton kernels (sampler, batch-invariant ops) run on CUDA, and on CPU under
        # TRITON_INTERPRET=1 (tests). Deterministic without them (CPU): a forward per request.
        self.triton_kernels = self.device.type == "cuda" or batch_invariant.INTERPRETED
        self.invariant_kernels = deterministic and self.triton_kernels
        # Deterministic: a reused prefix would compute a prompt's tail in another attention
        # layout than a fresh prefill, so whether a prompt hit the cache would change its numbers.
        self.prefix_cache = prefix_cache and not deterministic
        self.cuda_graph_max_bs = min(cuda_graph_max_bs, max_running)
        self.scale = self.spec.head_dim ** -0.5
        top = self.cuda_graph_max_bs
        self._buckets = (sorted({b for b in GRAPH_BUCKETS if b <= top} | {top})
                         if self.device.type == "cuda" else [])
        self.model: DenseLM | None = None
        self.pool: KVPool | None = None
        self.table: PageTable | None = None
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._meta: torch.Tensor | None = None
        self._host_meta: list[tuple[torch.Tensor, Any]] = []  # pinned, two (see `decode`)
        self._calls, self._max_len = 0, 1
        self._block: tuple | None = None  # (meta, B, graph, iterator of KV slots): `decode_next`
        self._build()

    # ----- memory --------------------------------------------------------------------------

    def _build(self) -> None:
        self.model = loading(self.model_path, "model", lambda: load_model(
            self.model_path, device=self.device, dtype=DTYPES[self.dtype], spec=self.spec,
            fp8_resident=self.device.type == "cuda" and not self.deterministic))
        self.weight_info = quant.describe(self.model.fp8_keys, quant.read_format(
            self.config_json, where=str(self.model_path)), self.dtype)
        if self.deterministic:  # transformers' ops one by one (the trainer's), invariant kernels
            self.model.fused = False
        self.model.rope_table(self.context_length)
        self.kv_bytes_per_token = KVPool.bytes_per_token(
            self.spec, dtype=DTYPES[self.dtype], kv_cache_dtype=self.kv_cache_dtype)
        per_token = self.kv_bytes_per_token + RoutedExperts.bytes_per_token(self.spec.moe)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - self.mem_fraction_static)
            tokens = int(budget // per_token)
        else:
            tokens = self.max_running * min(self.context_length, 4096)
        if self.max_total_tokens:
            tokens = min(tokens, self.max_total_tokens)
        num_pages = tokens // self.page_size
        if num_pages < 2:
            raise EngineError(f"no room for a KV pool ({tokens} tokens) after the weights; raise "
                              "--mem-fraction-static")
        self.pool = KVPool(num_layers=self.spec.num_layers, num_pages=num_pages,
                           page_size=self.page_size, num_kv_heads=self.spec.num_kv_heads,
                           head_dim=self.spec.head_dim, dtype=DTYPES[self.dtype],
                           device=self.device, kv_cache_dtype=self.kv_cache_dtype)
        self.table = PageTable(num_pages=num_pages, page_size=self.page_size,
                               max_requests=self.max_running,
                               max_pages_per_request=-(-self.context_length // self.page_size),
                               device=self.device, prefix_cache=self.prefix_cache)
        self.max_total_num_tokens = (num_pages - 1) * self.page_size
        self.pool.routed = RoutedExperts.make(self.spec.moe, self.spec.num_layers,
                                              slots=num_pages * self.page_size, device=self.device)
        log.info("KV pool: %d pages of %d tokens (%.2f GiB); weights %.2f GiB", num_pages,
                 self.page_size, self.pool.nbytes() / 2**30, self.model.nbytes() / 2**30)
        if self.use_graphs:
            self._capture()

    @property
    def released(self) -> bool:
        return self.model is None

    def release(self) -> None:
        """Free weights, KV pool and CUDA graphs (the scheduler has retracted every request)."""
        self.graphs.clear()
        self.model = self.pool = self.table = None
        self._meta = self._block = None
        self._host_meta = []
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def resume(self) -> None:
        if self.model is None:
            self._build()

    def load_weights(self, path: str | Path) -> int:
        """Copy a HF checkpoint's tensors into the live model, all or nothing (names, shapes)."""
        if self.model is None:
            raise BadInputError("weights are released; call /resume_memory_occupation first")
        n = load_checkpoint(self.model, Path(path),
                            before_copy=lambda: kill_point("engine.copy_param"))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.model_path = Path(path)
        return n

    def load_named_tensors(self, named: list[tuple[str, Any]], *, block: Any = None) -> int:
        """Copy named HF tensors (any subset, e.g. a bucket of an in-memory update; with `block`,
        FP8 weights and their scales) into their slices of the fused layout after checking every
        name, shape and dtype (all or nothing). Views of a sender's buffer are copied, not kept."""
        if self.model is None:
            raise BadInputError("weights are released; call /resume_memory_occupation first")
        named = named if block is None else quant.pair_scales(named, (block[0], block[1]))
        keep = self.model.checked_tensors(named, update_dtype=DTYPES[self.dtype])
        n = self.model.load_tensors(keep)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sender may reuse its buffer after we answer
        return n

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

    def clear(self) -> None:
        if self.table is not None:
            self.table.clear()

    def reuse_prefix(self, rid: str, tokens: list[int], *, max_tokens: int,
                     spare: int = 0) -> int:
        return self.table.reuse_prefix(rid, tokens, max_tokens=max_tokens, pool=self.pool,
                                       spare=spare)

    def cache_prefix(self, rid: str, tokens: list[int]) -> None:
        self.table.cache_prefix(rid, tokens)

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
        with self.invariant():
            return self._prefill(chunks, want=want)

    def _prefill(self, chunks: list[tuple[str, list[int], int]], *, want: list[bool]
                 ) -> torch.Tensor | None:
        table, dev = self.table, self.device
        order = sorted(range(len(chunks)), key=lambda i: (chunks[i][2] > 0, len(chunks[i][1])))
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        last: dict[int, int] = {}
        groups: list[tuple[int, int, int]] = []  # fresh chunks: (offset, count, length)
        cont: list[tuple[int, int, int, list[int]]] = []  # (offset, length, start, kv slots)
        singles: list[tuple[int, int, int]] = []  # continuation tokens: (offset, row, length)
        for i in order:
            rid, toks, start = chunks[i]
            n = len(toks)
            table.add(rid)
            table.extend(rid, start + n)
            offset = len(ids)
            ids += toks
            pos += range(start, start + n)
            loc += table.slots(rid, start, start + n)
            last[i] = offset + n - 1
            if 0 < start and n <= DECODE_QUERIES and not self.deterministic:  # as decode rows
                singles += ((offset + j, table.entries[rid].row, start + j + 1) for j in range(n))
            elif start > 0:
                cont.append((offset, n, start, table.slots(rid, 0, start + n)))
            elif (groups and groups[-1][2] == n and groups[-1][0] + groups[-1][1] * n == offset
                  and not self.deterministic):  # deterministic: attention per request
                o, c, _ = groups[-1]
                groups[-1] = (o, c + 1, n)
            else:
                groups.append((offset, 1, n))
        table.flush()
        ids_t, pos_t, loc_t = host_tensor([ids, pos, loc]).to(dev, non_blocking=True)
        cont_t = [(o, n, s, host_tensor(sl).to(dev, non_blocking=True)) for o, n, s, sl in cont]
        single_t = host_tensor(list(zip(*singles))).to(dev, non_blocking=True) if singles else None
        pool, model = self.pool, self.model

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc, ks, vs = pool.layer(layer)  # fresh chunks attend to their own k, v
            model.rope_store(q, k, v, pos_t, k_cache=kc, v_cache=vc, loc=loc_t, k_scale=ks,
                             v_scale=vs)
            out = torch.empty_like(q)
            for o, c, n in groups:
                out[o:o + c * n] = sdpa(q[o:o + c * n].view(c, n, *q.shape[1:]),
                                         k[o:o + c * n].view(c, n, *k.shape[1:]),
                                         v[o:o + c * n].view(c, n, *v.shape[1:]),
                                         scale=self.scale).reshape(c * n, *q.shape[1:])
            if single_t is not None:  # one batched paged-attention call for every such token
                at, rows_s, lens_s = single_t
                out[at] = paged_attention(q[at], kc, vc, rows_s, lens_s, k_scale=ks, v_scale=vs,
                                          max_len=max(length for *_, length in singles),
                                          **self._paging())
            for o, n, s, slots in cont_t:
                mask = (torch.arange(s + n, device=dev).unsqueeze(0)
                        <= torch.arange(s, s + n, device=dev).unsqueeze(1))
                kp, vp = pool.gather(layer, slots, q.dtype)
                out[o:o + n] = sdpa(q[o:o + n].unsqueeze(0), kp.unsqueeze(0), vp.unsqueeze(0),
                                     scale=self.scale, mask=mask).squeeze(0)
            return out

        hidden = RoutedExperts.hidden(model, ids_t, attend, pool.routed, loc_t)
        rows = [last[i] for i in range(len(chunks)) if want[i]]
        if not rows:
            return None
        return self.model.logits(hidden[torch.tensor(rows).to(dev)])

    @torch.no_grad()
    def decode(self, rids: list[str], token_ids: list[int] | None, *,
               prev_tokens: torch.Tensor | None = None,
               src_rows: list[int] | None = None, steps: int = 1) -> torch.Tensor:
        """One decode step: token_ids[i] is fed to request rids[i] (its KV grows by one token), or,
        with `prev_tokens` (a device tensor of the last step's samples), prev_tokens[src_rows[i]],
        so the step can be queued before the host has seen those tokens. Returns logits [B, V]
        (on CUDA in the model dtype, in a graph's output buffer: valid until the next call).
        `steps` > 1 starts a block of that many steps over the batch: the KV of all of them is
        reserved now (the caller checked the pages are free); `decode_next` runs the others.
        Nothing here waits for the device unless the host is two steps ahead (pinned host
        buffers, used alternately)."""
        # Eager decode on CUDA pads to the same buckets, so it computes exactly what a replay does.
        bucket = next((b for b in self._buckets if b >= len(rids)), None)
        with self.invariant():
            return self._decode(rids, token_ids, prev_tokens, src_rows, bucket, steps)

    @torch.no_grad()
    def decode_next(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next step of the block `decode(steps=...)` began, fed `tokens` ([B], on device)."""
        full, B, graph, slots = self._block  # positions, lengths and slots advance on the device
        meta = full[:, :B]
        meta[0].copy_(tokens)
        meta[1:4:2] += 1  # positions and sequence lengths
        meta[4].copy_(next(slots))
        self._max_len += 1
        with self.invariant():
            if graph is None:
                return self._decode_forward(full)[:B]
            graph, out = graph
            graph.replay()
            return out[:B]

    def _decode(self, rids: list[str], token_ids: list[int] | None,
                prev_tokens: torch.Tensor | None, src_rows: list[int] | None,
                bucket: int | None, steps: int) -> torch.Tensor:
        table, B = self.table, len(rids)
        n = bucket or B
        rows, locs, positions = [], [], []
        add_row, add_loc, add_position = rows.append, locs.append, positions.append
        entries, ps, extend = table.entries, self.page_size, table.extend
        for rid in rids:  # the per-request host work of a step: keep it lean
            entry = entries[rid]
            p = entry.length
            if p + steps > len(entry.pages) * ps:
                extend(rid, p + steps)
            else:
                entry.length = p + steps
            add_row(entry.row)
            add_position(p)
            add_loc(entry.pages[p // ps] * ps + p % ps)
        table.flush()
        graph = self.graphs.get(bucket)
        if graph is None:
            host = np.empty((META_ROWS, n), dtype=np.int64)
        else:
            self._calls += 1
            staging, copied = self._host_meta[self._calls % 2]
            copied.synchronize()  # the copy queued from this buffer two calls ago has run
            host = staging.numpy()
        host[0, :B] = token_ids if token_ids is not None else 0
        host[1, :B] = positions
        host[2, :B] = rows
        np.add(host[1, :B], 1, out=host[3, :B])
        host[4, :B] = locs
        host[5, :B] = src_rows if src_rows is not None else np.arange(B)
        host[:, B:n] = 0
        host[3, B:n] = 1  # padded rows: one junk token of the scratch page
        self._max_len = int(host[3, :B].max())
        if graph is None:
            meta = torch.from_numpy(host).to(self.device)
            if prev_tokens is not None:
                meta[0, :B] = prev_tokens[meta[5, :B]]
            self._block = (meta, B, None, iter(table.block_slots(meta[2, :B], meta[1, :B],
                                                                 steps))) if steps > 1 else None
            return self._decode_forward(meta)[:B]
        # The whole staging buffer in one contiguous (so asynchronous) copy: the graphs read
        # their bucket's columns of `_meta`, nothing reads the others.
        self._meta.copy_(staging, non_blocking=True)
        copied.record()
        if prev_tokens is not None:
            torch.index_select(prev_tokens, 0, self._meta[5, :B], out=self._meta[0, :B])
        self._block = (self._meta, B, graph, iter(table.block_slots(
            self._meta[2, :B], self._meta[1, :B], steps))) if steps > 1 else None
        graph, out = graph
        graph.replay()
        return out[:B]

    def _decode_forward(self, meta: torch.Tensor) -> torch.Tensor:
        ids, pos, rows, seq_lens, loc, _ = meta
        pool, model, paging = self.pool, self.model, self._paging()
        alone = self.deterministic and self.device.type != "cuda"  # CPU: each request alone
        splits = DETERMINISTIC_SPLITS if self.deterministic else None

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            kc, vc, ks, vs = pool.layer(layer)
            model.rope_store(q, k, v, pos, k_cache=kc, v_cache=vc, loc=loc, k_scale=ks,
                             v_scale=vs)
            if alone:
                return per_request_attention(q, kc, vc, rows, seq_lens, k_scale=ks, v_scale=vs,
                                             **paging)
            # an FP8 o_proj's input: written quantized for it by the attention kernel (CUDA)
            return paged_attention(q, kc, vc, rows, seq_lens, max_len=self._max_len,
                                   splits=splits, block_k=fp8_input(model.layers[layer]["o"]),
                                   k_scale=ks, v_scale=vs, **paging)

        # Logits stay in the model dtype here (the sampling kernel reads them as they are): the
        # float32 copy of a [256, 152k] batch would cost as much as a layer.
        hidden = RoutedExperts.hidden(model, ids, attend, pool.routed, loc)  # MoE: no graph
        return model.logits(hidden, upcast=self.device.type != "cuda")

    def _paging(self) -> dict[str, Any]:
        """The page table and attention scale, as `decode_rows`' functions take them."""
        return {"req_to_page": self.table.req_to_page, "page_size": self.page_size,
                "scale": self.scale}

    def _capture(self) -> None:
        """Capture the decode step for each batch-size bucket, largest first, in one memory pool."""
        top, buckets = self.cuda_graph_max_bs, self._buckets
        self._meta = torch.zeros(META_ROWS, top, dtype=torch.long, device=self.device)
        self._meta[3] = 1
        self._host_meta = [(torch.zeros(META_ROWS, top, dtype=torch.long,
                                        device="cpu").pin_memory(),
                            torch.cuda.Event()) for _ in range(2)]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        with self.invariant():
            self._capture_buckets(buckets, pool, stream)
        torch.cuda.synchronize(self.device)

    def _capture_buckets(self, buckets: list[int], pool: Any, stream: Any) -> None:
        for bs in reversed(buckets):
            meta = self._meta[:, :bs]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernel, warms cuBLAS
                    self._decode_forward(meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self._decode_forward(meta)
            self.graphs[bs] = (graph, out)

    @torch.no_grad()
    def full_pass_logits(self, token_ids: list[int], *, start: int) -> torch.Tensor:
        """Logits [T - start, V] (float32, on the runner's device) predicting token_ids[start:],
        from one unpadded causal pass over the whole sequence, without touching the KV pool."""
        with self.invariant():
            return self.model.logits(self._full_pass(token_ids)[start - 1:-1])

    @torch.no_grad()
    def hidden_states(self, token_ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """transformers' `output_hidden_states` of the same pass (the embeddings, each decoder
        layer's output, the last one after the final norm: [T, hidden] each), float32 logits."""
        states: list[torch.Tensor] = []
        with self.invariant():
            hidden = self._full_pass(token_ids, collect=states)
            return states, self.model.logits(hidden)

    def _full_pass(self, token_ids: list[int], collect: list[torch.Tensor] | None = None
                   ) -> torch.Tensor:
        dev = self.device
        ids = torch.tensor(token_ids).to(dev)
        pos = torch.arange(len(token_ids), device=dev)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.model.rope_store(q, k, v, pos)
            if self.deterministic:  # transformers' memory layout: the same attention kernel
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            return sdpa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                         scale=self.scale).squeeze(0)

        return self.model.hidden(ids, attend, collect=collect)
