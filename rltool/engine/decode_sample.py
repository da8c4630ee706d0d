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
"""

from __future__ import annotations

import numpy as np
import torch

SEED_MODULUS = 2**31 - 1  # the sampling kernel's hash seeds are 31-bit here
SAMPLE_ROWS = 4  # temperature bits, greedy, mixed seed, index base
# A padded column: temperature 1.0, greedy (no hash work), seed 0, index base 0.
PAD_COLUMN = np.array([np.float32(1.0).view(np.int32), 1, 0, 0], dtype=np.int64)


def sample_rows_of(temps: np.ndarray, greedy: np.ndarray, seeds: np.ndarray,
                   prompt_lens: np.ndarray) -> np.ndarray:
    """The SAMPLE_ROWS x B int64 rows of a batch: temps float32, greedy 0/1, seeds the mixed
    seeds (base x 1_000_003 mod SEED_MODULUS), prompt_lens the prompts' token counts."""
    return np.stack([temps.astype(np.float32).view(np.int32).astype(np.int64),
                     greedy.astype(np.int64), seeds.astype(np.int64),
                     1 - prompt_lens.astype(np.int64)])


def sample_and_advance(logits: torch.Tensor, meta: torch.Tensor, *, first: int,
                       req_to_page: torch.Tensor, page_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample every column of `meta` (the step's input buffer [rows, N]: the forward's rows,
    then the sampling rows from row `first`) from `logits` [N, V], then advance `meta` in place
    to the next step's inputs: the tokens as input ids, positions and sequence lengths + 1, the
    KV slot of the next position looked up in `req_to_page` (pages reserved by the caller; a
    page index past the row reads its last entry, for a step that will not run). Returns
    (tokens [N] int64, logprobs [N] float32). No host synchronisation: CUDA-graph capturable."""
    from rltool.engine.sampling_kernel import sample_rows

    rows = meta[first:first + SAMPLE_ROWS]
    temps = rows[0].to(torch.int32).view(torch.float32)
    index = meta[1] + rows[3]
    seeds = torch.remainder(rows[2] + index, SEED_MODULUS).to(torch.int32)
    tokens, logprobs = sample_rows(logits, temps, seeds, rows[1].to(torch.int32))
    meta[0].copy_(tokens)
    meta[1].add_(1)
    meta[3].add_(1)
    page = torch.clamp(torch.div(meta[1], page_size, rounding_mode="floor"),
                       max=req_to_page.shape[1] - 1)
    meta[4].copy_(req_to_page[meta[2], page].long() * page_size + meta[1] % page_size)
    return tokens, logprobs
