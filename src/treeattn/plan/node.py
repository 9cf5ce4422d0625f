"""``node``: DeFT-Node, KV-guided grouping by tree node.

One work item per node holding all queries that see any of its tokens, so every KV token is read
once; the item count and sizes follow the tree, which balances poorly (DeFT Sec. 3.3).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from treeattn.plan.cost import CostModel
from treeattn.plan.items import WorkItems, queries_at_nodes, query_ranges, range_weights
from treeattn.plan.packing import LeafPackingPlanner
from treeattn.plan.plan import HeadConfig
from treeattn.tree import DecodingTree


def node_items(tree: DecodingTree) -> WorkItems:
    """One item per node with visible tokens: the node (up to the last token anyone sees) and every
    query seeing part of it (made once per tree: ``node`` and ``node_chunk`` share them)."""
    items = tree.derived.get("node_items")
    if items is None:
        items = tree.derived["node_items"] = _node_items(tree)
    return items


def _node_items(tree: DecodingTree) -> WorkItems:
    q, node, _, visible = tree.pairs_by_node
    seen = visible > 0  # (zero-length nodes have pairs but no visible tokens)
    if not seen.all():
        q, node, visible = q[seen], node[seen], visible[seen]
    extent = tree.node_extent
    nodes = np.flatnonzero(extent > 0)  # exactly the nodes of the pairs left
    q_indptr = np.zeros(nodes.size + 1, dtype=np.int64)
    np.bincount(node, minlength=tree.num_nodes)[nodes].cumsum(out=q_indptr[1:])
    seg_hi = extent[nodes]
    items = _NodeItems(np.arange(nodes.size + 1), nodes, np.zeros_like(nodes), seg_hi, q_indptr, q,
                       visible).with_item_len(seg_hi)
    order, lo, hi = query_ranges(tree)
    items.__dict__["_ranges"] = (order, lo[nodes], hi[nodes], tree.num_queries)  # (frozen dataclass)
    return items


@dataclass(frozen=True)
class _NodeItems(WorkItems):
    """:func:`node_items`' items, whose leaf items come from the tree's query counts."""

    def leaf_items(self, tree: DecodingTree) -> np.ndarray:
        # node x's item holds the queries whose effective node (DecodingTree.effective_queries)
        # is in x's subtree: all sit at x iff as many are at x and see a token of it
        nq = self.item_queries
        return (nq > 0) & (queries_at_nodes(tree)[self.seg_node] == nq)

    # a node's item holds every query of its subtree (each sees a token of it): a range of the
    # queries in depth-first order, so a query's merge rows and weights need no (item, query) pairs

    def merge_rows_max(self, used: np.ndarray) -> int:
        rows = self.query_weights(used)
        return int(rows.max()) if rows.size else 0

    def query_weights(self, per_item: np.ndarray) -> np.ndarray:
        order, lo, hi, num_queries = self._ranges
        return range_weights(order, lo, hi, per_item, num_queries)


def _plan_node(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    return node_items(tree), "node: one item per tree node"


plan_node = LeafPackingPlanner(_plan_node)
