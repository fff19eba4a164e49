"""The worker's local prefix cache: a page-level radix tree over full token pages with LRU eviction.

Eviction costs O(log n) per evicted leaf, whatever the tree's size: evictable leaves sit in a heap keyed
by last access, kept up to date as leaves appear, are touched or are unlocked (stale entries are skipped).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from services.gpu_worker.block_pool import BlockPool
from shared.hashing import hash_blocks
from shared.messages import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent

PageKey: TypeAlias = tuple[int, ...]


class RadixNode:
    """One edge of the tree: one or more consecutive full pages (tokens, page ids, chained block hashes)."""

    __slots__ = ("node_id", "parent", "children", "token_ids", "page_ids", "block_hashes",
                 "lock_count", "num_own_locks", "last_access", "is_detached", "lru_stamp")

    def __init__(self, node_id: int, parent: RadixNode | None, token_ids: PageKey,
                 page_ids: list[int], block_hashes: list[int], last_access: float) -> None:
        self.node_id = node_id
        self.parent = parent
        self.children: dict[PageKey, RadixNode] = {}
        self.token_ids = token_ids
        self.page_ids = page_ids
        self.block_hashes = block_hashes
        self.lock_count = 0  # own locks plus every descendant's
        self.num_own_locks = 0
        self.last_access = last_access
        self.is_detached = False
        self.lru_stamp = -1  # the stamp of its one valid entry in the eviction heap (older ones are stale)

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)

    @property
    def last_hash(self) -> int | None:
        return self.block_hashes[-1] if self.block_hashes else None

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, pages={self.page_ids}, locks={self.lock_count})"


NodeHandle: TypeAlias = RadixNode


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix in whole pages; lock(node) while using page_ids."""

    page_ids: list[int]
    num_tokens: int
    node: NodeHandle


@dataclass(frozen=True, slots=True)
class InsertResult:
    """The deepest node of the inserted prefix (to lock), how many caller pages the tree adopted, and the tree's page
    of each page the walk covered (from `after`'s depth on; the caller's own where the tree adopted them)."""

    node: NodeHandle
    num_new_pages: int
    page_ids: list[int]


class RadixCache:
    """Prefix cache over pool pages; the tree holds one pool ref per cached page and emits KV events."""

    def __init__(self, pool: BlockPool, page_size: int, salt: str, is_enabled: bool = True) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.pool = pool
        self.page_size = page_size
        self.salt = salt
        self.is_enabled = is_enabled
        self._node_ids = itertools.count()
        self._root = self._new_node(None, (), [], [], 0.0)
        self._events: list[KVEvent] = []
        self._num_cached_pages = 0
        self._num_locked_pages = 0
        self._num_nodes = 0
        self._lru: list[tuple[float, int, RadixNode]] = []  # (last_access, stamp, leaf); may hold stale entries
        self._lru_stamps = itertools.count()

    @property
    def root(self) -> NodeHandle:
        return self._root

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached_pages

    @property
    def num_evictable_pages(self) -> int:
        return self._num_cached_pages - self._num_locked_pages

    def drain_events(self) -> list[KVEvent]:
        """Return the KV events since the last drain, oldest first, and forget them."""
        events, self._events = self._events, []
        return events

    def cached_blocks(self) -> dict[int, int]:
        """Every cached block as {block_hash: page_id}."""
        return {h: p for node in self._iter_nodes() for h, p in zip(node.block_hashes, node.page_ids)}

    def match_prefix(self, token_ids: Sequence[int], now: float) -> PrefixMatch:
        """Longest cached prefix of token_ids in whole pages; refreshes last access along the path.

        Splits an edge when the match ends inside it, so the returned node covers exactly the match.
        The caller holds no page refs from this; it must lock(node) while it uses the pages.
        """
        if not self.is_enabled:
            return PrefixMatch([], 0, self._root)
        tokens = self._full_pages(token_ids)
        node, num_matched, page_ids = self._root, 0, []
        while num_matched < len(tokens) // self.page_size:
            child = node.children.get(self._page_key(tokens, num_matched))
            if child is None:
                break
            num_common = self._num_common_pages(child, tokens, num_matched)
            if num_common < child.num_pages:
                child = self._split(child, num_common)
            self._touch(child, now)
            page_ids.extend(child.page_ids)
            num_matched += num_common
            node = child
        return PrefixMatch(page_ids, num_matched * self.page_size, node)

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int], now: float,
               after: NodeHandle | None = None) -> InsertResult:
        """Cache the full pages of token_ids (held in page_ids); a trailing partial page is ignored.

        Pages already cached keep the tree's page; new pages adopt the caller's page (one extra ref).
        The caller keeps its own refs and frees them itself.

        after: a node whose path from the root is token_ids' first pages (a running sequence's locked cache node):
        the walk starts there, so a sequence that grew by a page costs a page, not its whole length (at 368
        sequences of ~1,500 tokens, ~23 of them fill a page each step); the nodes above it are touched as the walk
        from the root would touch them.
        """
        if not self.is_enabled:
            return InsertResult(self._root, 0, [])
        num_pages = len(token_ids) // self.page_size
        if len(page_ids) < num_pages:
            raise ValueError(f"{num_pages} full pages but only {len(page_ids)} page ids")
        start = 0 if after is None else self._depth(after)
        if start > num_pages:  # not a prefix of these tokens: walk from the root
            after, start = None, 0
        node = self._root if after is None else after
        tokens = tuple(token_ids[start * self.page_size:num_pages * self.page_size])  # the pages past `node`
        tree_pages: list[int] = []
        num_done, num_new = 0, 0
        while num_done < num_pages - start:
            child = node.children.get(self._page_key(tokens, num_done))
            if child is None:
                new = list(page_ids[start + num_done:num_pages])
                node = self._add_leaf(node, tokens, new, num_done, now)
                tree_pages += new
                num_new = len(new)
                break
            num_common = self._num_common_pages(child, tokens, num_done)
            if num_common < child.num_pages:
                child = self._split(child, num_common)
            self._touch(child, now)
            tree_pages += child.page_ids
            num_done += num_common
            node = child
        if after is not None:
            for above in self._path_to_root(after):
                self._touch(above, now)
        return InsertResult(node, num_new, tree_pages)

    def _depth(self, node: RadixNode) -> int:
        """Pages on the path from the root to node, node's own included."""
        return sum(n.num_pages for n in self._path_to_root(node))

    def lock(self, node: NodeHandle) -> None:
        """Pin node and its ancestors against eviction (counted; pair with unlock)."""
        if node.is_detached:
            raise ValueError(f"lock of a node no longer in the tree: {node!r}")
        node.num_own_locks += 1
        for path_node in self._path_to_root(node):
            if path_node.lock_count == 0:
                self._num_locked_pages += path_node.num_pages
            path_node.lock_count += 1

    def unlock(self, node: NodeHandle) -> None:
        """Release one lock(node)."""
        if node.num_own_locks == 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        node.num_own_locks -= 1
        for path_node in self._path_to_root(node):
            path_node.lock_count -= 1
            if path_node.lock_count == 0:
                self._num_locked_pages -= path_node.num_pages
        self._push_if_evictable(node)  # NOTE: only node can be a leaf; its ancestors have it as a child

    def evict(self, num_pages: int) -> int:
        """Drop unlocked leaf pages, least recently used first, tail of an edge first.

        Stops once num_pages pages went back to the pool's free list or nothing is evictable;
        returns how many pages went back (pages still referenced elsewhere are evicted but not counted).
        Costs O(log n) per leaf it touches, n the number of heap entries.
        """
        num_freed = 0
        while self._lru and num_freed < num_pages:
            _, stamp, leaf = heapq.heappop(self._lru)
            if stamp != leaf.lru_stamp or not self._is_evictable_leaf(leaf):
                continue  # stale: touched, locked, grown or removed since it was pushed
            leaf.lru_stamp = -1
            key = leaf.token_ids[:self.page_size]
            num_freed += self._evict_tail(leaf, num_pages - num_freed)
            if leaf.num_pages == 0:
                self._push_if_evictable(self._remove_leaf(leaf, key))
            else:
                self._push_if_evictable(leaf)  # partly evicted: its head stays, as old as it was
        return num_freed

    def clear(self) -> None:
        """Drop every cached page; only allowed while nothing is locked. Emits AllBlocksCleared."""
        if self._root.lock_count:
            raise ValueError("clear while nodes are locked")
        for node in list(self._iter_nodes()):
            self.pool.free(node.page_ids)
            node.is_detached = True
        self._root.children = {}
        self._num_cached_pages = 0
        self._num_nodes = 0
        self._lru = []
        self._events.append(AllBlocksCleared())

    def _new_node(self, parent: RadixNode | None, token_ids: PageKey, page_ids: list[int],
                  block_hashes: list[int], now: float) -> RadixNode:
        if parent is not None:
            self._num_nodes += 1
        return RadixNode(next(self._node_ids), parent, token_ids, page_ids, block_hashes, now)

    def _touch(self, node: RadixNode, now: float) -> None:
        node.last_access = now
        self._push_if_evictable(node)

    def _push_if_evictable(self, node: RadixNode) -> None:
        """Give an evictable leaf a fresh heap entry (its older ones go stale); compact a heap gone stale."""
        if not self._is_evictable_leaf(node):
            return
        node.lru_stamp = next(self._lru_stamps)
        heapq.heappush(self._lru, (node.last_access, node.lru_stamp, node))
        if len(self._lru) > 2 * self._num_nodes + 64:
            self._lru = [entry for entry in self._lru
                         if entry[1] == entry[2].lru_stamp and self._is_evictable_leaf(entry[2])]
            heapq.heapify(self._lru)

    def _full_pages(self, token_ids: Sequence[int]) -> PageKey:
        num_full_tokens = len(token_ids) // self.page_size * self.page_size
        return tuple(token_ids[:num_full_tokens])

    def _page_key(self, tokens: PageKey, page_index: int) -> PageKey:
        return tokens[page_index * self.page_size:(page_index + 1) * self.page_size]

    def _num_common_pages(self, node: RadixNode, tokens: PageKey, start_page: int) -> int:
        num_common = 0
        num_available = len(tokens) // self.page_size - start_page
        while num_common < min(node.num_pages, num_available):
            edge_page = self._page_key(node.token_ids, num_common)
            if edge_page != self._page_key(tokens, start_page + num_common):
                break
            num_common += 1
        return num_common

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut node's edge after num_pages pages; the new upper node is returned, node keeps the tail."""
        num_tokens = num_pages * self.page_size
        assert node.parent is not None and 0 < num_pages < node.num_pages
        upper = self._new_node(node.parent, node.token_ids[:num_tokens], node.page_ids[:num_pages],
                               node.block_hashes[:num_pages], node.last_access)
        upper.lock_count = node.lock_count
        node.parent.children[upper.token_ids[:self.page_size]] = upper
        node.parent = upper
        node.token_ids = node.token_ids[num_tokens:]
        node.page_ids = node.page_ids[num_pages:]
        node.block_hashes = node.block_hashes[num_pages:]
        upper.children[node.token_ids[:self.page_size]] = node
        return upper

    def _add_leaf(self, parent: RadixNode, tokens: PageKey, page_ids: list[int], start_page: int,
                  now: float) -> RadixNode:
        edge_tokens = tokens[start_page * self.page_size:]
        if len(set(page_ids)) != len(page_ids):
            raise ValueError(f"duplicate page ids in insert: {page_ids}")
        block_hashes = hash_blocks(edge_tokens, self.page_size, self.salt, parent.last_hash)
        self.pool.incref(page_ids)
        leaf = self._new_node(parent, edge_tokens, page_ids, block_hashes, now)
        parent.children[edge_tokens[:self.page_size]] = leaf
        self._num_cached_pages += len(page_ids)
        self._events.append(BlocksStored(list(block_hashes), parent.last_hash, list(edge_tokens),
                                         self.page_size))
        self._push_if_evictable(leaf)
        return leaf

    def _evict_tail(self, leaf: RadixNode, num_wanted: int) -> int:
        """Evict pages from the tail of leaf's edge until num_wanted went to the free list; return that."""
        num_freed, num_evicted = 0, 0
        while num_evicted < leaf.num_pages and num_freed < num_wanted:
            num_evicted += 1
            num_freed += self.pool.free([leaf.page_ids[-num_evicted]])
        cut = leaf.num_pages - num_evicted
        self._events.append(BlocksRemoved(leaf.block_hashes[cut:]))
        leaf.token_ids = leaf.token_ids[:cut * self.page_size]
        leaf.page_ids = leaf.page_ids[:cut]
        leaf.block_hashes = leaf.block_hashes[:cut]
        self._num_cached_pages -= num_evicted
        return num_freed

    def _remove_leaf(self, leaf: RadixNode, key: PageKey) -> RadixNode:
        parent = leaf.parent
        assert parent is not None and parent.children[key] is leaf
        del parent.children[key]
        leaf.is_detached = True
        self._num_nodes -= 1
        return parent

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node is not self._root and not node.children and node.lock_count == 0 and not node.is_detached

    def _path_to_root(self, node: RadixNode) -> Iterator[RadixNode]:
        current: RadixNode | None = node
        while current is not None:
            yield current
            current = current.parent

    def _iter_nodes(self) -> Iterator[RadixNode]:
        """Every node except the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        seen_page_ids: set[int] = set()
        num_locked_pages = 0
        for node in self._iter_nodes():
            self._check_node(node, seen_page_ids)
            num_locked_pages += node.num_pages if node.lock_count else 0
        self._check_locks(self._root)
        assert self._root.parent is None and not self._root.page_ids, "root holds pages"
        assert len(seen_page_ids) == self._num_cached_pages, "num_cached_pages out of date"
        assert num_locked_pages == self._num_locked_pages, "num_locked_pages out of date"
        assert self.is_enabled or not seen_page_ids, "disabled cache holds pages"
        self._check_lru()

    def _check_lru(self) -> None:
        """Every evictable leaf has exactly one valid heap entry, carrying its current last access."""
        nodes = list(self._iter_nodes())
        assert len(nodes) == self._num_nodes, "num_nodes out of date"
        valid = [(t, n) for t, stamp, n in self._lru if stamp == n.lru_stamp and self._is_evictable_leaf(n)]
        leaves = [n for n in nodes if self._is_evictable_leaf(n)]
        assert len(valid) == len({id(n) for _, n in valid}), "a leaf with two valid heap entries"
        assert {id(n) for _, n in valid} == {id(n) for n in leaves}, "an evictable leaf missing from the heap"
        assert all(t == n.last_access for t, n in valid), "a heap entry with an old last access"

    def _check_node(self, node: RadixNode, seen_page_ids: set[int]) -> None:
        parent = node.parent
        assert parent is not None and not node.is_detached, f"{node!r} detached"
        assert node.num_pages >= 1, f"{node!r} holds no pages"
        assert len(node.token_ids) == node.num_pages * self.page_size, f"{node!r} tokens/pages mismatch"
        assert parent.children.get(node.token_ids[:self.page_size]) is node, f"{node!r} misfiled"
        expected = hash_blocks(node.token_ids, self.page_size, self.salt, parent.last_hash)
        assert node.block_hashes == expected, f"{node!r} block hashes do not chain"
        self._check_locks(node)
        for page_id in node.page_ids:
            assert page_id not in seen_page_ids, f"page {page_id} in two nodes"
            assert self.pool.ref_count(page_id) >= 1, f"cached page {page_id} has no pool ref"
            seen_page_ids.add(page_id)

    def _check_locks(self, node: RadixNode) -> None:
        num_child_locks = sum(child.lock_count for child in node.children.values())
        assert node.num_own_locks >= 0, f"{node!r} negative own locks"
        assert node.lock_count == node.num_own_locks + num_child_locks, f"{node!r} lock count wrong"
