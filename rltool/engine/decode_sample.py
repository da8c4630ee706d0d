"""The sampling half of a decode step that samples inside its forward (rltool.engine.decode_step):
the Triton sampler over the step's logits, the logprob of the chosen token, and the next step's
inputs advanced, all from device rows, so one CUDA-graph replay does forward, sample and advance
and the host only reads the tokens back.

The sampling rows sit below the forward's META_ROWS rows of the step's input buffer, filled in
the same staged upload, per row: the temperature (its float32 bits), the greedy flag, the
request's mixed seed and its index base (1 - prompt length). The token a step draws has index
position + index base (the position of its input token, minus the prompt, plus one), and its
draw is keyed by (mixed seed + index) mod SEED_MODULUS: the seed the overlapped block computes on
the host (rltool.engine.decode_overlap), so both paths draw the same tokens.

A batch with logit_bias or stop ids to mask before min_new_tokens (no top-k / top-p / min-p: those
sample after the forward) adds DRAW_ROWS: min_new_tokens (0 for a row with no stop id), up to
MAX_STOP_IDS stop ids (padded with the row's first) and up to MAX_BIAS (id, bias bits) pairs
(padded with (0, 0.0)); the race then runs over `batch_sampling.draw_logits` of them, the ops the
other path runs, stop ids masked while index < min_new_tokens.
"""

from __future__ import annotations

import numpy as np
import torch

SEED_MODULUS = 2**31 - 1  # the sampling kernel's hash seeds are 31-bit here
SAMPLE_ROWS = 4  # temperature bits, greedy, mixed seed, index base
MAX_STOP_IDS = 8
MAX_BIAS = 8
DRAW_ROWS = 1 + MAX_STOP_IDS + 2 * MAX_BIAS  # min_new_tokens, stop ids, bias ids, bias bits
# A padded column: temperature 1.0, greedy (no hash work), seed 0, index base 0, nothing masked
# or biased.
PAD_COLUMN = np.concatenate([np.array([np.float32(1.0).view(np.int32), 1, 0, 0]),
                             np.zeros(DRAW_ROWS)]).astype(np.int64)


def sample_rows_of(temps: np.ndarray, greedy: np.ndarray, seeds: np.ndarray,
                   prompt_lens: np.ndarray) -> np.ndarray:
    """The SAMPLE_ROWS x B int64 rows of a batch: temps float32, greedy 0/1, seeds the mixed
    seeds (base x 1_000_003 mod SEED_MODULUS), prompt_lens the prompts' token counts."""
    return np.stack([temps.astype(np.float32).view(np.int32).astype(np.int64),
                     greedy.astype(np.int64), seeds.astype(np.int64),
                     1 - prompt_lens.astype(np.int64)])


def draw_rows_of(min_new: np.ndarray, stops: list[list[int]],
                 biases: list[list[tuple[int, float]]]) -> np.ndarray | None:
    """The DRAW_ROWS x B int64 rows of a batch (`stops` and `biases` per row, in the vocabulary:
    batch_sampling.draw_lists); None when a row has more stop ids or biases than fit."""
    if max(map(len, stops)) > MAX_STOP_IDS or max(map(len, biases)) > MAX_BIAS:
        return None
    B = len(stops)
    out = np.zeros((DRAW_ROWS, B), dtype=np.int64)
    out[0] = np.where([bool(s) for s in stops], min_new, 0)
    for i, (row, pairs) in enumerate(zip(stops, biases)):
        if row:
            out[1:1 + MAX_STOP_IDS, i] = row + [row[0]] * (MAX_STOP_IDS - len(row))
        at = 1 + MAX_STOP_IDS
        for j, (tok, bias) in enumerate(pairs):
            out[at + j, i] = tok
            out[at + MAX_BIAS + j, i] = np.float32(bias).view(np.int32)
    return out


def sample_and_advance(logits: torch.Tensor, meta: torch.Tensor, *, first: int, draw: bool,
                       req_to_page: torch.Tensor, page_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample every column of `meta` (the step's input buffer [rows, N]: the forward's rows,
    then the sampling rows from row `first`, and with `draw` the draw rows after them) from
    `logits` [N, V], then advance `meta` in place to the next step's inputs: the tokens as
    input ids, positions and sequence lengths + 1, the KV slot of the next position looked up
    in `req_to_page` (pages reserved by the caller; a page index past the row reads its last
    entry, for a step that will not run). Returns (tokens [N] int64, logprobs [N] float32). No
    host synchronisation: CUDA-graph capturable."""
    from rltool.engine.sampling_kernel import sample_rows

    rows = meta[first:first + SAMPLE_ROWS]
    temps = rows[0].to(torch.int32).view(torch.float32)
    index = meta[1] + rows[3]
    seeds = torch.remainder(rows[2] + index, SEED_MODULUS).to(torch.int32)
    race = None
    if draw:
        race = _draw_logits(logits, meta[first + SAMPLE_ROWS:first + SAMPLE_ROWS + DRAW_ROWS],
                            temps=temps, index=index)
    tokens, logprobs = sample_rows(logits, temps, seeds, rows[1].to(torch.int32), draw=race)
    meta[0].copy_(tokens)
    meta[1].add_(1)
    meta[3].add_(1)
    page = torch.clamp(torch.div(meta[1], page_size, rounding_mode="floor"),
                       max=req_to_page.shape[1] - 1)
    meta[4].copy_(req_to_page[meta[2], page].long() * page_size + meta[1] % page_size)
    return tokens, logprobs


def _draw_logits(logits: torch.Tensor, rows: torch.Tensor, *, temps: torch.Tensor,
                 index: torch.Tensor) -> torch.Tensor:
    """`batch_sampling.draw_logits` over the draw rows, stop ids masked where index <
    min_new_tokens."""
    from rltool.engine.batch_sampling import DrawParams, draw_logits

    bias = 1 + MAX_STOP_IDS
    params = DrawParams(temps=temps, filtered=None, top_k=None, top_p=None, min_p=None,
                        bias_ids=rows[bias:bias + MAX_BIAS].t(),
                        bias_values=rows[bias + MAX_BIAS:].to(torch.int32).view(
                            torch.float32).t(),
                        stop_ids=rows[1:bias].t(), stop_rows=index < rows[0])
    return draw_logits(logits, params)
