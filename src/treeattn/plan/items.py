"""Work items: what every planner produces before the shared plan builder lowers it to tensors.

A work item is a run of KV tokens (one or more *segments*, each a token range of one node) and
the queries that attend to it together. Items are the papers' "QKV groups" (DeFT), "CTAs" (PAT)
and "context-queries groups" (FastTree). A query of an item may see only part of the item's
tokens (DeFT-Flatten blocks, queries inside speculative token trees); the builder detects that and
turns on the tree mask for the plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treeattn.tree import DecodingTree, ranges

__all__ = ["WorkItems", "items_from_groups", "split_long_items", "glued_items"]


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
    """

    seg_indptr: np.ndarray
    seg_node: np.ndarray
    seg_lo: np.ndarray
    seg_hi: np.ndarray
    q_indptr: np.ndarray
    q_indices: np.ndarray

    @property
    def num_items(self) -> int:
        return int(self.seg_indptr.size - 1)

    @property
    def item_len(self) -> np.ndarray:
        """int64 [num_items]: KV tokens of each item."""
        seg_len = self.seg_hi - self.seg_lo
        return _segment_sum(seg_len, self.seg_indptr)

    @property
    def item_queries(self) -> np.ndarray:
        return np.diff(self.q_indptr)

    def take(self, keep: np.ndarray) -> "WorkItems":
        """The items selected by index array ``keep`` (in that order)."""
        seg = ranges(self.seg_indptr[keep], self.seg_indptr[keep + 1])
        qs = ranges(self.q_indptr[keep], self.q_indptr[keep + 1])
        return WorkItems(
            _indptr(self.seg_indptr[keep + 1] - self.seg_indptr[keep]), self.seg_node[seg],
            self.seg_lo[seg], self.seg_hi[seg],
            _indptr(self.q_indptr[keep + 1] - self.q_indptr[keep]), self.q_indices[qs])


def _indptr(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _segment_sum(values: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    c = np.concatenate(([0], np.cumsum(values)))
    return c[indptr[1:]] - c[indptr[:-1]]


def items_from_groups(seg_item, seg_node, seg_lo, seg_hi, q_item, q_query, num_items: int) -> WorkItems:
    """Build :class:`WorkItems` from flat (item id, ...) lists; segment order within an item and
    query order within an item are kept (stable sort by item)."""
    seg_item = np.asarray(seg_item, dtype=np.int64)
    q_item = np.asarray(q_item, dtype=np.int64)
    so = np.argsort(seg_item, kind="stable")
    qo = np.argsort(q_item, kind="stable")
    return WorkItems(
        _indptr(np.bincount(seg_item, minlength=num_items)),
        np.asarray(seg_node, dtype=np.int64)[so], np.asarray(seg_lo, dtype=np.int64)[so],
        np.asarray(seg_hi, dtype=np.int64)[so],
        _indptr(np.bincount(q_item, minlength=num_items)), np.asarray(q_query, dtype=np.int64)[qo])


def split_long_items(items: WorkItems, max_len: np.ndarray | int, *, align: int = 16) -> WorkItems:
    """Split every item longer than ``max_len`` (scalar or per item) into equal chunks of at most
    ``max_len`` tokens (rounded up to ``align``), each with all the item's queries: Flash-Decoding's
    KV split, PAT's long-KV split and FastTree's long-context splitting."""
    n = items.num_items
    length = items.item_len
    max_len = np.broadcast_to(np.asarray(max_len, dtype=np.int64), (n,))
    max_len = np.maximum(max_len, 1)
    chunks = np.maximum(1, -(-length // max_len))
    if np.all(chunks == 1):
        return items
    chunk_len = -(-length // chunks)
    chunk_len = np.minimum(np.maximum(align, -(-chunk_len // align) * align), np.maximum(length, 1))
    chunks = np.maximum(1, -(-length // chunk_len))
    # cut points (item-local token positions): segment starts and chunk starts
    seg_len = items.seg_hi - items.seg_lo
    seg_item = np.repeat(np.arange(n), np.diff(items.seg_indptr))
    seg_start_local = np.concatenate(([0], np.cumsum(seg_len)))[:-1] - \
        np.concatenate(([0], np.cumsum(seg_len)))[items.seg_indptr[:-1]][seg_item]
    chunk_item = np.repeat(np.arange(n), chunks)
    chunk_start_local = ranges(np.zeros(n, np.int64), chunks) * chunk_len[chunk_item]
    big = int(length.max()) + 1
    keys = np.unique(np.concatenate((seg_item * big + seg_start_local, chunk_item * big + chunk_start_local)))
    cut_item, cut_pos = keys // big, keys % big
    nxt = np.append(cut_pos[1:], 0)
    nxt_item = np.append(cut_item[1:], -1)
    end = np.where(nxt_item == cut_item, nxt, length[cut_item])
    keep = end > cut_pos
    cut_item, cut_pos, end = cut_item[keep], cut_pos[keep], end[keep]
    # map each piece to its segment (last segment of the item starting at or before it)
    seg_key = seg_item * big + seg_start_local
    s = np.searchsorted(seg_key, cut_item * big + cut_pos, side="right") - 1
    piece_node = items.seg_node[s]
    piece_lo = items.seg_lo[s] + (cut_pos - seg_start_local[s])
    piece_hi = piece_lo + (end - cut_pos)
    piece_chunk = cut_pos // chunk_len[cut_item]
    new_item_base = np.concatenate(([0], np.cumsum(chunks)))[:-1]
    piece_new_item = new_item_base[cut_item] + piece_chunk
    q_cnt = items.item_queries[chunk_item]
    q_new_item = np.repeat(np.arange(chunk_item.size), q_cnt)
    q_new = items.q_indices[ranges(items.q_indptr[chunk_item], items.q_indptr[chunk_item + 1])]
    return items_from_groups(piece_new_item, piece_node, piece_lo, piece_hi, q_new_item, q_new,
                             int(chunks.sum()))


def glued_items(tree: DecodingTree, glued: np.ndarray) -> WorkItems:
    """Items of a tree whose edges are cut or glued (PAT's merge schemes, FastTree's binary edge
    assignment).

    ``glued[c]`` says the edge ``parent(c) -> c`` is glued: ``c``'s queries attend to the parent's
    context inside ``c``'s item instead of in the parent's item. Each node ``b`` yields one item:
    the chain from ``b`` up through glued edges (root first), with the queries for which ``b`` is
    the bottom of such a chain on their path.
    """
    eff_node, _ = tree.effective_queries
    q, node = tree.paths(eff_node)  # zero-length nodes kept: they can carry glue
    nxt_same = np.append(q[1:] == q[:-1], False)
    nxt_node = np.append(node[1:], -1)
    bottom = ~nxt_same | ~glued[np.maximum(nxt_node, 0)] | (nxt_node < 0)
    # chain of every node: walk up while glued
    n = tree.num_nodes
    owner = [np.arange(n)]
    seg = [np.arange(n)]
    alive, cur = np.arange(n), np.arange(n)
    while alive.size:
        up = glued[cur] & (tree.parents[cur] >= 0)
        alive, cur = alive[up], tree.parents[cur[up]]
        owner.append(alive)
        seg.append(cur)
    owner, seg = np.concatenate(owner), np.concatenate(seg)
    order = np.lexsort((tree.topology.depth[seg], owner))
    owner, seg = owner[order], seg[order]
    return items_from_groups(owner, seg, np.zeros_like(seg), tree.node_extent[seg], node[bottom],
                             q[bottom], n)
