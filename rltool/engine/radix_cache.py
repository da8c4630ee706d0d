"""Prefix cache of KV pages: a radix tree over token ids at page granularity, with LRU eviction.

Each node holds one full page: the `page_size` token ids whose KV it stores and the page id in the
KV pool. A path from the root spells a prompt prefix, so two prompts that share their first k full
pages share k nodes. Only full pages are cached: a partly written page is still being appended to
by the request that owns it. A prompt that ends, or leaves the tree, inside a cached page can
still use that page's first tokens (`partial`): the caller copies them into a page of its own.

A request that reuses cached pages locks the nodes of its prefix (a reference count along the
path), so eviction, which frees only unreferenced leaves, least recently used first, never takes a
page a running request reads. `clear` (a cache flush or a weight update: KV computed under old
weights must never be reused) drops every node at once; pages still locked by requests are
detached and freed when their last reference goes.

With a host tier (`host_pages` > 0, rltool.engine.host_kv) eviction demotes instead of dropping:
`demote` moves least recently used device pages to host pages (the caller copies them), and a
node then holds a host page (`page` -1). Device nodes form a subtree at the root (a node leaves
the device only once no child is there), host nodes hang below them. `match_host` continues a
device match over host nodes, `promote` gives them device pages again (the caller copies back),
and when the host pool is full its least recently used leaves are dropped. Every node carries
`version`, the epoch (bumped by each weight update and flush) its KV was computed under; a
match never returns a node of another version, and `clear` empties both tiers.

A hybrid model's nodes may also hold a recurrent-state snapshot (rltool.engine.hybrid_prefix):
`state`, a slot of its state pool, with the states after the node's first `state_len` tokens.
The tree keeps the slots in `snapshots`; a node that leaves (evicted, demoted, cleared) gives
its slot up, and `drain_states` hands the slots given up to the caller, which frees them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    page: int
    parent: "Node | None"
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    refs: int = 0
    last_access: int = 0
    detached: bool = False
    host: int = -1  # host page id while the KV lives in the host tier (then page is -1)
    version: int = 0  # the cache's epoch when the KV was computed
    state: int = -1  # a hybrid's recurrent-state snapshot slot (-1: none)
    state_len: int = 0  # tokens of this node's page the snapshot has consumed (1..page_size)
    state_used: bool = False  # whether a request has started from the snapshot


class RadixCache:
    """The tree; page ids it holds are returned to the caller (never freed here) when evicted."""

    def __init__(self, *, page_size: int, host_pages: int = 0):
        self.page_size = page_size
        self.host_pages = host_pages
        self._host_free = list(range(host_pages - 1, -1, -1))
        self.root = Node(key=(), page=-1, parent=None)
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages held by attached nodes
        self.epoch = 0  # bumped by clear: KV written under an older epoch is never inserted
        self.snapshots: dict[int, Node] = {}  # state slot -> the node holding it
        self._dropped_states: list[int] = []  # slots of nodes that left, for drain_states

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i:i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def match(self, tokens: list[int]) -> list[Node]:
        """Nodes of the longest cached page-aligned prefix of `tokens` (touched for LRU)."""
        node, out, now = self.root, [], next(self._clock)
        for key in self._keys(tokens):
            node = node.children.get(key)
            if node is None or node.page < 0 or node.version != self.epoch:
                break
            node.last_access = now
            out.append(node)
        return out

    def match_host(self, path: list[Node], tokens: list[int]) -> list[Node]:
        """The host-tier nodes that continue `path` (a `match` of `tokens`) along `tokens`."""
        node, out, now = path[-1] if path else self.root, [], next(self._clock)
        for key in self._keys(tokens)[len(path):]:
            node = node.children.get(key)
            if node is None or node.host < 0 or node.version != self.epoch:
                break
            node.last_access = now
            out.append(node)
        return out

    def promote(self, nodes: list[Node], pages: list[int]) -> list[tuple[int, int]]:
        """Give host nodes (locked by the caller, so not dropped meanwhile) the device `pages`;
        returns the (host page, device page) copies to make. The host pages go back to the
        free list: the copy is queued before any later demotion can write them."""
        copies = []
        for node, page in zip(nodes, pages):
            copies.append((node.host, page))
            self._host_free.append(node.host)
            node.host, node.page = -1, page
            self.num_pages += 1
        return copies

    @property
    def host_used(self) -> int:
        return self.host_pages - len(self._host_free)

    def partial(self, path: list[Node], head: list[int], limit: int) -> tuple[Node | None, int]:
        """The cached page after `path` (from the root for an empty path) whose tokens start with
        the longest part of `head` (the next page's tokens), at most `limit` and fewer than a page,
        and that part's length; (None, 0) if no page starts like `head`. When `head`'s whole page
        is cached (a prompt stopped inside it by `limit`) this is one lookup; otherwise each child
        of the path's last node is compared once. The page found is touched for LRU."""
        parent = path[-1] if path else self.root
        limit = min(limit, len(head), self.page_size - 1)
        if limit <= 0:
            return None, 0
        best = parent.children.get(tuple(head))
        if best is not None and (best.page < 0 or best.version != self.epoch):
            best = None  # in the host tier: only a device page can be copied from
        n = limit if best is not None else 0
        if best is None:
            for key, child in parent.children.items():
                if child.page < 0:
                    continue
                common = _common(key, head, limit)
                if common > n:
                    best, n = child, common
        if best is not None:
            best.last_access = next(self._clock)
        return best, n

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[list[Node], list[int]]:
        """Cache the full pages of `tokens` (KV in `pages`, in order). Returns the path's nodes
        and the caller's page ids that duplicate pages already cached (the caller frees them,
        or keeps them while it still reads them)."""
        node, path, dup, now = self.root, [], [], next(self._clock)
        for key, page in zip(self._keys(tokens), pages):
            child = node.children.get(key)
            if child is None:
                child = Node(key=key, page=page, parent=node, version=self.epoch)
                node.children[key] = child
                self.num_pages += 1
            elif child.page < 0:  # in the host tier: this request's page holds the same KV
                self._host_free.append(child.host)
                child.host, child.page = -1, page
                self.num_pages += 1
            elif child.page != page:
                dup.append(page)
            child.last_access = now
            path.append(child)
            node = child
        return path, dup

    def lock(self, nodes: list[Node]) -> None:
        for node in nodes:
            node.refs += 1

    def unlock(self, nodes: list[Node]) -> list[int]:
        """Drop one reference from each node; returns pages of detached nodes now unreferenced."""
        freed = []
        for node in nodes:
            if node.refs <= 0:
                raise ValueError("radix cache node unlocked more often than locked")
            node.refs -= 1
            if node.refs == 0 and node.detached:
                freed.append(node.page)
        return freed

    def evictable(self) -> int:
        """Pages `evict` could free now: nodes whose whole subtree is unreferenced. Iterative
        (a post-order walk with an explicit stack): a long prompt at a small page size makes the
        tree deeper than Python's recursion limit."""
        free: dict[int, bool] = {}
        total = 0
        stack: list[tuple[Node, bool]] = [(self.root, False)]
        while stack:
            node, visited = stack.pop()
            if not visited:
                stack.append((node, True))
                stack.extend((child, False) for child in node.children.values())
                continue
            subtree_free = all([free.pop(id(child)) for child in node.children.values()])
            if node is not self.root:
                free[id(node)] = subtree_free and node.refs == 0
                total += free[id(node)] and node.page >= 0
        return total

    def evict(self, num_pages: int) -> list[int]:
        """Free up to `num_pages` pages: unreferenced leaves, least recently used first."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.refs == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            self.num_pages -= 1
            freed.append(node.page)
            self._drop_state(node)
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def demote(self, num_pages: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Free up to `num_pages` device pages by moving unreferenced device leaves (no child on
        the device), least recently used first, to host pages; a full host pool drops its least
        recently used leaves first. Returns the device pages freed and the (device page, host
        page) copies to make before those pages are reused."""
        nodes = self._nodes()
        heap = [(n.last_access, id(n), n) for n in nodes if n.page >= 0 and n.refs == 0
                and all(c.page < 0 for c in n.children.values())]
        host_heap = [(n.last_access, id(n), n) for n in nodes if n.page < 0 and not n.children]
        heapq.heapify(heap)
        heapq.heapify(host_heap)
        freed: list[int] = []
        copies: dict[int, int] = {}  # host page -> device page; a page dropped again is rewritten
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            if not self._host_free and not self._drop_host_leaf(host_heap, copies):
                if not node.children:  # no host room (every host leaf locked): drop it
                    del node.parent.children[node.key]
                    node.detached = True
                    self._drop_state(node)
                    freed.append(node.page)
                    self.num_pages -= 1
                continue
            host = self._host_free.pop()
            self._drop_state(node)  # a snapshot lives on the device, with its node's page
            copies[host] = node.page
            freed.append(node.page)
            node.page, node.host = -1, host
            self.num_pages -= 1
            if not node.children:
                heapq.heappush(host_heap, (node.last_access, id(node), node))
            parent = node.parent
            if (parent is not self.root and parent.refs == 0
                    and all(c.page < 0 for c in parent.children.values())):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed, [(d, h) for h, d in copies.items()]

    def _drop_host_leaf(self, heap: list, copies: dict[int, int]) -> bool:
        """Drop the least recently used unlocked host leaf; False if there is none."""
        while True:
            if not heap:
                return False
            _, _, node = heapq.heappop(heap)
            if node.page < 0 and node.host >= 0 and not node.children and node.refs == 0:
                break
        del node.parent.children[node.key]
        node.detached = True
        self._host_free.append(node.host)
        copies.pop(node.host, None)
        node.host = -1
        parent = node.parent
        if parent is not self.root and parent.page < 0 and not parent.children:
            heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return True

    def clear(self) -> list[int]:
        """Drop every node; returns the pages free now (locked ones come back through unlock)."""
        freed = []
        for node in self._nodes():
            self._drop_state(node)
            node.detached = True
            node.children = {}
            node.host = -1
            if node.refs == 0 and node.page >= 0:
                freed.append(node.page)
        self.root.children = {}
        self._host_free = list(range(self.host_pages - 1, -1, -1))
        self.num_pages = 0
        self.epoch += 1
        return freed

    # ----- recurrent-state snapshots (hybrid models) ----------------------------------------

    def attach_state(self, node: Node, slot: int, length: int) -> bool:
        """Give `node` the snapshot in `slot`, taken after the first `length` tokens of its
        page; False (the caller keeps the slot) if it holds one already or has left the tree."""
        if node.state >= 0 or node.detached or node.page < 0 or node.version != self.epoch:
            return False
        node.state, node.state_len = slot, length
        self.snapshots[slot] = node
        return True

    def take_state(self, node: Node) -> int:
        """Detach the node's snapshot; returns its slot, now the caller's."""
        slot = node.state
        del self.snapshots[slot]
        node.state, node.state_len, node.state_used = -1, 0, False
        return slot

    def oldest_state(self) -> Node | None:
        """The node whose snapshot goes first (None if none holds one): the least recently used
        of those some request has started from, else of the others. A snapshot no request has
        used yet is what the requests held back while it was taken wait for (a GRPO group's
        other samples), so it goes last."""
        return min(self.snapshots.values(), key=lambda n: (not n.state_used, n.last_access),
                   default=None)

    def drain_states(self) -> list[int]:
        """Snapshot slots given up by nodes that left the tree since the last call."""
        out, self._dropped_states = self._dropped_states, []
        return out

    def _drop_state(self, node: Node) -> None:
        if node.state >= 0:
            self._dropped_states.append(self.take_state(node))

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common(a: tuple[int, ...], b: list[int], limit: int) -> int:
    """Length of the common head of `a` and `b`, at most `limit`."""
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
