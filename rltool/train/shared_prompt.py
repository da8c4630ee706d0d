"""Shared-prompt micro-batches: the torch backend's `--micro-batch-layout shared_prompt` (and
`auto`'s choice on the CPU when a micro-batch repeats a prompt).

The samples of a GRPO group share their prompt, and on short responses the prompt is most of a
sample's tokens (the demo: 27 of 31). This layout runs each distinct prompt once: one row per
prompt holding the prompt followed by the responses of every sample that has it, one after the
other. Position ids restart at the prompt's length for every response, and a boolean attention
mask keeps each response token to the prompt and to the earlier tokens of its own response, so
every response token sees exactly the context it has in its own padded row: the same logits up
to rounding (the matmuls run on other shapes, and the gradient of a shared prompt token sums over
its samples inside one pass instead of across rows). Rows are right-padded to the longest; a
padding query attends to itself only (no empty softmax row), and no query attends to padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT = -1  # segment id of a row's prompt columns; padding is -2, responses 0, 1, ...
PAD = -2


@dataclass
class SharedPromptBatch:
    ids: torch.Tensor        # [R, W] token ids, right-padded
    positions: torch.Tensor  # [R, W] position ids
    mask: torch.Tensor       # [R, 1, W, W] bool, True where a query attends to a key
    rows: torch.Tensor       # [N] flat indices (into R * W) of the logits of each response token
    targets: torch.Tensor    # [N] the response tokens those logits predict
    sizes: list[int]         # response tokens per sample, in the micro-batch's order


def build(tokens: list[list[int]], response_starts: list[int], *, pad: int,
          device: torch.device) -> SharedPromptBatch | None:
    """The shared-prompt layout of a micro-batch, or None when no two samples share a prompt
    (nothing to save: the caller runs the padded layout)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (t, start) in enumerate(zip(tokens, response_starts)):
        groups.setdefault(tuple(t[:start]), []).append(i)
    if len(groups) == len(tokens):
        return None
    width = max(len(p) + sum(len(tokens[i]) - len(p) for i in members)
                for p, members in groups.items())
    ids = [[pad] * width for _ in groups]
    positions = [[0] * width for _ in groups]
    segments = [[PAD] * width for _ in groups]
    where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(tokens)  # (row, prompt end, column)
    for r, (prompt, members) in enumerate(groups.items()):
        n = len(prompt)
        ids[r][:n], positions[r][:n], segments[r][:n] = prompt, range(n), [PROMPT] * n
        col = n
        for i in members:
            response = tokens[i][n:]
            end = col + len(response)
            ids[r][col:end] = response
            positions[r][col:end] = range(n, n + len(response))
            segments[r][col:end] = [i] * len(response)
            where[i] = (r, n, col)
            col = end
    rows: list[int] = []
    targets: list[int] = []
    sizes: list[int] = []
    for i, (r, n, col) in enumerate(where):
        size = len(tokens[i]) - n
        # Token n of the sample is predicted by the prompt's last column, token n + j (j >= 1)
        # by the column of its token n + j - 1.
        if size:
            rows += [r * width + n - 1] + [r * width + col + j for j in range(size - 1)]
        targets += tokens[i][n:]
        sizes.append(size)
    seg = torch.tensor(segments, dtype=torch.long)
    col_idx = torch.arange(width)
    causal = col_idx[None, :] <= col_idx[:, None]                     # [W(q), W(k)]
    seg_q, seg_k = seg[:, :, None], seg[:, None, :]
    mask = causal & ((seg_k == PROMPT) | (seg_k == seg_q)) & (seg_k != PAD) & (seg_q != PAD)
    mask |= torch.eye(width, dtype=torch.bool)  # padding queries: themselves only
    return SharedPromptBatch(
        ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        mask=mask[:, None].to(device), rows=torch.tensor(rows, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device), sizes=sizes)


def nbytes(batch: SharedPromptBatch | None) -> int:
    """The memory a built layout holds (0 for None)."""
    if batch is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (batch.ids, batch.positions, batch.mask,
                                                       batch.rows, batch.targets))
