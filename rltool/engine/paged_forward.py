"""The engine's model forwards over the paged KV pool: the attention callbacks that the model's
packed forward (rltool.engine.dense_model) calls, for a prefill step, a decode step and a full
pass beside the pool.

Prefill is packed: a step's chunks form one token stream (no padding) through the projections and
MLPs; attention runs per group of equal-length fresh chunks (one causal SDPA call), continuations
of a cached prefix as decode rows (DECODE_QUERIES), or, with --prefill-attention varlen, every
chunk in one variable-length call per layer (rltool.engine.varlen_attention). Decode attends
each row of the batch over the pool: on CUDA with the Triton split-KV kernel (its output written already quantized for an FP8
o_proj), on CPU with the torch reference attention (rltool.engine.decode_rows).

Each prefill step notes its attention calls' shapes in the runner's compile watch
(rltool.engine.compile_watch); `warm_up` runs every path once at build, before the watch's mark.
"""

from __future__ import annotations

from typing import Any

import torch

from rltool.engine import varlen_attention
from rltool.engine.compile_watch import CompileWatch
from rltool.engine.decode_rows import paged_attention, per_request_attention
from rltool.engine.dense_model import DenseLM, fp8_input
from rltool.engine.moe import RoutedExperts
from rltool.engine.paged import KVPool, PageTable, host_tensor, sdpa
from rltool.engine.state_pool import Recurrence, StatePool

# Deterministic mode: every decode attention call splits a request's KV this many ways, so its
# reduction order depends on its own length only, never on the batch.
DETERMINISTIC_SPLITS = 8
# Chunks of at most this many tokens over a cached prefix attend as decode rows, all in one call;
DECODE_QUERIES = 64  # longer ones (chunked prefill) gather their prefix for an SDPA of their own
# The warm-up's chunks: (fresh length, continuation length) per request, the continuations in
# both ways a chunk over a cached prefix attends (decode rows, gathered prefix); then the first
# request's WARMUP_TAIL more tokens alone, a step of 17..32 rows (the GEMMs' middle row block)
WARMUP_CHUNKS = ((40, DECODE_QUERIES // 4), (96, DECODE_QUERIES + 16))
WARMUP_TAIL = 24


class PagedForward:
    """The forwards of one loaded model over its KV pool and page table (built with them, dropped
    when the runner releases them). Deterministic: attention per request where batching would
    change a request's numbers."""

    def __init__(self, model: DenseLM, pool: KVPool, table: PageTable, *, deterministic: bool,
                 states: StatePool | None = None, varlen: bool = False,
                 watch: CompileWatch | None = None):
        """`states`: a hybrid model's recurrent-state pool (rltool.engine.state_pool); `varlen`:
        prefill attention in one variable-length call per layer (ignored when deterministic);
        `watch`: where the prefill notes its attention shapes (the runner's, kept across
        release and resume)."""
        self.varlen = varlen
        self.watch = watch if watch is not None else CompileWatch()
        self.model = model
        self.pool = pool
        self.table = table
        self.states = states
        self.deterministic = deterministic
        self.device = model.device
        self.scale = model.spec.head_dim ** -0.5

    def prefill(self, chunks: list[tuple[str, list[int], int]], *, want: list[bool]
                ) -> torch.Tensor | None:
        """Write the KV of each chunk (rid, token ids, first position) into the pool in one packed
        forward. Returns float32 logits of the last token of each chunk with want[i], in order."""
        table, dev = self.table, self.device
        order = sorted(range(len(chunks)), key=lambda i: (chunks[i][2] > 0, len(chunks[i][1])))
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        last: dict[int, int] = {}
        groups: list[tuple[int, int, int]] = []  # fresh chunks: (offset, count, length)
        cont: list[tuple[int, int, int, list[int]]] = []  # (offset, length, start, kv slots)
        singles: list[tuple[int, int, int]] = []  # continuation tokens: (offset, row, length)
        segments: list[tuple[int, int, int, bool]] = []  # hybrid: (offset, length, slot, fresh)
        # --prefill-attention varlen (not deterministic): one attention call per layer
        varlen = [] if self.varlen and not self.deterministic else None
        for i in order:
            rid, toks, start = chunks[i]
            n = len(toks)
            entry = table.add(rid)
            if self.states is not None:
                segments.append((len(ids), n, self.states.bind(rid, entry.row), start == 0))
            table.extend(rid, start + n)
            offset = len(ids)
            ids += toks
            pos += range(start, start + n)
            loc += table.slots(rid, start, start + n)
            last[i] = offset + n - 1
            if varlen is not None:
                varlen.append((offset, n, start, table.slots(rid, 0, start + n) if start else None))
            elif 0 < start and n <= DECODE_QUERIES and not self.deterministic:  # as decode rows
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
        plan = (varlen_attention.plan(varlen, num_tokens=len(ids), device=dev,
                                      flash=varlen_attention.can_flash(dev, model.dtype))
                if varlen is not None else None)
        self.watch.note_shapes(attention_shapes(groups, cont, plan))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc, ks, vs = pool.layer(layer)  # fresh chunks attend to their own k, v
            model.rope_store(q, k, v, pos_t, k_cache=kc, v_cache=vc, loc=loc_t, k_scale=ks,
                             v_scale=vs)
            if plan is not None:
                kv = pool.gather(layer, plan.slots, q.dtype) if plan.slots is not None else None
                return varlen_attention.attend(plan, q, k, v, scale=self.scale, pool_kv=kv)
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

        if self.states is not None:
            hidden = model.hidden(ids_t, attend, recurrence=Recurrence(self.states, segments))
        else:
            hidden = RoutedExperts.hidden(model, ids_t, attend, pool.routed, loc_t)
        rows = [last[i] for i in range(len(chunks)) if want[i]]
        if not rows:
            return None
        return self.model.logits(hidden[torch.tensor(rows).to(dev)])

    @torch.no_grad()
    def warm_up(self) -> None:
        """On CUDA, run every prefill attention path, an eager decode step and the sampler on
        both steps' logits once over scratch requests (freed after), so that serving compiles
        no Triton kernel and meets no attention shape of these paths first; then mark the
        watch's baseline. Skipped where the pool lacks the pages, rows or (a hybrid's) state
        slots."""
        table = self.table
        rids = [f"warmup-{i}" for i in range(len(WARMUP_CHUNKS))]
        lengths = [a + b + (WARMUP_TAIL if i == 0 else 0)
                   for i, (a, b) in enumerate(WARMUP_CHUNKS)]
        pages = [table.pages_for(n + 1) for n in lengths]
        free_rows = table.req_to_page.shape[0] - 1 - len(table.entries)  # row 0: scratch
        slots = self.states.available if self.states is not None else len(rids)
        if (self.device.type == "cuda" and table.has_free(sum(pages)) and len(rids) <= free_rows
                and max(pages) <= table.max_pages_per_request and len(rids) <= slots):
            try:
                self.prefill([(r, [1] * a, 0) for r, (a, _) in zip(rids, WARMUP_CHUNKS)],
                             want=[True] * len(rids))
                prefilled = self.prefill([(r, [1] * b, a)
                                          for r, (a, b) in zip(rids, WARMUP_CHUNKS)],
                                         want=[True] * len(rids))
                self.prefill([(rids[0], [1] * WARMUP_TAIL, sum(WARMUP_CHUNKS[0]))], want=[True])
                for r, n in zip(rids, lengths):
                    table.extend(r, n + 1)
                table.flush()
                meta = host_tensor([[1] * len(rids), lengths,
                                    [table.entries[r].row for r in rids],
                                    [n + 1 for n in lengths],
                                    [table.slots(r, n, n + 1)[0] for r, n in zip(rids, lengths)],
                                    [0] * len(rids)]).to(self.device)
                decoded = self.decode(meta, max_len=max(lengths) + 1)
                warm_up_sampler([prefilled, decoded])
                torch.cuda.synchronize(self.device)
            finally:
                for r in rids:
                    table.remove(r)
                    if self.states is not None:
                        self.states.free(r)
        self.watch.mark_warm()

    def decode(self, meta: torch.Tensor, *, max_len: int) -> torch.Tensor:
        """Logits [N, V] of one decode step over the batch that `meta` describes (the rows of
        rltool.engine.decode_step: input ids, positions, page-table rows, sequence lengths, KV
        slots), in the model dtype on CUDA. `max_len`: the longest sequence (the CPU attention's
        bound; the CUDA kernel reads the lengths on the device, so a graph replays with any)."""
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
            return paged_attention(q, kc, vc, rows, seq_lens, max_len=max_len,
                                   splits=splits, block_k=fp8_input(model.layers[layer]["o"]),
                                   k_scale=ks, v_scale=vs, **paging)

        # Logits stay in the model dtype here (the sampling kernel reads them as they are): the
        # float32 copy of a [256, 152k] batch would cost as much as a layer.
        if self.states is not None:  # each row's GDN states: its page-table row's slot
            rec = Recurrence(self.states, slots=self.states.slot_of_row[rows])
            hidden = model.hidden(ids, attend, recurrence=rec)
        else:
            hidden = RoutedExperts.hidden(model, ids, attend, pool.routed, loc)  # MoE: no graph
        return model.logits(hidden, upcast=self.device.type != "cuda")

    def _paging(self) -> dict[str, Any]:
        """The page table and attention scale, as `decode_rows`' functions take them."""
        return {"req_to_page": self.table.req_to_page, "page_size": self.table.page_size,
                "scale": self.scale}

    def full_pass(self, token_ids: list[int], collect: list[torch.Tensor] | None = None
                  ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of one unpadded causal pass over the whole
        sequence, without touching the KV pool (`collect`: as `DenseLM.hidden` takes it)."""
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


def attention_shapes(groups: list[tuple[int, int, int]],
                     cont: list[tuple[int, int, int, list[int]]],
                     plan: varlen_attention.VarlenPlan | None) -> list[tuple]:
    """The (kind, shape) keys of one prefill step's attention calls (CompileWatch.note_shapes):
    grouped fresh chunks (count, length), a long continuation (length, key length), the masked
    varlen call (queries, keys). The flash varlen call has one key: it takes any segments."""
    if plan is not None:
        if plan.mask is None:
            return [("varlen",)]
        return [("sdpa-mask", *plan.mask.shape)]
    return ([("sdpa-causal", c, n) for _, c, n in groups]
            + [("sdpa-prefix", n, s + n) for _, n, s, _ in cont])


def warm_up_sampler(logits: list[torch.Tensor]) -> None:
    """The Triton sampler (rltool.engine.sampling_kernel) once on each of these logits (a
    prefill's float32 rows, a decode step's in the model dtype), with and without the float32
    logits a batch with logit_bias, stop ids or filters races over."""
    from rltool.engine.sampling_kernel import sample_rows

    for rows in logits:
        n, dev = rows.shape[0], rows.device
        temps, zeros = torch.ones(n, device=dev), torch.zeros(n, dtype=torch.int32, device=dev)
        for draw in (None, rows.float().clone()):
            sample_rows(rows, temps, zeros, zeros, draw=draw)
