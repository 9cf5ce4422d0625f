"""Leaf packing: several small leaf items in one work item, their queries kept apart by the mask.

A decoding tree with many short leaves (1024 sampled continuations of 16 tokens) gives one work
item, so one program per KV head, per leaf. Each program is latency-bound and costs about half a
microsecond of SM time whatever its size, so at 32/32 heads the ~33K leaf programs alone take
longer than the whole plan's HBM traffic. Packing ``k`` consecutive leaf items into one item
concatenates their tokens (one KV tile for several leaves) and their query rows (one query tile);
each query still sees only its own leaf, because the tree mask hides tokens of nodes that are not
its ancestors, and only the packed items' launch applies it. Measured on an H200: 1.3-1.5x on the 1024-leaf suite trees at 32/32 with 16-token
leaves, 1.06x with 32-token ones.
"""
from __future__ import annotations

import functools

import numpy as np

from treeattn.plan.select.estimate import best_variant, needs_mask
from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import DeferredItems, WorkItems, _indptr
from treeattn.plan.format import BLOCK_M_CHOICES, HeadConfig
from treeattn.tree import DecodingTree

__all__ = ["pack_leaf_items", "leaf_packing_variant", "LeafPackingPlanner"]

#: tokens a packed item may hold (a few KV tiles: packing long leaves only lengthens programs)
PACK_MAX_TOKENS = 256
PACK_MAX_FACTOR = 16


def _median(values: np.ndarray) -> int:
    """``int(np.median(values))`` of non-negative integers, without its overhead."""
    m = values.size // 2
    if values.size % 2:
        return int(np.partition(values, m)[m])
    v = np.partition(values, (m - 1, m))
    return (int(v[m - 1]) + int(v[m])) // 2


def pack_leaf_items(items: WorkItems, tree: DecodingTree, k: int, *, group: int,
                    rows: int = BLOCK_M_CHOICES[0], max_tokens: int = PACK_MAX_TOKENS,
                    leaf: np.ndarray | None = None) -> WorkItems:
    """``items`` with runs of ``k`` consecutive *leaf items* merged into one item each.

    A leaf item has one segment, and every query of it sits at that segment's node; it is packed
    when ``k`` such items fit one query tile (``k * queries * group <= rows``) and
    ``k * tokens <= max_tokens``. The packed items follow the others (in their order). The
    result's ``masked`` flags mark the packed items (the plan builder finds the same from
    visibility). ``items`` itself is returned when nothing packs. ``leaf`` (from the same items)
    saves finding the leaf items again. The packed items' segments and queries are made when
    first read (:class:`_PackedItems`): the cost model needs only their lengths and queries.
    """
    n = items.num_items
    if k < 2 or n < 2:
        return items
    nq = items.item_queries
    leaf = (items.leaf_items(tree) if leaf is None else leaf) & (nq <= rows // (group * k)) & \
        (items.item_len <= max_tokens // k)
    num_leaves = int(np.count_nonzero(leaf))
    if num_leaves < 2:
        return items
    return _PackedItems(items, leaf, k, num_leaves)


class _PackedItems(DeferredItems):
    """:func:`pack_leaf_items`'s result: the items of ``source`` not flagged in ``leaf``, then
    its ``num_leaves`` flagged ones ``k`` at a time, each in order."""

    def __init__(self, source: WorkItems, leaf: np.ndarray, k: int, num_leaves: int):
        n = source.num_items
        num_others = n - num_leaves
        tail = bool(leaf[num_others:].all())  # the leaf items come last (tree order): nothing moves
        others, leaves = (slice(num_others), slice(num_others, n)) if tail else (~leaf, leaf)
        groups = np.arange(0, num_leaves, k)
        length, nq = source.item_len, source.item_queries
        masked = np.zeros(num_others + groups.size, dtype=bool)
        masked[num_others:] = True
        masked[-1] = num_leaves - groups[-1] > 1
        super().__init__(np.concatenate((length[others], np.add.reduceat(length[leaves], groups))),
                         np.concatenate((nq[others], np.add.reduceat(nq[leaves], groups))), self._pack, masked=masked)
        leaves_used = min(length[leaves].min(), nq[leaves].min()) > 0
        self.__dict__.update(source=source, leaf=leaf, k=k, tail=tail, leaves_used=leaves_used)

    def used_merge_rows(self, used: np.ndarray | None = None) -> int:
        if self.leaves_used:  # (each used item's pairs go to a used item: the source's chains)
            return self.source.used_merge_rows()
        return super().used_merge_rows(used)

    @functools.cached_property
    def new_item(self) -> np.ndarray:
        """intp [source items]: the item each source item went into (with its (item, query)
        pairs)."""
        leaf = self.leaf
        leaf_rank = leaf.cumsum() - leaf
        num_others = leaf.size - int(leaf_rank[-1] + leaf[-1])
        return np.where(leaf, num_others + leaf_rank // self.k, np.arange(leaf.size) - leaf_rank)

    def merge_rows_max(self, used: np.ndarray) -> int:
        return self.source.merge_rows_max(used[self.new_item])

    def query_weights(self, per_item: np.ndarray) -> np.ndarray:
        return self.source.query_weights(per_item[self.new_item])

    def _pack(self) -> WorkItems:
        items, leaf = self.source, self.leaf
        nseg = items.seg_indptr[1:] - items.seg_indptr[:-1]
        num_packed = self.item_len.size - int(np.count_nonzero(~leaf))
        seg = [items.seg_node, items.seg_lo, items.seg_hi]
        qs = [items.q_indices, items.q_tokens]
        if self.tail:
            others = slice(items.num_items - int(np.count_nonzero(leaf)))
        else:  # the others first, then the leaf items (one segment each), each in order
            others = ~leaf
            seg_leaf = leaf.repeat(nseg)
            order = np.concatenate((np.flatnonzero(~seg_leaf), np.flatnonzero(seg_leaf)))
            seg = [a[order] for a in seg]
            q_leaf = leaf.repeat(items.item_queries)
            order = np.concatenate((np.flatnonzero(~q_leaf), np.flatnonzero(q_leaf)))
            qs = [None if a is None else a[order] for a in qs]
        seg_count = np.append(nseg[others], np.full(num_packed, self.k))
        seg_count[-1] = int(np.count_nonzero(leaf)) - (num_packed - 1) * self.k
        return WorkItems(_indptr(seg_count), *seg, _indptr(self.item_queries), *qs, self.masked)


def leaf_packing_variant(tree: DecodingTree, items: WorkItems, heads: HeadConfig, cost: CostModel
                         ) -> tuple[WorkItems | None, int]:
    """``items`` with their leaf items packed ``k`` at a time, and ``k``; ``(None, 1)`` when they
    are to be left as they are. ``k`` is the largest power of two that fits the typical (median)
    leaf item ``k`` times into a query tile and :data:`PACK_MAX_TOKENS` (on the suite's trees the
    cost model ranks the factors as measured, and the largest one won or tied). Items that already
    need the tree mask, plans with few programs, and every plan with ``cost.leaf_packing`` off are
    left as they are."""
    if not cost.leaf_packing or items.num_items * heads.num_kv_heads < cost.target_programs:
        return None, 1  # few programs: nothing to save
    leaf = items.leaf_items(tree)
    if np.count_nonzero(leaf) < 2:
        return None, 1
    rows = _median(items.item_queries[leaf]) * heads.group
    tokens = _median(items.item_len[leaf])
    fit = min(BLOCK_M_CHOICES[0] // max(rows, 1), PACK_MAX_TOKENS // max(tokens, 1), PACK_MAX_FACTOR)
    if fit < 2:
        return None, 1
    k = 1 << (fit.bit_length() - 1)
    if needs_mask(tree, items):
        return None, 1
    packed = pack_leaf_items(items, tree, k, group=heads.group, leaf=leaf)
    return (None, 1) if packed is items else (packed, k)


class LeafPackingPlanner:
    """A planner (``node``, ``greedy``) whose items may have their leaf items packed: called as
    every planner, ``(tree, heads, cost) -> (items, note)``, it returns its items or their packed
    variant (:func:`leaf_packing_variant`), whichever the cost model rates faster.
    :meth:`variants` returns both, unrated, so that ``auto`` rates them in one pass of the cost
    model with the other strategies' items.

    Parameters
    ----------
    make : callable
        ``(tree, heads, cost) -> (items, note)``: the planner's items before packing.
    """

    def __init__(self, make):
        self._make = make

    def variants(self, tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> list:
        """``[(items, note), (packed, packed note)]``, the second left out when nothing would pack."""
        items, note = self._make(tree, heads, cost)
        packed, k = leaf_packing_variant(tree, items, heads, cost)
        return [(items, note)] + ([] if packed is None else [(packed, f"{note}; leaf items packed {k} per item")])

    def __call__(self, tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
        return best_variant(tree, self.variants(tree, heads, cost), heads, cost)
