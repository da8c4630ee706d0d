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


class RadixCache:
    """The tree; page ids it holds are returned to the caller (never freed here) when evicted."""

    def __init__(self, *, page_size: int):
        self.page_size = page_size
        self.root = Node(key=(), page=-1, parent=None)
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages held by attached nodes
        self.epoch = 0  # bumped by clear: KV written under an older epoch is never inserted

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i:i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def match(self, tokens: list[int]) -> list[Node]:
        """Nodes of the longest cached page-aligned prefix of `tokens` (touched for LRU)."""
        node, out, now = self.root, [], next(self._clock)
        for key in self._keys(tokens):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = now
            out.append(node)
        return out

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
        n = limit if best is not None else 0
        if best is None:
            for key, child in parent.children.items():
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
                child = Node(key=key, page=page, parent=node)
                node.children[key] = child
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
                total += free[id(node)]
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
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def clear(self) -> list[int]:
        """Drop every node; returns the pages free now (locked ones come back through unlock)."""
        freed = []
        for node in self._nodes():
            node.detached = True
            node.children = {}
            if node.refs == 0:
                freed.append(node.page)
        self.root.children = {}
        self.num_pages = 0
        self.epoch += 1
        return freed

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
