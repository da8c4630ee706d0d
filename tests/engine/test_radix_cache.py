"""The radix prefix cache alone: page-granular insert/match, LRU eviction of unreferenced leaves,
reference counts that keep locked pages, and clear (the weight-update invalidation)."""

from __future__ import annotations

import pytest

from rltool.engine.radix_cache import RadixCache

pytestmark = pytest.mark.timeout(30)


def test_match_is_page_granular():
    cache = RadixCache(page_size=4)
    path, dup = cache.insert(list(range(10)), [7, 8, 9])  # 10 tokens: 2 full pages, the 3rd partial
    assert [n.page for n in path] == [7, 8] and dup == []
    assert cache.num_pages == 2
    assert [n.page for n in cache.match(list(range(8)))] == [7, 8]
    assert [n.page for n in cache.match(list(range(7)))] == [7]  # a partial page never matches
    assert [n.page for n in cache.match([0, 1, 2, 3, 99, 5, 6, 7])] == [7]
    assert cache.match([1, 2, 3, 4]) == []


def test_insert_shares_prefix_and_reports_duplicates():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    path, dup = cache.insert([1, 2, 3, 4, 5, 6], [20, 21, 22])
    assert [n.page for n in path] == [10, 11, 22]
    assert dup == [20, 21]  # the caller's copies of pages the tree already holds
    assert cache.num_pages == 3


def test_lru_eviction_frees_unreferenced_leaves_only():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [10, 11])
    cache.insert([3], [12])
    locked = cache.match([3])
    cache.lock(locked)
    cache.match([1])  # touches only page 10; 11 stays the least recent
    assert cache.evictable() == 2
    assert cache.evict(1) == [11]
    assert cache.evict(5) == [10]  # the parent became a leaf; the locked page 12 stays
    assert cache.num_pages == 1
    assert cache.unlock(locked) == []  # attached: unlocking frees nothing
    assert cache.evict(5) == [12]
    assert cache.num_pages == 0


def test_locked_inner_node_keeps_its_subtree_path():
    cache = RadixCache(page_size=1)
    path, _ = cache.insert([1, 2, 3], [10, 11, 12])
    cache.lock(path[:2])
    assert cache.evictable() == 1
    assert cache.evict(3) == [12]
    with pytest.raises(ValueError, match="unlocked more often"):
        cache.unlock(path[2:])


def test_clear_detaches_locked_pages_until_unlocked():
    cache = RadixCache(page_size=2)
    path, _ = cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([5, 6], [12])
    cache.lock(path[:1])
    assert sorted(cache.clear()) == [11, 12]
    assert cache.num_pages == 0 and cache.match([1, 2, 3, 4]) == []
    assert cache.unlock(path[:1]) == [10]  # freed with its last reference, never reused


def test_a_tree_deeper_than_the_recursion_limit_counts_and_evicts():
    """`evictable` walked the tree recursively, so one long prompt at page size 1 (a path deeper
    than Python's recursion limit) raised RecursionError in the scheduler's page check."""
    cache = RadixCache(page_size=1)
    n = 5000
    path, _ = cache.insert(list(range(n)), list(range(n)))
    assert cache.evictable() == n
    cache.lock(path[:10])
    assert cache.evictable() == n - 10
    assert len(cache.evict(n)) == n - 10


def test_partial_finds_the_page_a_prompt_ends_or_leaves_the_tree_in():
    cache = RadixCache(page_size=4)
    path, _ = cache.insert(list(range(12)), [7, 8, 9])
    cache.insert([0, 1, 2, 3, 4, 5, 50, 51], [7, 10])
    assert cache.partial(path[:2], [8, 9, 10, 11], 3) == (path[2], 3)  # capped inside the page
    assert cache.partial(path[:1], [4, 5, 6], 3) == (path[1], 3)  # the prompt ends inside it
    node, n = cache.partial(path[:1], [4, 5, 50, 99], 9)  # diverges inside a cached page
    assert n == 3 and node.page == 10
    assert cache.partial(path[:1], [4, 5, 6, 7], 9) == (path[1], 3)  # a full page: never all
    assert cache.partial(path[:2], [99, 9], 2) == (None, 0)
    assert cache.partial([], [0, 1], 0) == (None, 0)
