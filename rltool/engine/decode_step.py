"""A decode step of the running batch: its inputs written on the host (the per-request work of a
step, kept lean), then the forward, replayed from a CUDA graph of the batch's size bucket where
one was captured (rltool.engine.decode_graphs), else run eagerly; and blocks of several steps
whose positions, lengths and KV slots advance on the device.

The inputs are one int64 array of META_ROWS rows by the padded batch: input ids, positions,
page-table rows, sequence lengths, output KV slots, and the row of the previous step's sampled
tokens each input id is taken from (when they stay on the device). Padded rows hold one junk
token of the scratch page.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rltool import trace
from rltool.engine.decode_graphs import DecodeGraphs
from rltool.engine.paged import PageTable
from rltool.engine.paged_forward import PagedForward

GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                 320, 384, 448, 512)
META_ROWS = 6


class Decoder:
    """Decode steps over one loaded model's pool (built with it). On CUDA a batch is padded to
    the smallest of `buckets` that holds it, eagerly too, so eager decode computes exactly what a
    replay does; `capture_graphs` captures each bucket."""

    def __init__(self, forward: PagedForward, table: PageTable, *, max_bs: int):
        self.forward = forward
        self.table = table
        self.max_bs = max_bs
        self.buckets = (sorted({b for b in GRAPH_BUCKETS if b <= max_bs} | {max_bs})
                        if forward.device.type == "cuda" else [])
        self.graphs: DecodeGraphs | None = None
        self._max_len = 1
        self._block: tuple | None = None  # (meta, B, graph, iterator of KV slots): `next`

    def capture_graphs(self) -> None:
        """Capture the step for each bucket (CUDA; in the caller's batch-invariant mode)."""
        self.graphs = DecodeGraphs(self.forward.device, rows=META_ROWS, max_bs=self.max_bs)
        self.graphs.capture(lambda meta: self.forward.decode(meta, max_len=self._max_len),
                            self.buckets)

    def step(self, rids: list[str], token_ids: list[int] | None, *,
             prev_tokens: torch.Tensor | None, src_rows: list[int] | None,
             steps: int) -> torch.Tensor:
        """One step (the first of a block of `steps`): see `PagedRunner.decode`."""
        bucket = next((b for b in self.buckets if b >= len(rids)), None)
        table, B = self.table, len(rids)
        n = bucket or B
        rows, locs, positions = [], [], []
        add_row, add_loc, add_position = rows.append, locs.append, positions.append
        entries, ps, extend = table.entries, table.page_size, table.extend
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
        graph = self.graphs.get(bucket) if self.graphs is not None else None
        if graph is None:
            host = np.empty((META_ROWS, n), dtype=np.int64)
        else:
            host = self.graphs.staging()
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
            meta = torch.from_numpy(host).to(self.forward.device)
            if prev_tokens is not None:
                meta[0, :B] = prev_tokens[meta[5, :B]]
        else:
            meta = self.graphs.upload()
            if prev_tokens is not None:
                torch.index_select(prev_tokens, 0, meta[5, :B], out=meta[0, :B])
        self._block = (meta, B, graph, iter(table.block_slots(meta[2, :B], meta[1, :B], steps))
                       ) if steps > 1 else None
        return self._run(meta, B, graph)

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next step of the block `step(steps=...)` began, fed `tokens` ([B], on device)."""
        full, B, graph, slots = self._block  # positions, lengths and slots advance on the device
        meta = full[:, :B]
        meta[0].copy_(tokens)
        meta[1:4:2] += 1  # positions and sequence lengths
        meta[4].copy_(next(slots))
        self._max_len += 1
        return self._run(full, B, graph)

    def _run(self, meta: torch.Tensor, B: int, graph: tuple[Any, torch.Tensor] | None
             ) -> torch.Tensor:
        """The step's forward (its graph replayed, or eagerly): logits of the first B rows."""
        with trace.span("decode.forward", cat="engine"):
            if graph is None:
                return self.forward.decode(meta, max_len=self._max_len)[:B]
            graph, out = graph
            graph.replay()
            return out[:B]
