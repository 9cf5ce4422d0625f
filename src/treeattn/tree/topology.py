"""Tree topology on the host: pre-order numbering, depths, children, token offsets and the
index helpers planners share. Parts that depend only on the parent links are computed once per
tree shape (:class:`Structure`) and shared by trees that differ only in token counts and slots.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["Topology", "Structure", "ancestor_table", "build_topology", "children_of", "ranges", "root_paths", "slot_breaks"]


@dataclass(frozen=True)
class _Shape:
    """The part of a :class:`Topology` that depends only on the parents."""

    depth: np.ndarray
    order: np.ndarray
    tin: np.ndarray
    tout: np.ndarray
    child_indptr: np.ndarray
    child_indices: np.ndarray
    levels: tuple


@dataclass(frozen=True)
class Topology(_Shape):
    """Derived tree structure, computed once per tree (vectorised, no per-node Python loop
    except one numpy step per tree level).

    Attributes
    ----------
    depth : int64 [N]
        Number of proper ancestors of each node.
    order : int64 [N]
        Nodes in depth-first pre-order (children in increasing id order, roots in id order).
    tin, tout : int64 [N]
        Pre-order number of each node and one past the last pre-order number in its subtree, so
        ``a`` is an ancestor-or-self of ``b`` iff ``tin[a] <= tin[b] < tout[a]``.
    child_indptr, child_indices : int64 [N + 1], [N - roots]
        Children of each node (CSR), in increasing id order.
    levels : tuple of int64 arrays
        The nodes of each depth, roots first (a level's nodes grouped by parent).
    path_tokens : int64 [N]
        Tokens of all proper ancestors of each node.
    flat_start : int64 [N]
        Offset of each node's first token in the depth-first flattened token order.
    """

    path_tokens: np.ndarray
    flat_start: np.ndarray


def ancestor_table(parents: np.ndarray) -> np.ndarray:
    """Pointer jumping: returns each node's root, raising ValueError on a cycle."""
    n = parents.size
    up = np.where(parents < 0, np.arange(n), parents)
    for _ in range(max(1, int(np.ceil(np.log2(max(n, 2)))) + 1)):
        up = up[up]
    is_root = parents < 0
    bad = ~is_root[up]
    if bad.any():
        node = int(np.flatnonzero(bad)[0])
        raise ValueError(f"malformed tree: node {node} is on or below a cycle of parent links")
    return up


def _shape(parents: np.ndarray) -> _Shape:
    n = parents.size  # parents were validated (no cycles) when the tree was built
    # depth by level-synchronous propagation (one numpy step per level)
    depth = np.zeros(n, dtype=np.int64)
    is_root = parents < 0
    frontier = np.flatnonzero(is_root)
    nonroot = np.flatnonzero(~is_root)
    child_order = nonroot[np.lexsort((nonroot, parents[nonroot]))]  # by (parent, id)
    counts = np.bincount(parents[child_order], minlength=n) if child_order.size else np.zeros(n, np.int64)
    child_indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=child_indptr[1:])
    levels = [frontier]
    while True:
        kids = children_of(frontier, child_indptr, child_order)
        if kids.size == 0:
            break
        depth[kids] = depth[parents[kids]] + 1
        levels.append(kids)
        frontier = kids
    # subtree sizes, bottom-up
    size = np.ones(n, dtype=np.int64)
    for kids in reversed(levels[1:]):
        np.add.at(size, parents[kids], size[kids])
    # pre-order numbers: a child's number = parent's + 1 + sizes of its earlier siblings
    tin = np.zeros(n, dtype=np.int64)
    roots = levels[0]
    tin[roots] = np.concatenate(([0], np.cumsum(size[roots])[:-1]))
    rank_size = np.empty(n, dtype=np.int64)
    rank_size[child_order] = _exclusive_segment_cumsum(size[child_order], child_indptr)
    for kids in levels[1:]:
        tin[kids] = tin[parents[kids]] + 1 + rank_size[kids]
    order = np.empty(n, dtype=np.int64)
    order[tin] = np.arange(n)
    return _Shape(depth=depth, order=order, tin=tin, tout=tin + size, child_indptr=child_indptr,
                  child_indices=child_order, levels=tuple(levels))


def build_topology(shape: _Shape, lengths: np.ndarray) -> Topology:
    n = lengths.size
    # depth-first token order is the pre-order of the nodes
    flat = np.empty(n, dtype=np.int64)
    flat[shape.order] = np.cumsum(lengths[shape.order]) - lengths[shape.order]
    # tokens of ancestors-or-self: prefix sum over the pre-order of +length at a node's tin and
    # -length at its tout
    delta = np.zeros(n + 1, dtype=np.int64)
    delta[shape.tin] = lengths
    np.subtract.at(delta, shape.tout, lengths)
    path = np.cumsum(delta)[shape.tin] - lengths
    return Topology(**vars(shape), path_tokens=path, flat_start=flat)


def root_paths(parents: np.ndarray, depth: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`DecodingTree.paths`."""
    nodes = np.asarray(nodes, dtype=np.int64)
    count = depth[nodes] + 1
    owner = np.arange(nodes.size).repeat(count)
    top = int(count.max()) if count.size else 0
    if nodes.size * top <= 2 * owner.size:
        # paths of similar depths: every node's ancestors right-aligned in a [depth, node] table,
        # one gather per level (the parent of -1 is -1), then read node by node, root first
        up = np.append(parents, -1)
        table = np.empty((top, nodes.size), dtype=np.int64)
        cur = nodes
        for row in range(top - 1, -1, -1):
            table[row] = cur
            cur = up[cur]
        table = table.T
        return owner, table.ravel() if owner.size == table.size else table[np.arange(top) >= top - count[:, None]]
    end = count.cumsum()
    seg = np.empty(owner.size, dtype=np.int64)
    # walk up one level per step, writing each ancestor at its depth's slot of the path
    pos, cur = end - 1, nodes
    while cur.size:
        seg[pos] = cur
        up = parents[cur]
        keep = up >= 0
        pos, cur = pos[keep] - 1, up[keep]
    return owner, seg


class Structure:
    """What depends only on a tree's parents and query nodes, computed when first needed and
    shared by the trees built with ``reuse`` (the same tree with other token counts and slots)."""

    def __init__(self, parents: np.ndarray, query_nodes: np.ndarray):
        self.parents, self.query_nodes = parents, query_nodes

    @functools.cached_property
    def shape(self) -> _Shape:
        return _shape(self.parents)

    @functools.cached_property
    def query_paths(self) -> tuple[np.ndarray, np.ndarray]:
        return root_paths(self.parents, self.shape.depth, self.query_nodes)

    def matches(self, parents: np.ndarray, query_nodes: np.ndarray) -> bool:
        return np.array_equal(parents, self.parents) and np.array_equal(query_nodes, self.query_nodes)


def children_of(nodes: np.ndarray, indptr: np.ndarray, indices: np.ndarray) -> np.ndarray:
    starts, ends = indptr[nodes], indptr[nodes + 1]
    return indices[ranges(starts, ends)]


def slot_breaks(kv_slots: np.ndarray) -> np.ndarray:
    """int64: the entries ``i >= 1`` of a slot list whose slot does not follow the one before
    (``kv_slots[i] != kv_slots[i - 1] + 1``): where its runs of consecutive slots start (few where
    the pool's pages are in order)."""
    return (kv_slots[1:] - kv_slots[:-1] != 1).nonzero()[0] + 1


#: Mean range length from which :func:`ranges` repeats offsets instead of summing steps.
_LONG_RANGES = 4


def ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, e)`` for each pair, vectorised."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(ends, dtype=np.int64) - starts
    nonempty = counts > 0
    if not nonempty.all():
        starts, counts = starts[nonempty], counts[nonempty]
    if counts.size == 0:
        return np.zeros(0, dtype=np.int64)
    first = counts.cumsum()
    total = int(first[-1])
    if total == counts.size:
        return starts.copy()  # every range holds one value
    first -= counts
    if total >= _LONG_RANGES * counts.size:
        # few long ranges: an entry is its index plus its range's start less the entries before
        # that range (fewer numpy calls than the prefix sum below)
        return np.arange(total) + (starts - first).repeat(counts)
    # many short ones (numpy's repeat pays per range): one output-sized array of steps of 1, a
    # jump to the next start at each range's first entry, then a prefix sum
    out = np.ones(total, dtype=np.int64)
    out[0] = starts[0]
    out[first[1:]] = starts[1:] - starts[:-1] - counts[:-1] + 1
    return out.cumsum(out=out)


def _exclusive_segment_cumsum(values: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    if values.size == 0:
        return values.copy()
    c = np.cumsum(values)
    seg = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    base = np.concatenate(([0], c))[indptr[:-1]]
    return c - values - base[seg]
