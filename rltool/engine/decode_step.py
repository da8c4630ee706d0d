"""A decode step of the running batch: its inputs written on the host (the per-request work of a
step, kept lean), then the forward, replayed from a CUDA graph of the batch's size bucket where
one was captured (rltool.engine.decode_graphs), else run eagerly; and blocks of several steps
whose positions, lengths and KV slots advance on the device.

The inputs are one int64 array of META_ROWS rows by the padded batch: input ids, positions,
page-table rows, sequence lengths, output KV slots, and the row of the previous step's sampled
tokens each input id is taken from (when they stay on the device). Padded rows hold one junk
token of the scratch page. A step handed the batch's sampling rows (`sample_next`) samples inside
its forward: the rows go below those, in the same upload, and the step runs
`decode_sample.sample_and_advance` after the forward, in the same graph (or eagerly, the same
function), leaving its tokens and logprobs in `sampled` and the next step's inputs in place.
Sampling rows with the draw rows (logit_bias, stop ids) pick the graph that races over draw
logits.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from rltool import trace
from rltool.engine.decode_graphs import DecodeGraphs
from rltool.engine.decode_sample import PAD_COLUMN, SAMPLE_ROWS, sample_and_advance
from rltool.engine.paged import PageTable
from rltool.engine.paged_forward import PagedForward

GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                 320, 384, 448, 512)
META_ROWS = 6
# A padded column: input id 0 at position 0 of the scratch row, one junk token, its KV in slot 0.
PAD_META = np.array([0, 0, 0, 1, 0, 0], dtype=np.int64)


class Decoder:
    """Decode steps over one loaded model's pool (built with it). On CUDA a batch is padded to
    the smallest of `buckets` that holds it, eagerly too, so eager decode computes exactly what a
    replay does; `capture_graphs` captures each bucket. `sample`: steps may sample inside their
    forward (and their graphs, captured beside the forward-only ones)."""

    def __init__(self, forward: PagedForward, table: PageTable, *, max_bs: int, sample: bool):
        self.forward = forward
        self.table = table
        self.max_bs = max_bs
        self.sample = sample
        self.buckets = (sorted({b for b in GRAPH_BUCKETS if b <= max_bs} | {max_bs})
                        if forward.device.type == "cuda" else [])
        self.graphs: DecodeGraphs | None = None
        self._pad = np.concatenate([PAD_META, PAD_COLUMN]) if sample else PAD_META
        self._max_len = 1
        self._rows: np.ndarray | None = None  # the next step's sampling rows (`sample_next`)
        # (tokens [B], logprobs [B], whether a graph sampled them) of the last step, if it sampled
        self.sampled: tuple[torch.Tensor, torch.Tensor, bool] | None = None
        # (meta, B, padded batch, graph, KV slots, sampling mode as `_run` takes it): `next`
        self._block: tuple | None = None

    def capture_graphs(self) -> None:
        """Capture the step for each bucket (CUDA; in the caller's batch-invariant mode)."""
        self.graphs = DecodeGraphs(self.forward.device, initial=self._pad, max_bs=self.max_bs)
        self.graphs.capture(self._forward, self.buckets, into=self.graphs.captured)
        if self.sample:
            for draw, graphs in self.graphs.sampled.items():
                self.graphs.capture(functools.partial(self._forward_sample, draw=draw),
                                    self.buckets, into=graphs)

    def num_graphs(self) -> int:
        """The CUDA graphs captured (plain and sampling ones, every bucket)."""
        if self.graphs is None:
            return 0
        return len(self.graphs.captured) + sum(map(len, self.graphs.sampled.values()))

    def sample_next(self, rows: np.ndarray | None) -> None:
        """The next `step` samples inside its forward with these SAMPLE_ROWS x B rows
        (decode_sample.sample_rows_of), followed by the draw rows (draw_rows_of) to race over
        draw logits; None: it returns logits only. Ignored unless `sample`."""
        self._rows = rows if self.sample else None

    def _forward(self, meta: torch.Tensor) -> torch.Tensor:
        with trace.span("decode.forward", cat="engine"):
            return self.forward.decode(meta[:META_ROWS], max_len=self._max_len)

    def _forward_sample(self, meta: torch.Tensor, *, draw: bool) -> tuple[torch.Tensor, ...]:
        """The body of a sampling graph: forward, sample, advance (also run eagerly; then the
        forward and the sampler are a span each). Its logits are no output: their memory is the
        graphs' pool's again after the capture."""
        table = self.table
        return sample_and_advance(self._forward(meta), meta, first=META_ROWS, draw=draw,
                                  req_to_page=table.req_to_page, page_size=table.page_size)

    def step(self, rids: list[str], token_ids: list[int] | None, *,
             prev_tokens: torch.Tensor | None, src_rows: list[int] | None,
             steps: int) -> torch.Tensor | None:
        """One step (the first of a block of `steps`): see `PagedRunner.decode`."""
        sample, self._rows = self._rows, None
        draw = sample is not None and len(sample) > SAMPLE_ROWS
        used = META_ROWS + (0 if sample is None else len(sample))  # rows the step reads
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
        graph = None
        if self.graphs is not None:
            graph = (self.graphs.captured if sample is None
                     else self.graphs.sampled[draw]).get(bucket)
        if graph is None:
            host = np.empty((used, n), dtype=np.int64)
        else:
            host = self.graphs.staging()
        host[0, :B] = token_ids if token_ids is not None else 0
        host[1, :B] = positions
        host[2, :B] = rows
        np.add(host[1, :B], 1, out=host[3, :B])
        host[4, :B] = locs
        host[5, :B] = src_rows if src_rows is not None else np.arange(B)
        if sample is not None:
            host[META_ROWS:used, :B] = sample
        host[:used, B:n] = self._pad[:used, None]  # padded rows: a junk token of the scratch page
        self._max_len = int(host[3, :B].max())
        if graph is None:
            meta = torch.from_numpy(host).to(self.forward.device)
            if prev_tokens is not None:
                meta[0, :B] = prev_tokens[meta[5, :B]]
        else:
            meta = self.graphs.upload(used)
            if prev_tokens is not None:
                torch.index_select(prev_tokens, 0, meta[5, :B], out=meta[0, :B])
        slots = None
        if steps > 1 and sample is None:
            slots = iter(table.block_slots(meta[2, :B], meta[1, :B], steps))
        mode = None if sample is None else draw
        self._block = (meta, B, n, graph, slots, mode) if steps > 1 else None
        return self._run(meta, B, n, graph, mode)

    def next(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The next step of the block `step(steps=...)` began, fed `tokens` ([B], on device; a
        sampling step has advanced its inputs already)."""
        full, B, n, graph, slots, mode = self._block
        if mode is None:  # positions, lengths and slots advance on the device
            meta = full[:, :B]
            meta[0].copy_(tokens)
            meta[1:4:2] += 1  # positions and sequence lengths
            meta[4].copy_(next(slots))
        self._max_len += 1
        return self._run(full, B, n, graph, mode)

    def _run(self, meta: torch.Tensor, B: int, n: int, graph: tuple[Any, Any] | None,
             mode: bool | None) -> torch.Tensor | None:
        """The step's forward (its graph replayed, or eagerly): logits of the first B rows;
        sampling inside it (`mode`: whether over draw logits), None, and the tokens and logprobs
        in `sampled`."""
        self.sampled = None
        if graph is None:
            out = (self._forward(meta[:, :n]) if mode is None
                   else self._forward_sample(meta[:, :n], draw=mode))
        else:
            graph, out = graph
            with trace.span("decode.forward", cat="engine"):
                graph.replay()
        if mode is None:
            return out[:B]
        tokens, logprobs = out
        self.sampled = (tokens[:B], logprobs[:B], graph is not None)
        return None
