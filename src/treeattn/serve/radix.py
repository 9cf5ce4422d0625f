"""A radix-tree prefix cache across requests, keyed by token ids, over the engine's paged pool.

Prompts are stored as chains of :class:`~treeattn.engine.tree_manager.SequenceTree` nodes, one
node per *block* of tokens whose boundaries sit at multiples of ``block_tokens`` (so equal prefixes
end on equal node boundaries). Every node owns a :class:`treeattn.KVPool` branch forked from its
parent's, so a request that hangs below a cached node shares all of its pages without copying;
the cache is therefore also the decoding tree that treeattn plans prefix-aware.

A cached node is *referenced* while it has children (the nodes of running requests hang below
it) or is pinned (the end of a prompt prefilled in chunks, :meth:`PrefixCache.insert_prefix`); an
unreferenced node can be evicted, least recently used first. Matches stop one token short of the
whole prompt, so the last prompt token is always prefilled and its logits are fresh (cached nodes
keep no logits). The blocks of a prompt prefilled in chunks are cache entries as soon as their
chunk is written: their KV is complete, and later work reads it in stream order.
"""
from __future__ import annotations

import heapq
import logging

import numpy as np

from treeattn import KVPoolOutOfMemory

__all__ = ["PrefixCache"]

log = logging.getLogger(__name__)


class PrefixCache:
    """Shared-prefix cache of prompt token chains on a :class:`~treeattn.engine.TreeEngine`.

    Parameters
    ----------
    engine : TreeEngine
        Its sequence tree holds the cached nodes; only this cache and its scheduler may change it.
    block_tokens : int
        Node length (a multiple of the pool's page size keeps boundaries page-aligned); equal
        prefixes are reused at this granularity.
    free_pages : callable, optional
        ``free_pages()`` -> int: the free pages eviction works towards (default: the pool's; the
        ranks of a sequence-sharded server agree on the fewest of theirs).
    """

    def __init__(self, engine, block_tokens: int = 64, *, free_pages=None):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.engine = engine
        self.block = int(block_tokens)
        self.free_pages = free_pages or (lambda: engine.pool.num_free_pages)
        self._run: dict[int, tuple] = {}                    # node -> its own tokens
        self._kids: dict[int | None, dict[tuple, int]] = {None: {}}
        self._parent: dict[int, int | None] = {}
        self._used: dict[int, int] = {}                     # node -> LRU clock
        self._heap: list[tuple[int, int]] = []              # (clock, node) eviction candidates
        self._clock = 0
        self._pins: dict[int, int] = {}                     # node -> pins held on it
        self.hit_tokens = 0
        self.miss_tokens = 0

    # ------------------------------------------------------------------ lookup
    def __contains__(self, node) -> bool:
        return node in self._run

    @property
    def num_nodes(self) -> int:
        return len(self._run)

    def _child(self, parent: int | None, rest: np.ndarray, at: int) -> int | None:
        """The child of ``parent`` whose tokens start ``rest`` (first a full block, then shorter)."""
        kids = self._kids.get(parent)
        if not kids:
            return None
        n = min(self.block - at % self.block, rest.size)
        hit = kids.get(tuple(rest[:n].tolist()))
        if hit is not None:
            return hit
        for key, node in kids.items():
            if len(key) < n and tuple(rest[: len(key)].tolist()) == key:
                return node
        return None

    def match(self, tokens) -> tuple[int | None, int]:
        """The deepest cached node whose path is a prefix of ``tokens[:-1]`` and its path length
        (``(None, 0)`` when nothing matches); the matched nodes become most recently used."""
        ids = np.asarray(tokens, dtype=np.int64)[:-1]
        node, at = None, 0
        while at < ids.size:
            nxt = self._child(node, ids[at:], at)
            if nxt is None:
                break
            node, at = nxt, at + len(self._run[nxt])
            self._touch(node)
        return node, at

    def _touch(self, node: int) -> None:
        self._clock += 1
        self._used[node] = self._clock

    # ------------------------------------------------------------------ insertion
    def insert(self, tokens, *, counted: int = 0) -> int:
        """Prefill ``tokens`` below their longest cached prefix, as new cached blocks (one
        forward pass, :meth:`TreeEngine.prefill_chain`), and return the node of the last token
        (its logits are the engine's for that node).

        ``counted``: leading tokens the caller already counted in :attr:`hit_tokens` /
        :attr:`miss_tokens` (what its earlier :meth:`insert_prefix` calls cached), not counted
        again as hits. Raises :class:`treeattn.KVPoolOutOfMemory` when the pool fills up; nothing
        new is then cached.
        """
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("cannot insert an empty prompt")
        node, at = self.match(ids)
        return self._prefill(node, at, ids, counted)[-1]

    def insert_prefix(self, tokens, end: int, *, counted: int = 0) -> tuple[int | None, int]:
        """Cache ``tokens[:end]`` (one chunk of a long prompt: ``end`` is a block boundary below
        ``len(tokens)``) in one forward pass and return the deepest cached node on ``tokens``' path
        and its path length (``end``, or more when the cache already held more).

        The node is pinned (not evicted) until :meth:`unpin`; its logits are dropped (nobody
        samples after a chunk). ``counted`` and errors as :meth:`insert`.
        """
        ids = np.asarray(tokens, dtype=np.int64)
        if not 0 < end < ids.size or end % self.block:
            raise ValueError(f"end must be a multiple of {self.block} in (0, {ids.size}), got {end}")
        node, at = self.match(ids)
        if at < end:
            node = self._prefill(node, at, ids[:end], counted)[-1]
            self.engine.forget_logits(node)
            at = end
        else:
            self.hit_tokens += max(at - counted, 0)
        self._pins[node] = self._pins.get(node, 0) + 1
        return node, at

    def _prefill(self, node: int | None, at: int, ids: np.ndarray, counted: int) -> list:
        """Prefill ``ids[at:]`` below ``node`` (whose path is ``ids[:at]``) as new cached blocks."""
        self.hit_tokens += max(at - counted, 0)
        self.miss_tokens += ids.size - at
        cuts = list(range(at - at % self.block + self.block, ids.size, self.block))
        chunks = np.split(ids[at:], [c - at for c in cuts])
        try:
            new = self.engine.prefill_chain(node, chunks)
        except (KVPoolOutOfMemory, ValueError):
            if node is not None:
                self._evictable(node)
            raise
        for parent, child, chunk in zip([node] + new[:-1], new, chunks):
            self._run[child] = tuple(chunk.tolist())
            self._kids.setdefault(parent, {})[self._run[child]] = child
            self._kids[child] = {}
            self._parent[child] = parent
            self._touch(child)
        return new

    def unpin(self, node: int) -> None:
        """Drop one pin of :meth:`insert_prefix` on ``node``; unreferenced, it can be evicted."""
        left = self._pins.get(node, 0) - 1
        if left < 0:
            raise ValueError(f"node {node} is not pinned")
        if left:
            self._pins[node] = left
        else:
            del self._pins[node]
            self._evictable(node)

    def release(self, node: int) -> None:
        """The request whose sequences hung below ``node`` (a node :meth:`insert` returned to it)
        ended: drop the node's logits and let it be evicted once it has no children."""
        self.engine.forget_logits(node)
        self._evictable(node)

    def _evictable(self, node: int) -> None:
        if node in self._run and node not in self._pins and not self.engine.tree.children(node):
            heapq.heappush(self._heap, (self._used[node], node))

    # ------------------------------------------------------------------ eviction
    def evict(self, free_pages: int) -> int:
        """Evict unreferenced blocks, least recently used first, until the pool has ``free_pages``
        free pages or nothing is left to evict; returns the number of blocks evicted."""
        tree = self.engine.tree
        done = 0
        while self.free_pages() < free_pages and self._heap:
            used, node = heapq.heappop(self._heap)
            if node not in self._run or node in self._pins or tree.children(node):
                continue                              # referenced again: pushed when released
            if self._used[node] != used:              # touched since it was pushed: requeue
                heapq.heappush(self._heap, (self._used[node], node))
                continue
            parent, key = self._parent.pop(node), self._run.pop(node)
            if self._kids[parent].get(key) == node:   # a re-prefilled twin may have replaced it
                del self._kids[parent][key]
            del self._kids[node], self._used[node]
            tree.prune(node, cascade=False)
            done += 1
            if parent is not None:
                self._evictable(parent)
        if done:
            log.debug("evicted %d cached blocks; %d pages free", done, self.engine.pool.num_free_pages)
        return done

    def clear(self) -> int:
        """Evict every unreferenced block; returns how many."""
        for node in self._run:
            self._evictable(node)
        return self.evict(self.engine.pool.num_pages + 1)
