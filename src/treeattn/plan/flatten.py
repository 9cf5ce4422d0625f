"""``flatten``: DeFT-Flatten, flattened tree KV splitting.

The tree's KV is laid out depth-first (a subtree is one contiguous run, so a block's queries
overlap as much as possible) and cut into even blocks; each block is one work item with every
query that sees any of its tokens, and the tree mask hides the tokens a query must not see.
Every KV token is read once and items are balanced whatever the tree's shape.
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.cost import CostModel
from treeattn.plan.items import WorkItems, items_from_groups
from treeattn.plan.plan import HeadConfig
from treeattn.tree import DecodingTree, ranges


def plan_flatten(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    block = cost.deft_chunk_tokens
    flat = tree.topology.flat_start
    total = tree.num_tokens
    n_blocks = -(-total // block)
    # pieces of nodes in each block, depth-first order
    extent = tree.node_extent  # tokens nobody sees are left out of the blocks
    nodes = np.flatnonzero(extent > 0)
    start, end = flat[nodes], flat[nodes] + extent[nodes]
    b0, b1 = start // block, (end - 1) // block
    piece_node = np.repeat(nodes, b1 - b0 + 1)
    piece_block = ranges(b0, b1 + 1)
    lo = np.maximum(piece_block * block, flat[piece_node]) - flat[piece_node]
    hi = np.minimum((piece_block + 1) * block, flat[piece_node] + extent[piece_node]) - flat[piece_node]
    order = np.lexsort((flat[piece_node], piece_block))
    # queries of each block: those whose visible part of some node overlaps it
    q, node, visible = tree.visible_pairs
    qb0, qb1 = flat[node] // block, (flat[node] + visible - 1) // block
    pair_block = ranges(qb0, qb1 + 1)
    pair_q = np.repeat(q, qb1 - qb0 + 1)
    # tokens of the block the query sees through this node
    pair_start = np.repeat(flat[node], qb1 - qb0 + 1)
    pair_end = pair_start + np.repeat(visible, qb1 - qb0 + 1)
    seen = np.minimum(pair_end, (pair_block + 1) * block) - np.maximum(pair_start, pair_block * block)
    # pairs go by query, root first, so each query's blocks are non-decreasing: merging repeats
    # of the previous (block, query) leaves each once, and grouping by block keeps queries sorted
    new = np.flatnonzero(np.concatenate(
        ([True], (pair_block[1:] != pair_block[:-1]) | (pair_q[1:] != pair_q[:-1]))))
    items = items_from_groups(piece_block[order], piece_node[order], lo[order], hi[order],
                              pair_block[new], pair_q[new], n_blocks, q_tokens=np.add.reduceat(seen, new))
    return items, f"flatten: depth-first KV in {n_blocks} blocks of {block} tokens"
