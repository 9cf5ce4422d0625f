"""Work items: what every planner produces before the shared plan builder lowers it to tensors.

A work item is a run of KV tokens (one or more *segments*, each a token range of one node) and
the queries that attend to it together. Items are the papers' "QKV groups" (DeFT), "CTAs" (PAT)
and "context-queries groups" (FastTree). A query of an item may see only part of the item's
tokens (DeFT-Flatten blocks, queries inside speculative token trees); the builder detects that and
turns on the tree mask for the plan.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from treeattn.plan.strategies.query_ranges import query_ranges, range_weights
from treeattn.tree.topology import ranges
from treeattn.tree import DecodingTree

__all__ = ["WorkItems", "DeferredItems", "RangeItems", "concat_items", "glued_items", "group_order", "items_from_groups",
           "masked_flags"]


@dataclass(frozen=True)
class WorkItems:
    """Host-side work items in CSR form (all int64).

    Attributes
    ----------
    seg_indptr : [num_items + 1]
        Segments of item ``i`` are ``seg_indptr[i]:seg_indptr[i + 1]``, in KV order.
    seg_node, seg_lo, seg_hi : [num_segments]
        Segment = tokens ``[seg_lo, seg_hi)`` of node ``seg_node``.
    q_indptr, q_indices : [num_items + 1], [nnz]
        Queries of each item.
    q_tokens : [nnz] or None
        Tokens of its item that each query sees, when the planner knows them cheaply (else the
        plan builder computes them from the tree); :func:`~treeattn.plan.strategies.split.split_long_items` keeps them when every
        query sees its items whole.
    masked : bool [num_items] or None
        Items some query sees only part of, when the planner knows (leaf packing); None: the cost
        model assumes the whole plan is masked iff some item is.
    mask_lead : [num_items] or None
        Tokens of each item that all its queries see before the first one some query does not (the
        kernel runs the KV tiles before it unmasked), -1 where not known; None: not known. Only
        the cost model reads it.
    unmasked_runs : bool
        Every item without the tree mask reads one run of consecutive KV slots, as the planner
        that made them knows (``paths``' split variants, :func:`~treeattn.plan.strategies.leads.on_runs`;
        ``node``'s items); the cost model then rates the TMA loads the builder gives their
        launches. False: not known. Not a field.
    """

    unmasked_runs = False

    seg_indptr: np.ndarray
    seg_node: np.ndarray
    seg_lo: np.ndarray
    seg_hi: np.ndarray
    q_indptr: np.ndarray
    q_indices: np.ndarray
    q_tokens: np.ndarray | None = None
    masked: np.ndarray | None = None
    mask_lead: np.ndarray | None = None

    @property
    def num_items(self) -> int:
        return int(self.seg_indptr.size - 1)

    @functools.cached_property
    def item_len(self) -> np.ndarray:
        """int64 [num_items]: KV tokens of each item."""
        seg_len = self.seg_hi - self.seg_lo
        return _segment_sum(seg_len, self.seg_indptr)

    @functools.cached_property
    def item_queries(self) -> np.ndarray:
        """int64 [num_items]: queries of each item."""
        return self.q_indptr[1:] - self.q_indptr[:-1]

    def with_item_len(self, item_len: np.ndarray) -> "WorkItems":
        """These items, with :attr:`item_len` known (from whoever made them)."""
        self.__dict__["item_len"] = item_len  # (fills the cached property)
        return self

    def single_nodes(self) -> np.ndarray:
        """int64 [num_items]: the node of each item's segment, for items with one segment; -1
        for the others."""
        one = self.seg_indptr[1:] - self.seg_indptr[:-1] == 1
        if one.all():
            return self.seg_node
        return np.where(one, self.seg_node[np.minimum(self.seg_indptr[:-1], self.seg_node.size - 1)], -1)

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(item, query)``: the (item, query) pairs, in any order."""
        return np.arange(self.num_items).repeat(self.item_queries), self.q_indices

    def leaf_items(self, tree: DecodingTree) -> np.ndarray:
        """bool [num_items]: the *leaf items* (:mod:`~treeattn.plan.strategies.leaf_packing`), those with one
        segment and queries, all of which sit at that segment's node of ``tree``."""
        seg_node = self.single_nodes()
        leaf = (seg_node >= 0) & (self.item_queries > 0)
        if not leaf.any():
            return leaf
        # items with a query at another node are not
        q_item, q_query = self.pairs()
        elsewhere = tree.query_nodes[q_query] != seg_node[q_item]
        leaf[q_item[elsewhere]] = False
        return leaf

    def merge_rows_max(self, used: np.ndarray) -> int:
        """The most ``used`` items (bool [num_items]) that one query is in: its chain of partial
        rows to merge (0 without used items)."""
        q_used = self.q_indices if used.all() else self.q_indices[used.repeat(self.item_queries)]
        return int(np.bincount(q_used).max()) if q_used.size else 0

    def used_merge_rows(self, used: np.ndarray | None = None) -> int:
        """:meth:`merge_rows_max` of the used items (``used``: those with tokens and queries, as
        the cost model finds them; found when not given), computed once."""
        rows = self.__dict__.get("_used_merge_rows")
        if rows is None:
            if used is None:
                used = (self.item_len > 0) & (self.item_queries > 0)
            rows = self.__dict__["_used_merge_rows"] = self.merge_rows_max(used)
        return rows

    def query_weights(self, per_item: np.ndarray) -> np.ndarray:
        """float64 (int64 for some subclasses): for each query (up to the largest in an item, or
        all), the sum of ``per_item`` (small integers: exact) over the items it is in."""
        return np.bincount(self.q_indices, per_item.repeat(self.item_queries))

    def take(self, keep: np.ndarray) -> "WorkItems":
        """The items selected by index array ``keep`` (in that order)."""
        if keep.size == self.num_items and (keep == np.arange(keep.size)).all():
            return self
        seg = ranges(self.seg_indptr[keep], self.seg_indptr[keep + 1])
        qs = ranges(self.q_indptr[keep], self.q_indptr[keep + 1])
        return WorkItems(
            _indptr(self.seg_indptr[keep + 1] - self.seg_indptr[keep]), self.seg_node[seg],
            self.seg_lo[seg], self.seg_hi[seg],
            _indptr(self.q_indptr[keep + 1] - self.q_indptr[keep]), self.q_indices[qs],
            None if self.q_tokens is None else self.q_tokens[qs],
            None if self.masked is None else self.masked[keep],
            None if self.mask_lead is None else self.mask_lead[keep])


def _indptr(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size + 1, dtype=np.int64)
    counts.cumsum(out=out[1:])
    return out


def _segment_sum(values: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    c = _indptr(values)
    return c[indptr[1:]] - c[indptr[:-1]]


def group_order(ids: np.ndarray, num_groups: int) -> np.ndarray | None:
    """Stable order that groups ``ids`` (in ``[0, num_groups)``), or None when they already are."""
    if ids.size < 2 or not (ids[1:] < ids[:-1]).any():
        return None
    if num_groups <= 1 << 16:
        ids = ids.astype(np.uint16)  # numpy's stable sort of 16-bit keys is a (fast) radix sort
    return np.argsort(ids, kind="stable")


def items_from_groups(seg_item, seg_node, seg_lo, seg_hi, q_item, q_query, num_items: int,
                      q_tokens=None) -> WorkItems:
    """Build :class:`WorkItems` from flat (item id, ...) lists; segment order within an item and
    query order within an item are kept (stable sort by item)."""
    seg_item = np.asarray(seg_item, dtype=np.int64)
    q_item = np.asarray(q_item, dtype=np.int64)
    seg = [np.asarray(a, dtype=np.int64) for a in (seg_node, seg_lo, seg_hi)]
    q_query = np.asarray(q_query, dtype=np.int64)
    so = group_order(seg_item, num_items)
    if so is not None:
        seg = [a[so] for a in seg]
    qo = group_order(q_item, num_items)
    if qo is not None:
        q_query = q_query[qo]
        q_tokens = None if q_tokens is None else q_tokens[qo]
    return WorkItems(_indptr(np.bincount(seg_item, minlength=num_items)), *seg,
                     _indptr(np.bincount(q_item, minlength=num_items)), q_query, q_tokens)


def masked_flags(items: WorkItems) -> np.ndarray | None:
    """bool [num_items]: the items some query sees only part of, from :attr:`WorkItems.masked` or
    else their ``q_tokens`` (None without either)."""
    if items.masked is not None:
        return items.masked
    if items.q_tokens is None:
        return None
    return _segment_sum(items.q_tokens, items.q_indptr) < items.item_len * items.item_queries


def concat_items(first: WorkItems, second: WorkItems) -> WorkItems:
    """The items of ``first``, then those of ``second``; ``masked`` flags where both have them or
    their ``q_tokens`` (:func:`masked_flags`)."""
    masked = [masked_flags(first), masked_flags(second)]
    q_tokens = [first.q_tokens, second.q_tokens]
    lead = [a if a is not None else np.full(b.num_items, -1, dtype=np.int64)
            for a, b in ((first.mask_lead, first), (second.mask_lead, second))]
    return WorkItems(
        np.concatenate((first.seg_indptr, second.seg_indptr[1:] + first.seg_indptr[-1])),
        *(np.concatenate((getattr(first, f), getattr(second, f))) for f in ("seg_node", "seg_lo", "seg_hi")),
        np.concatenate((first.q_indptr, second.q_indptr[1:] + first.q_indptr[-1])),
        np.concatenate((first.q_indices, second.q_indices)),
        None if any(a is None for a in q_tokens) else np.concatenate(q_tokens),
        None if any(a is None for a in masked) else np.concatenate(masked),
        None if first.mask_lead is None and second.mask_lead is None else np.concatenate(lead),
    ).with_item_len(np.concatenate((first.item_len, second.item_len)))


def _made_field(name: str) -> property:
    return property(lambda self: getattr(self.made, name), doc="See :class:`WorkItems` (makes them).")


class DeferredItems(WorkItems):
    """Work items whose lengths and query counts are known at once and whose segments and
    queries ``make()`` returns (as :class:`WorkItems`) when first read. The cost model rates items
    from their lengths, query counts and merge rows alone, so ``auto``, which rates every
    strategy's items, makes the rest only for the strategy it chooses. ``q_item, q_query`` are
    the items' (item, query) pairs in any order, for the merge rows (subclasses without them
    override :meth:`merge_rows_max` and :meth:`query_weights`; ``q_query`` None: query ``j``'s
    only item is ``q_item[j]``); ``single_nodes``, when given, is
    :meth:`single_nodes` (leaf packing finds leaf items from it and the pairs)."""

    seg_indptr, seg_node, seg_lo, seg_hi = (_made_field(f) for f in ("seg_indptr", "seg_node", "seg_lo", "seg_hi"))
    q_indptr, q_indices, q_tokens = (_made_field(f) for f in ("q_indptr", "q_indices", "q_tokens"))

    def __init__(self, item_len: np.ndarray, item_queries: np.ndarray, make, q_item=None, q_query=None,
                 single_nodes=None, *, masked: np.ndarray | None = None, mask_lead: np.ndarray | None = None):
        # (frozen dataclass: values go straight into the instance dict; ``masked`` and
        # ``mask_lead`` are the items' own, not the made ones')
        self.__dict__.update(item_len=item_len, item_queries=item_queries, _make=make, _pairs=(q_item, q_query),
                             _single_nodes=single_nodes, masked=masked, mask_lead=mask_lead)

    @property
    def num_items(self) -> int:
        return int(self.item_len.size)

    def single_nodes(self) -> np.ndarray:
        return super().single_nodes() if self._single_nodes is None else self._single_nodes

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        q_item, q_query = self._pairs
        if q_item is None:
            return super().pairs()
        return q_item, np.arange(q_item.size) if q_query is None else q_query

    def merge_rows_max(self, used: np.ndarray) -> int:
        q_item, q_query = self._pairs
        if q_query is None:  # (one item per query)
            return int(q_item.size > 0 and (used.all() or bool(used[q_item].any())))
        q = q_query if used.all() else q_query[used[q_item]]
        return int(np.bincount(q).max()) if q.size else 0

    def query_weights(self, per_item: np.ndarray) -> np.ndarray:
        q_item, q_query = self._pairs
        weights = per_item[q_item]
        return weights.astype(np.float64) if q_query is None else np.bincount(q_query, weights)

    @functools.cached_property
    def made(self) -> WorkItems:
        """The items as plain :class:`WorkItems`."""
        return self._make().with_item_len(self.item_len)


class RangeItems(DeferredItems):
    """Deferred items (:class:`DeferredItems`) whose queries are each a range of the queries in
    depth-first order: item ``i`` those of ranks ``lo[i]..hi[i]-1`` (:func:`query_ranges`;
    ``order`` ranks ``num_queries`` queries, None: by id), so a query's merge rows and weights
    need no (item, query) pairs. ``single_nodes``: as :class:`DeferredItems`'."""

    def __init__(self, item_len: np.ndarray, item_queries: np.ndarray, make, order: np.ndarray | None,
                 lo: np.ndarray, hi: np.ndarray, num_queries: int, single_nodes: np.ndarray | None = None):
        super().__init__(item_len, item_queries, make, single_nodes=single_nodes)
        self.__dict__["_ranges"] = (order, lo, hi, num_queries)

    def merge_rows_max(self, used: np.ndarray) -> int:
        rows = self.query_weights(used)
        return int(rows.max()) if rows.size else 0

    def query_weights(self, per_item: np.ndarray) -> np.ndarray:
        order, lo, hi, num_queries = self._ranges
        return range_weights(order, lo, hi, per_item, num_queries)


def glued_items(tree: DecodingTree, glued: np.ndarray, top: np.ndarray | None = None) -> WorkItems:
    """Items of a tree whose edges are cut or glued (PAT's merge schemes, FastTree's binary edge
    assignment).

    ``glued[c]`` says the edge ``parent(c) -> c`` is glued: ``c``'s queries attend to the parent's
    context inside ``c``'s item instead of in the parent's item. Each node ``b`` yields one item:
    the chain from ``b`` up through glued edges (root first), with the queries for which ``b`` is
    the bottom of such a chain on their path. The chains (segments) are made when first read.
    ``top`` (the top of each node's chain), when the caller has it, saves finding it again.
    """
    parents, topo = tree.parents, tree.topology
    glued = glued & (parents >= 0)
    # top of each node's chain, by pointer jumping
    if top is None:
        top = np.where(glued, parents, np.arange(tree.num_nodes))
        for _ in range(chain_jumps(tree)):
            top = top[top]
    # a chain's tokens: those (seen) on the path to its bottom, less those above its top
    extent = tree.node_extent
    above = topo.path_tokens if _same(extent, tree.lengths) else _path_sums(topo, extent)
    item_len = above + extent - above[top]
    # item b holds the queries of b's subtree but those of its glued children's subtrees
    sub = tree.subtree_queries
    kids = np.flatnonzero(glued)
    item_queries = sub.copy()
    np.subtract.at(item_queries, parents[kids], sub[kids])
    return _ChainItems(tree, glued, top, item_len, item_queries)


def chain_jumps(tree: DecodingTree) -> int:
    """The pointer jumps ``top = top[top]`` that take ``top = where(glued, parents, ids)`` to the
    top of every node's chain of glued edges: each doubles the edges a node has climbed, and a
    chain has at most the tree's depth of them."""
    return max(int(tree.topology.depth.max()) - 1, 0).bit_length()


class _ChainItems(DeferredItems):
    """:func:`glued_items`' items, item ``b`` the chain whose bottom is node ``b``: the queries of
    b's subtree but those of its glued children's subtrees. Their leaf items come from the tree's
    query counts, and a query's merge rows and weights from ranges of the queries in depth-first
    order; the (item, query) pairs are listed only when asked for or made. ``top``: the top of
    each node's chain."""

    def __init__(self, tree: DecodingTree, glued: np.ndarray, top: np.ndarray, item_len: np.ndarray,
                 item_queries: np.ndarray):
        super().__init__(item_len, item_queries, self._chains)
        self.__dict__.update(_tree=tree, _glued=glued, _top=top)

    def leaf_items(self, tree: DecodingTree) -> np.ndarray:
        # a chain of one node (its own top) is one segment of it; every query at b that sees a
        # token of b's own ends its path at b, so it is in item b: all the item's queries sit at b
        # iff as many as those
        nq = self.item_queries
        return (self._top == np.arange(nq.size)) & (nq > 0) & (queries_at_nodes(tree) == nq)

    @functools.cached_property
    def _bottom_pairs(self) -> tuple:
        # pairs by node: a pair's node is the bottom of a chain unless the next node on its
        # query's path is glued to it; a query sees its items whole, but for the item ending at
        # its own (effective) node, of which it sees the first ``visible`` tokens
        q, node, nxt, visible = self._tree.pairs_by_node  # zero-length nodes kept: they can carry glue
        bottom = ~np.append(self._glued, False)[nxt]
        return node[bottom], q[bottom], visible[bottom]

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        return self._bottom_pairs[:2]

    def _chains(self) -> WorkItems:
        tree, glued, top = self._tree, self._glued, self._top
        parents, depth, extent = tree.parents, tree.topology.depth, tree.node_extent
        chain_len = depth - depth[top] + 1
        seg_indptr = _indptr(chain_len)
        # chain of every node: walk up from its own (last) slot of the chain, one level per step
        chain = np.empty(int(seg_indptr[-1]), dtype=np.int64)
        pos, cur = seg_indptr[1:] - 1, np.arange(top.size)
        chain[pos] = cur
        cur = np.flatnonzero(chain_len > 1)
        pos = pos[cur]
        while cur.size:
            pos, cur = pos - 1, parents[cur]
            chain[pos] = cur
            up = glued[cur]
            pos, cur = pos[up], cur[up]
        b, q, visible = self._bottom_pairs
        q_tokens = (self.item_len - extent)[b] + visible
        return WorkItems(seg_indptr, chain, np.zeros_like(chain), extent[chain], _indptr(self.item_queries), q,
                         q_tokens)

    def merge_rows_max(self, used: np.ndarray) -> int:
        rows = self.query_weights(used)
        return int(rows.max()) if rows.size else 0

    def query_weights(self, per_item: np.ndarray) -> np.ndarray:
        # a glued child's range weighs its own item less its parent's
        tree = self._tree
        per_item = per_item.astype(np.int64, copy=False)
        order, lo, hi = query_ranges(tree)
        return range_weights(order, lo, hi, per_item - self._glued * per_item[tree.parents], tree.num_queries)


def queries_at_nodes(tree: DecodingTree) -> np.ndarray:
    """int64 [N]: the queries at each node that see a token of it (prefix > 0: their effective
    node, :attr:`DecodingTree.effective_queries`, is that node); made once per tree."""
    got = tree.derived.get("queries_at_nodes")
    if got is None:
        got = tree.derived["queries_at_nodes"] = np.bincount(tree.query_nodes[tree.query_prefix > 0],
                                                             minlength=tree.num_nodes)
    return got


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two int64 arrays of one shape, without its overhead."""
    return a.tobytes() == b.tobytes()


def _path_sums(topo, values: np.ndarray) -> np.ndarray:
    """int64 [N]: the sum of ``values`` over each node's proper ancestors."""
    delta = np.zeros(values.size + 1, dtype=np.int64)
    delta[topo.tin] = values
    np.subtract.at(delta, topo.tout, values)
    return delta.cumsum()[topo.tin] - values
