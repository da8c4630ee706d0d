"""The recurrent-state pool of a hybrid model, beside its paged KV pool: K slots, each holding one
sequence's Gated DeltaNet states in every GDN layer (rltool.engine.linear_attention).

A running sequence holds one slot from its first prefill chunk until it finishes, is aborted or
retracted (the runner's `remove`/`clear` free it); a retracted sequence starts again from a zero
state. The conv state (the last kernel - 1 inputs of the causal convolution, in the model dtype)
and the recurrent state (value heads x key dim x value dim, in `--mamba-ssm-dtype`) are separate
tensors. Slot 0 is scratch, like page 0 of the KV pool: padded rows of a decode batch (page-table
row 0) read and write it. `slot_of_row` maps page-table rows to slots on the device, so a decode
step (or a block of them) finds its states without host work.

Sizing follows SGLang's `--mamba-full-memory-ratio r`: a cache budget B splits into B/(1+r) for
the attention KV and rB/(1+r) for the states, so B = N*c_A + K*c_R with c_A the KV bytes per
token and c_R `LinearSpec.state_bytes` per slot (rltool.engine.kv_memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltool.engine.linear_attention import LinearSpec
from rltool.errors import EngineError


class StatePool:
    def __init__(self, spec: LinearSpec, *, num_slots: int, max_requests: int,
                 conv_dtype: torch.dtype, ssm_dtype: torch.dtype, device: torch.device | str):
        if num_slots < 1:
            raise EngineError("the recurrent-state pool needs at least 1 slot")
        n = len(spec.linear_layers)
        self.spec = spec
        self.num_slots = num_slots
        self.conv = torch.zeros(n, num_slots + 1, spec.conv_dim, spec.conv_kernel - 1,
                                dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(n, num_slots + 1, spec.num_v_heads, spec.k_dim, spec.v_dim,
                               dtype=ssm_dtype, device=device)
        self.slot_of_row = torch.zeros(max_requests + 1, dtype=torch.long, device=device)
        self._free = list(range(num_slots, 0, -1))  # popped from the end: low slots first
        self.held: dict[str, int] = {}

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.state_bytes(ssm_dtype=self.ssm.dtype, conv_dtype=self.conv.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))

    def claim(self, rid: str) -> bool:
        """Give `rid` a slot unless it holds one; False when none is free."""
        if rid in self.held:
            return True
        if not self._free:
            return False
        self.held[rid] = self._free.pop()
        return True

    def bind(self, rid: str, row: int) -> int:
        """The slot of `rid` (claimed now if it holds none), recorded for its page-table row."""
        if not self.claim(rid):
            raise EngineError(f"no free recurrent-state slot for request {rid}: all "
                              f"{self.num_slots} are held")
        slot = self.held[rid]
        self.slot_of_row[row] = slot
        return slot

    def free(self, rid: str) -> None:
        slot = self.held.pop(rid, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        for rid in list(self.held):
            self.free(rid)


@dataclass
class Recurrence:
    """How a packed token stream splits into sequences for the GDN layers, and where their states
    live. Prefill: `segments` (offset, length, slot, fresh: starts from a zero state); decode:
    `slots` [B] (one token per row); `pool` None: a pass beside the pool, every segment fresh
    and its final states dropped."""
    pool: StatePool | None
    segments: list[tuple[int, int, int, bool]] | None = None
    slots: torch.Tensor | None = None

    @staticmethod
    def alone(num_tokens: int) -> "Recurrence":
        """One fresh sequence, beside the pool (a full pass)."""
        return Recurrence(pool=None, segments=[(0, num_tokens, 0, True)])
