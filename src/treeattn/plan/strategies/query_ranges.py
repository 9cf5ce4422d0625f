"""The queries in depth-first order, where a node's subtree holds a range of them: items whose
queries are such ranges (or sums of them) weigh queries without listing (item, query) pairs."""
from __future__ import annotations

import numpy as np

from treeattn.tree import DecodingTree

__all__ = ["query_ranges", "range_weights"]


def query_ranges(tree: DecodingTree) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """``(order, lo, hi)``: the queries in depth-first order (int64 [Q], by their effective
    node's pre-order number, stable; None when that is their id order) and, int64 [N], the ranks
    ``lo..hi-1`` in that order of the queries of each node's subtree (made once per tree)."""
    got = tree.derived.get("query_ranges")
    if got is None:
        q_tin = tree.topology.tin[tree.effective_queries[0]]
        order = None if (q_tin[1:] >= q_tin[:-1]).all() else np.argsort(q_tin, kind="stable")
        lo, hi, _ = tree.queries_below
        got = tree.derived["query_ranges"] = (order, lo, hi)
    return got


def range_weights(order: np.ndarray | None, lo: np.ndarray, hi: np.ndarray, weights: np.ndarray,
                  num_queries: int) -> np.ndarray:
    """int64 [num_queries]: for each query, the sum of ``weights`` (integers) over the rank ranges
    ``lo[i]..hi[i]-1`` (int64, :func:`query_ranges`) that hold its rank; ``order`` ranks the
    queries (None: by id)."""
    # (float64 sums of small integers are exact; numpy's integer prefix sum is several times
    # faster than its float one)
    step = (np.bincount(lo, weights, num_queries + 1) - np.bincount(hi, weights, num_queries + 1)).astype(np.int64)
    by_rank = step.cumsum()[:-1]
    if order is None:
        return by_rank
    out = np.empty_like(by_rank)
    out[order] = by_rank
    return out
