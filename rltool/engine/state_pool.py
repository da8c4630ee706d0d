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

With the prefix cache, slots that no request holds may keep snapshots of a prefix's states
(rltool.engine.hybrid_prefix): `take` hands one out, `copy` fills it, `put` gives it back. They
share the K slots with running requests, which come first: a claim that finds no free slot asks
`reclaim` (set by the prefix cache) to give up its least recently used snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
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
        self.reclaim: Callable[[], int | None] | None = None  # a snapshot's slot, given up

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.state_bytes(ssm_dtype=self.ssm.dtype, conv_dtype=self.conv.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))

    @property
    def num_snapshots(self) -> int:
        """Slots neither free nor held by a request: the prefix cache's snapshots."""
        return self.num_slots - len(self._free) - len(self.held)

    def claim(self, rid: str) -> bool:
        """Give `rid` a slot unless it holds one (a snapshot's, through `reclaim`, when none is
        free); False when every slot is held by a request."""
        if rid in self.held:
            return True
        slot = self._free.pop() if self._free else self.reclaim() if self.reclaim else None
        if slot is None:
            return False
        self.held[rid] = slot
        return True

    def take(self) -> int | None:
        """A free slot for a snapshot (None when none is free; requests' slots are never
        taken)."""
        return self._free.pop() if self._free else None

    def put(self, slot: int) -> None:
        """Give back a snapshot's slot."""
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Copy the conv and recurrent states of slot `src` into slot `dst`, every GDN layer
        (queued on the current stream: it lands before any later forward reads `dst`)."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

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
