"""The prefix cache of a hybrid linear-attention model: KV pages shared as for dense models, plus
snapshots of the Gated DeltaNet states, since a GDN layer cannot restart from a token prefix
without the recurrent and conv states it had there.

Where snapshots are taken (`snapshot_point`): once per prompt of L tokens, after its first
s = min(L - 1, L // page_size * page_size) tokens, the deepest point a later request can reuse:
a reuse stops at least one token before the prompt's end (that token's logits start decoding)
and shares only what full cached pages hold. So for L not a multiple of the page size, s is the
end of the prompt's last full page; for a multiple, s = L - 1, one token before the end of its
last page, whose first page_size - 1 tokens a later request copies into a page of its own (as
dense models' partial pages): a GRPO group's other samples then compute one prompt token each.
The batch builder ends a prefill chunk at s and calls `snapshot`, which copies the request's
states into a free slot of the state pool; the snapshot goes to the radix node of the page
holding token s - 1 once that page is cached (at once when s is a page end, else when the
prompt's prefill ends), and is freed with its request otherwise.

A later request (`reuse_prefix`) uses the deepest matched node holding a snapshot: the pages up
to it shared, the head of a node's page copied when the snapshot lies inside it, and its state
slot starting as a copy of the snapshot (or taking the snapshot's slot when none other is
free); a match is cut back to that node. A node holds at most one snapshot (the first taken).
Snapshots leave with their nodes (eviction, a flush or weight update: `clear`), and give their
slots up when a request needs a slot and none is free: least recently used first among those a
request has started from, then the others (RadixCache.oldest_state).
"""

from __future__ import annotations

from rltool.engine.paged import KVPool, PageTable
from rltool.engine.radix_cache import Node
from rltool.engine.state_pool import StatePool


def snapshot_point(prompt_len: int, page_size: int) -> int:
    """Tokens of a prompt after which its states are snapshotted (0: none)."""
    return max(min(prompt_len - 1, prompt_len // page_size * page_size), 0)


class HybridPageTable(PageTable):
    """A page table whose prefix cache holds the state snapshots of `states`."""

    def __init__(self, *, states: StatePool, **kw):
        super().__init__(prefix_cache=True, **kw)
        self.states = states
        self.pending: dict[str, tuple[int, int]] = {}  # rid -> (snapshot slot, tokens) not cached
        states.reclaim = self._reclaim

    # ----- snapshots -----------------------------------------------------------------------

    def snapshot(self, rid: str) -> None:
        """Snapshot the states of `rid` after its KV length (its last prefill chunk ended
        there) for the prefix cache; skipped when the node of that page (if cached) holds one
        already, or when no slot is free or held by a snapshot."""
        entry, slot = self.entries.get(rid), self.states.held.get(rid)
        if entry is None or slot is None or entry.epoch != self.cache.epoch:
            return
        index = (entry.length - 1) // self.page_size
        if index < len(entry.shared) and entry.shared[index].state >= 0:
            return  # its node holds one already
        snap = self.states.take()
        if snap is None:
            snap = self._reclaim()
            if snap is None:
                return
        self.states.copy(slot, snap)
        self._drop_pending(rid)
        self.pending[rid] = (snap, entry.length)
        self._attach(rid)

    def _attach(self, rid: str) -> None:
        """Hand the pending snapshot of `rid` to the node of its page once that is cached."""
        snap, length = self.pending[rid]
        index = (length - 1) // self.page_size
        shared = self.entries[rid].shared
        if index >= len(shared):
            return
        del self.pending[rid]
        if not self.cache.attach_state(shared[index], snap, length - index * self.page_size):
            self.states.put(snap)

    def _reclaim(self) -> int | None:
        """The slot of the snapshot that goes first (RadixCache.oldest_state), taken from its
        node."""
        node = self.cache.oldest_state()
        return self.cache.take_state(node) if node is not None else None

    def _drop_pending(self, rid: str) -> None:
        pending = self.pending.pop(rid, None)
        if pending is not None:
            self.states.put(pending[0])

    def _free_states(self) -> None:
        for slot in self.cache.drain_states():
            self.states.put(slot)

    # ----- the page table's prefix-cache calls ---------------------------------------------

    def reuse_prefix(self, rid: str, tokens: list[int], *, max_tokens: int, pool: KVPool,
                     spare: int = 0) -> int:
        """Start `rid` at the deepest snapshot of a cached prefix of `tokens` (at most
        `max_tokens` tokens): pages up to its node shared, the head of the node's page copied
        when the snapshot lies inside it (skipped unless a page is free beyond the `spare` ones),
        the snapshot copied into the request's state slot. Returns the tokens reused."""
        if rid in self.entries:
            return 0
        ps, cache = self.page_size, self.cache
        max_tokens = max(max_tokens, 0)
        full = cache.match(tokens)[:max_tokens // ps]
        at = len(full) * ps
        tail, n = cache.partial(full, tokens[at:at + ps], max_tokens - at)
        nodes = full + ([tail] if tail is not None else [])
        cache.lock(nodes)
        try:
            return self._reuse(rid, nodes, n, pool=pool, spare=spare)
        finally:
            cache.unlock(nodes)  # attached nodes: nothing to free; _reuse locked what it keeps

    def _reuse(self, rid: str, nodes: list[Node], tail_len: int, *, pool: KVPool,
               spare: int) -> int:
        """`nodes`: the matched full pages, then (if `tail_len`) a page whose first `tail_len`
        tokens match."""
        ps = self.page_size
        copy_ok = self.has_free(1 + spare)
        best: tuple[int, int] | None = None  # (tokens reused, index of the snapshot's node)
        for i, node in enumerate(nodes):
            limit = tail_len if tail_len and i == len(nodes) - 1 else ps
            if (node.state >= 0 and node.state_len <= limit
                    and (node.state_len == ps or copy_ok)):
                best = (i * ps + node.state_len, i)
        if best is None:
            return 0
        length, i = best
        node = nodes[i]
        src, within = node.state, node.state_len
        # With no free slot the claim takes a snapshot's slot, maybe this one's: then the
        # request's slot holds the snapshot already.
        if not self.states.claim(rid):
            return 0
        slot = self.states.held[rid]
        if node.state == src:  # still the node's (not given to this request)
            node.state_used = True
        shared = nodes[:i + 1] if within == ps else nodes[:i]
        entry = self.add(rid)  # first: a refusal (no free row) must not strand the copy's page
        page = self._alloc(1)[0] if within < ps else None
        self.cache.lock(shared)
        entry.shared = shared
        for shared_node in shared:
            self._pending.append((entry.row, len(entry.pages), shared_node.page))
            entry.pages.append(shared_node.page)
        if page is not None:  # the copy is queued before anything else can take the source
            self._pending.append((entry.row, len(entry.pages), page))
            entry.pages.append(page)
            pool.copy_tokens(node.page, page, within, page_size=ps)
        entry.length = length
        if slot != src:
            self.states.copy(src, slot)
        self.stats.device_hit_tokens += length
        return length

    def cache_prefix(self, rid: str, tokens: list[int]) -> None:
        entry = self.entries.get(rid)
        if entry is not None and entry.epoch != self.cache.epoch:
            self._drop_pending(rid)  # states computed under the old weights
        super().cache_prefix(rid, tokens)
        if rid in self.pending:
            self._attach(rid)

    def _alloc(self, n: int) -> list[int]:
        try:
            return super()._alloc(n)
        finally:  # the snapshots of evicted nodes go back to the state pool
            self._free_states()

    def remove(self, rid: str) -> None:
        super().remove(rid)
        self._drop_pending(rid)

    def flush_prefix_cache(self) -> None:
        super().flush_prefix_cache()
        self._free_states()
