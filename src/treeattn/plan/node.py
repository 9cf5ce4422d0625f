"""``node``: DeFT-Node, KV-guided grouping by tree node.

One work item per node holding all queries that see any of its tokens, so every KV token is read
once; the item count and sizes follow the tree, which balances poorly (DeFT Sec. 3.3).
"""
from __future__ import annotations

import weakref

import numpy as np

from treeattn.plan.cost import CostModel
from treeattn.plan.items import WorkItems, items_from_groups
from treeattn.plan.plan import HeadConfig
from treeattn.tree import DecodingTree

#: node_items of each live tree (``node`` and ``node_chunk`` both start from them; trees and
#: items are immutable)
_NODE_ITEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def node_items(tree: DecodingTree) -> WorkItems:
    """One item per node with visible tokens: the node (up to the last token anyone sees) and every
    query seeing part of it."""
    items = _NODE_ITEMS.get(tree)
    if items is None:
        items = _NODE_ITEMS[tree] = _node_items(tree)
    return items


def _node_items(tree: DecodingTree) -> WorkItems:
    q, node, visible = tree.visible_pairs
    extent = tree.node_extent
    nodes = np.flatnonzero(extent > 0)
    item_of = np.full(tree.num_nodes, -1, dtype=np.int64)
    item_of[nodes] = np.arange(nodes.size)
    return items_from_groups(np.arange(nodes.size), nodes, np.zeros_like(nodes), extent[nodes],
                             item_of[node], q, nodes.size, q_tokens=visible)


def plan_node(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    return node_items(tree), "node: one item per tree node"
