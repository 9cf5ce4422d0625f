"""``flatten``: DeFT-Flatten, flattened tree KV splitting.

The tree's KV is laid out depth-first (a subtree is one contiguous run, so a block's queries
overlap as much as possible) and cut into even blocks; each block is one work item with every
query that sees any of its tokens, and the tree mask hides the tokens a query must not see.
Every KV token is read once and items are balanced whatever the tree's shape.
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import DeferredItems, RangeItems, WorkItems, _indptr, _same, _segment_sum, items_from_groups
from treeattn.plan.strategies.paths import _whole_paths
from treeattn.plan.format import HeadConfig
from treeattn.plan.strategies.query_ranges import query_ranges
from treeattn.tree.topology import ranges
from treeattn.tree import DecodingTree


def plan_flatten(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    block = cost.deft_chunk_tokens
    flat = tree.topology.flat_start
    total = tree.num_tokens
    n_blocks = -(-total // block)
    extent = tree.node_extent  # tokens nobody sees are left out of the blocks

    def pieces() -> tuple:
        """``(block, node, lo, hi)`` of the pieces of nodes in each block, depth-first order (so
        by block too)."""
        nodes = tree.topology.order
        nodes = nodes[extent[nodes] > 0]
        start, end = flat[nodes], flat[nodes] + extent[nodes]
        b0, b1 = start // block, (end - 1) // block
        piece_node = nodes.repeat(b1 - b0 + 1)
        piece_block = ranges(b0, b1 + 1)
        piece_start = flat[piece_node]
        lo = np.maximum(piece_block * block, piece_start) - piece_start
        hi = np.minimum((piece_block + 1) * block, piece_start + extent[piece_node]) - piece_start
        return piece_block, piece_node, lo, hi

    note = f"flatten: depth-first KV in {n_blocks} blocks of {block} tokens"
    if _same(extent, tree.lengths):  # every token is seen: whole blocks, but the last
        made = None
        item_len = np.full(n_blocks, block, dtype=np.int64)
        if n_blocks:
            item_len[-1] = total - (n_blocks - 1) * block
        if _whole_paths(tree):
            # a query sees a block iff it sees a node in it; a node's queries are a range of them
            # in depth-first order, and so are a block's (lowest to highest), no pairs listed
            q_lo, q_hi = _block_query_ranges(tree, block, n_blocks)

            def make_whole() -> WorkItems:
                q_block, q_query, q_tokens = _block_pairs(tree, block)
                return items_from_groups(*pieces(), q_block, q_query, n_blocks, q_tokens=q_tokens())

            return RangeItems(item_len, q_hi - q_lo, make_whole, query_ranges(tree)[0], q_lo, q_hi,
                              tree.num_queries), note
    else:
        made = pieces()
        item_len = _segment_sum(made[3] - made[2], _indptr(np.bincount(made[0], minlength=n_blocks)))
    q_block, q_query, q_tokens = _block_pairs(tree, block)

    def make() -> WorkItems:
        return items_from_groups(*(made or pieces()), q_block, q_query, n_blocks, q_tokens=q_tokens())

    return DeferredItems(item_len, np.bincount(q_block, minlength=n_blocks), make, q_block, q_query), note


def _block_pairs(tree: DecodingTree, block: int) -> tuple:
    """``(q_block, q_query, q_tokens)``: the (block, query) pairs where the query's visible part of
    some node overlaps the block, by query then block, and ``q_tokens()`` the tokens of the block
    each pair's query sees through that node."""
    flat = tree.topology.flat_start
    q, node, visible = tree.visible_pairs
    pair_start = flat[node]
    pair_block = pair_start // block
    span = (pair_start + visible - 1) // block - pair_block
    if span.any():  # (else every visible part lies in one block)
        pair_q = np.repeat(q, span + 1)
        pair_block = ranges(pair_block, pair_block + span + 1)
    else:
        pair_q = q
    # pairs go by query, root first, so each query's blocks are non-decreasing: merging repeats
    # of the previous (block, query) leaves each once, and grouping by block keeps queries sorted
    new = np.empty(pair_q.size, dtype=bool)
    new[0] = True
    np.not_equal(pair_block[1:], pair_block[:-1], out=new[1:])
    new[1:] |= pair_q[1:] != pair_q[:-1]
    new = np.flatnonzero(new)

    def q_tokens() -> np.ndarray:
        if span.any():
            starts = np.repeat(pair_start, span + 1)
            seen = (np.minimum(np.repeat(pair_start + visible, span + 1), (pair_block + 1) * block)
                    - np.maximum(starts, pair_block * block))
        else:
            seen = visible
        return np.add.reduceat(seen, new)

    return pair_block[new], pair_q[new], q_tokens


def _block_query_ranges(tree: DecodingTree, block: int, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 [n_blocks] ``(lo, hi)``: each block's queries are the ranks ``lo..hi-1`` in depth-first
    order (:func:`~treeattn.plan.strategies.query_ranges.query_ranges`), for a tree whose every token is seen and
    whose queries see each node of their paths whole.

    The nodes a block overlaps are a run of the pre-order; each one after the first is a child of
    an earlier one, or starts the queries after those of the subtrees before it, so their ranges
    join into one from the first node's start to the furthest end."""
    _, node_lo, node_hi = query_ranges(tree)
    nodes = tree.topology.order
    if not tree.lengths.all():
        nodes = nodes[tree.lengths[nodes] > 0]
    start = tree.topology.flat_start[nodes]
    bounds = np.arange(0, (n_blocks + 1) * block, block)  # block b: tokens bounds[b] to bounds[b + 1] - 1
    bounds[-1] = tree.num_tokens
    # the nodes holding each block's first and last token (the last node starting before its end)
    first = np.searchsorted(start, bounds[:-1], side="right") - 1
    last = np.searchsorted(start, bounds[1:], side="left") - 1
    hi = node_hi[nodes]
    # (the maximum up to the next block's first node, which its last node is, or follows)
    return node_lo[nodes[first]], np.maximum(np.maximum.reduceat(hi, first), hi[last])
