"""Sliding-window attention over a decoding tree, as a tree.

A query of a sliding-window layer sees only the last ``W`` tokens of its path (its own token
included). Attention does not depend on the order of the KV tokens (RoPE is already in the keys),
so the tokens a sliding layer's queries see form a tree again: group the queries by where their
window starts; each group sees the original tree restricted to its queries' paths, with the tokens
before the group's window start cut off (nodes wholly before it dropped, the first one kept
clipped to its tail and made a root). The clipped tree addresses the same KV slots (no copies), so
the normal planners plan it.
"""
from __future__ import annotations

import numpy as np

from treeattn.tree.decoding_tree import DecodingTree
from treeattn.tree.topology import ranges

__all__ = ["window_tree"]


def window_tree(tree: DecodingTree, window: int) -> DecodingTree:
    """The tree of the tokens each query sees through a sliding window of ``window`` tokens.

    Query ``j`` sees ``v = tree.visible_tokens[j]`` tokens along its path; with the window it sees
    the last ``min(v, window)`` of them (a token at path position ``p`` is seen by a query at
    position ``v - 1`` iff ``p > v - 1 - window``, transformers' sliding-window mask). Queries
    whose windows start at the same path position (queries decoded in lockstep) keep sharing
    the nodes they share; a node wholly before every window of its queries is not in the result.

    Parameters
    ----------
    tree : DecodingTree
    window : int
        ``W >= 1``.

    Returns
    -------
    DecodingTree
        ``tree`` itself when no query sees more than ``window`` tokens; else a tree over the
        same KV slots, page size and pool, with the same queries in the same order, each seeing
        exactly its windowed tokens.
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    visible = tree.visible_tokens
    start = np.maximum(visible - int(window), 0)
    if not start.any():
        return tree
    starts, group = np.unique(start, return_inverse=True)
    n = tree.num_nodes
    owner, node = tree.paths(tree.query_nodes)
    # one node of the result per (group, node on a path of the group's queries), by group then node
    keys = np.unique(group[owner] * n + node)
    g, u = np.divmod(keys, n)
    first = tree.topology.path_tokens[u]             # path position of the node's first token
    cut = starts[g] - first
    keep = tree.lengths[u] > cut                     # (a query's own node always is: it sees a token)
    keys, g, u, cut = keys[keep], g[keep], u[keep], np.maximum(cut[keep], 0)
    par = tree.parents[u]
    at = np.searchsorted(keys, g * n + par)
    found = (par >= 0) & (at < keys.size)
    found[found] = keys[at[found]] == (g * n + par)[found]
    parents = np.where(found, at, -1)
    lengths = tree.lengths[u] - cut
    kv = tree.kv_indices[ranges(tree.kv_indptr[u] + cut, tree.kv_indptr[u + 1])]
    qnode = np.searchsorted(keys, group * n + tree.query_nodes)
    return DecodingTree.from_parents(parents, lengths, query_nodes=qnode,
                                     query_prefix=tree.query_prefix - cut[qnode], kv_indices=kv,
                                     page_size=tree.page_size, num_slots=tree.num_slots)
