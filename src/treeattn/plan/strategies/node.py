"""``node``: DeFT-Node, KV-guided grouping by tree node.

One work item per node holding all queries that see any of its tokens, so every KV token is read
once; the item count and sizes follow the tree, which balances poorly (DeFT Sec. 3.3).
"""
from __future__ import annotations

import functools

import numpy as np

from treeattn.plan.lower.addressing import runs_between
from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import RangeItems, WorkItems, _indptr, queries_at_nodes
from treeattn.plan.strategies.query_ranges import query_ranges
from treeattn.plan.strategies.leaf_packing import LeafPackingPlanner
from treeattn.plan.format import HeadConfig
from treeattn.tree import DecodingTree


def node_items(tree: DecodingTree) -> WorkItems:
    """One item per node with visible tokens: the node (up to the last token anyone sees) and every
    query seeing part of it (made once per tree: ``node`` and ``node_chunk`` share them)."""
    items = tree.derived.get("node_items")
    if items is None:
        items = tree.derived["node_items"] = _node_items(tree)
    return items


def _node_items(tree: DecodingTree) -> WorkItems:
    # a node's item holds every query of its subtree (each sees a token of it): a range of the
    # queries in depth-first order, so the counts, merge rows and weights need no (item, query)
    # pairs, which are listed only when the items are made
    seg_hi = tree.node_extent
    order, lo, hi = query_ranges(tree)
    item_queries = tree.subtree_queries
    if seg_hi.all():
        nodes = np.arange(seg_hi.size)
    else:
        nodes = np.flatnonzero(seg_hi)  # exactly the nodes some query sees a token of
        seg_hi, lo, hi, item_queries = seg_hi[nodes], lo[nodes], hi[nodes], item_queries[nodes]

    def make() -> WorkItems:
        q, node, _, visible = tree.pairs_by_node
        seen = visible > 0  # (zero-length nodes have pairs but no visible tokens)
        if not seen.all():
            q, visible = q[seen], visible[seen]
        return WorkItems(np.arange(nodes.size + 1), nodes, np.zeros_like(nodes), seg_hi, _indptr(item_queries), q,
                         visible)

    items = _NodeItems(seg_hi, item_queries, make, order, lo, hi, tree.num_queries, single_nodes=nodes)
    items.__dict__["_tree"] = tree
    return items


class _NodeItems(RangeItems):
    """:func:`node_items`' items, whose leaf items come from the tree's query counts."""

    @functools.cached_property
    def unmasked_runs(self) -> bool:
        # each item is its node's first tokens: one run where the node's slots are (found when
        # the cost model asks, with TMA only)
        tree, nodes = self._tree, self._single_nodes
        start = tree.kv_indptr[nodes]
        return bool(runs_between(tree.slot_breaks, start, start + self.item_len).all())

    def leaf_items(self, tree: DecodingTree) -> np.ndarray:
        # node x's item holds the queries whose effective node (DecodingTree.effective_queries)
        # is in x's subtree: all sit at x iff as many are at x and see a token of it
        nq = self.item_queries
        return (nq > 0) & (queries_at_nodes(tree)[self._single_nodes] == nq)


def _plan_node(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    return node_items(tree), "node: one item per tree node"


plan_node = LeafPackingPlanner(_plan_node)
