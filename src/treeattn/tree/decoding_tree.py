"""Decoding trees and forests over a (paged) KV cache.

A :class:`DecodingTree` is the host-side description of one decode step of tree-structured
decoding: which KV tokens exist, how they are shared, and which queries see which tokens.

* Node ``i`` has a parent ``parents[i]`` (``-1`` for a root; several roots make a forest), a token
  count ``lengths[i] >= 0`` and the KV-cache slot of each of its tokens
  (``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``; slot ``s`` is token ``s % page_size`` of page
  ``s // page_size`` of the pool).
* Query ``j`` sits in node ``query_nodes[j]`` and sees every token of every proper ancestor of that
  node plus the first ``query_prefix[j]`` tokens of the node itself. Parallel decoding puts one query
  at each leaf with the whole leaf visible; speculative token trees put a query at every token of
  a draft tree (a prefix of its own node).

Everything here is NumPy (int64) on the host; planners turn a tree into device tensors.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import InitVar, dataclass

import numpy as np

from treeattn.tree.topology import (
    Structure,
    Topology,
    ancestor_table,
    build_topology,
    ranges,
    root_paths,
    slot_breaks,
)

__all__ = ["DecodingTree", "Topology"]


def _as_index_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == bool or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    return arr.astype(np.int64, copy=True)


@dataclass(frozen=True, eq=False)
class DecodingTree:
    """A decoding tree or forest over a KV cache; see the module docstring. Its arrays are
    read-only (a tree is one step's snapshot: make the next with :meth:`append` or anew).

    Attributes
    ----------
    parents : int64 [N]
        Parent of each node, ``-1`` for roots. Parents need not precede children.
    lengths : int64 [N]
        Tokens held by each node (``>= 0``).
    kv_indptr, kv_indices : int64 [N + 1], [sum(lengths)]
        KV-cache slot of every token of every node (CSR by node id).
    query_nodes, query_prefix : int64 [Q]
        The node of each query and how many of that node's own tokens it sees.
    page_size : int
        Tokens per page of the pool that ``kv_indices`` address.
    num_slots : int or None
        Slots in the pool (``num_pages * page_size``); when given, slots are range-checked.
    reuse : DecodingTree, optional (constructor only)
        A tree that may have the same parents and query nodes (a decode loop's previous step);
        when it does, the structure derived from them is shared instead of recomputed.
    """

    parents: np.ndarray
    lengths: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    query_nodes: np.ndarray
    query_prefix: np.ndarray
    page_size: int = 1
    num_slots: int | None = None
    reuse: InitVar[DecodingTree | None] = None

    def __post_init__(self, reuse: DecodingTree | None) -> None:
        # read-only: the structure shared with ``reuse`` and what :meth:`append` remembers stay true
        for name in ("parents", "lengths", "kv_indptr", "kv_indices", "query_nodes", "query_prefix"):
            getattr(self, name).flags.writeable = False
        known = reuse is not None and reuse._structure.matches(self.parents, self.query_nodes)
        # frozen dataclass: cached values go straight into the instance dict
        self.__dict__["_structure"] = reuse._structure if known else Structure(self.parents, self.query_nodes)
        self._validate(check_parents=not known)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_parents(cls, parents, lengths, *, query_nodes=None, query_prefix=None,
                     kv_indptr=None, kv_indices=None, page_size: int = 1,
                     num_slots: int | None = None, reuse: DecodingTree | None = None) -> "DecodingTree":
        """Build a tree from parent links and token counts.

        Without ``kv_indices``, node ``i``'s tokens are the contiguous slots
        ``[sum(lengths[:i]), sum(lengths[:i + 1]))``: the layout of :func:`treeattn.tree_attention`.
        Without ``query_nodes``, there is one query per leaf, leaves in increasing id order.
        Without ``query_prefix``, each query sees all of its own node. ``reuse``: see the class.
        """
        parents = _as_index_array(parents, "parents")
        lengths = _as_index_array(lengths, "lengths")
        if parents.size != lengths.size:
            raise ValueError(f"parents has {parents.size} nodes but lengths has {lengths.size}")
        if kv_indices is None:
            if kv_indptr is not None:
                raise ValueError("kv_indptr given without kv_indices")
            kv_indptr = np.concatenate(([0], np.cumsum(np.maximum(lengths, 0))))
            kv_indices = np.arange(kv_indptr[-1], dtype=np.int64)
        else:
            kv_indices = _as_index_array(kv_indices, "kv_indices")
            if kv_indptr is None:
                kv_indptr = np.concatenate(([0], np.cumsum(np.maximum(lengths, 0))))
            kv_indptr = _as_index_array(kv_indptr, "kv_indptr")
        if query_nodes is None:
            has_child = np.zeros(parents.size, dtype=bool)
            valid_parent = parents[(parents >= 0) & (parents < parents.size)]
            has_child[valid_parent] = True
            query_nodes = np.flatnonzero(~has_child)
        query_nodes = _as_index_array(query_nodes, "query_nodes")
        if query_prefix is None:
            ok = (query_nodes >= 0) & (query_nodes < lengths.size)
            query_prefix = np.where(ok, lengths[np.clip(query_nodes, 0, max(lengths.size - 1, 0))]
                                    if lengths.size else 0, 0)
        query_prefix = _as_index_array(query_prefix, "query_prefix")
        return cls(parents, lengths, kv_indptr, kv_indices, query_nodes, query_prefix,
                   int(page_size), num_slots, reuse)

    def with_queries(self, query_nodes, query_prefix=None) -> "DecodingTree":
        """The same KV tree with other queries."""
        return DecodingTree.from_parents(
            self.parents, self.lengths, query_nodes=query_nodes, query_prefix=query_prefix,
            kv_indptr=self.kv_indptr, kv_indices=self.kv_indices, page_size=self.page_size,
            num_slots=self.num_slots)

    def append(self, counts, slots) -> "DecodingTree":
        """This tree after a decode step: node ``n`` gains ``counts[n]`` tokens at its end.

        Parameters
        ----------
        counts : int [N]
            Tokens appended to each node (``>= 0``; one per leaf in parallel decoding).
        slots : int [sum(counts)]
            Their KV-cache slots, node after node in node order.

        Queries that saw their whole node see it whole again; the others keep their prefix. The
        new tree shares this one's structure and remembers what was appended to it, so
        :meth:`treeattn.TreeAttention.update` patches a plan of this tree for it without
        comparing the two trees (:meth:`appended_to`).
        """
        counts = _as_index_array(counts, "counts")
        slots = _as_index_array(slots, "slots")
        if counts.size != self.num_nodes:
            raise ValueError(f"counts has {counts.size} entries but the tree has {self.num_nodes} nodes")
        if counts.size and counts.min() < 0:
            raise ValueError(f"counts must be >= 0, got {int(counts.min())} for node {int(counts.argmin())}")
        if slots.size != int(counts.sum()):
            raise ValueError(f"slots has {slots.size} entries but counts appends {int(counts.sum())} tokens")
        lengths = self.lengths + counts
        indptr = np.zeros(lengths.size + 1, dtype=np.int64)
        lengths.cumsum(out=indptr[1:])
        # the appended tokens of node n end where it ends: entries indptr[n + 1] - counts[n] + j
        grown = np.flatnonzero(counts)
        c = counts[grown]
        new_at = np.arange(slots.size) + (indptr[grown + 1] - c - (c.cumsum() - c)).repeat(c)
        old = np.ones(indptr[-1], dtype=bool)
        old[new_at] = False
        kv = np.empty(indptr[-1], dtype=np.int64)
        kv[old] = self.kv_indices
        kv[new_at] = slots
        qn = self.query_nodes
        prefix = np.where(self.query_prefix == self.lengths[qn], lengths[qn], self.query_prefix)
        tree = DecodingTree(self.parents, lengths, indptr, kv, qn, prefix, self.page_size, self.num_slots, self)
        # a weak reference: a decode loop's trees must not keep every earlier step's alive
        tree.__dict__["_appended"] = (weakref.ref(self), counts)
        return tree

    def appended_to(self, base: "DecodingTree") -> np.ndarray | None:
        """int64 [N]: the tokens :meth:`append` appended to each node of ``base`` to make this
        tree, or None when this tree was not made so from ``base``."""
        made = self.__dict__.get("_appended")
        return made[1] if made is not None and made[0]() is base else None

    # ------------------------------------------------------------------ properties
    @functools.cached_property  # (cached: planners read the counts dozens of times a plan)
    def num_nodes(self) -> int:
        return int(self.parents.size)

    @functools.cached_property
    def num_queries(self) -> int:
        return int(self.query_nodes.size)

    @functools.cached_property
    def num_tokens(self) -> int:
        """Unique KV tokens in the tree."""
        return int(self.lengths.sum())

    @functools.cached_property
    def topology(self) -> Topology:
        return build_topology(self._structure.shape, self.lengths)

    @functools.cached_property
    def visible_tokens(self) -> np.ndarray:
        """int64 [Q]: KV tokens each query sees."""
        return self.topology.path_tokens[self.query_nodes] + self.query_prefix

    @functools.cached_property
    def effective_queries(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(node, prefix)`` [Q]: each query moved up to the deepest node of which it sees
        at least one token (a query at ``u`` with prefix 0 sees what one at ``parent(u)`` with the
        whole parent visible sees), so ``prefix >= 1``."""
        if self.query_prefix.all():  # (read-only arrays: shared, not copied)
            return self.query_nodes, self.query_prefix
        node, prefix = self.query_nodes.copy(), self.query_prefix.copy()
        todo = np.flatnonzero(prefix == 0)
        while todo.size:
            node[todo] = self.parents[node[todo]]
            prefix[todo] = self.lengths[node[todo]]
            todo = todo[prefix[todo] == 0]
        return node, prefix

    @functools.cached_property
    def effective_paths(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``(query, node)``: :meth:`paths` of the effective query nodes (zero-length
        nodes included)."""
        if self.query_prefix.all():  # every query is its own effective query
            return self._structure.query_paths
        return self.paths(self.effective_queries[0])

    @functools.cached_property
    def effective_visible(self) -> np.ndarray:
        """int64: tokens of each node of :attr:`effective_paths` that its query sees (0 for
        zero-length nodes)."""
        eff_node, eff_prefix = self.effective_queries
        owner, node = self.effective_paths
        if np.array_equal(eff_prefix, self.lengths[eff_node]):  # (every query sees its node whole)
            return self.lengths[node]
        return np.where(node == eff_node[owner], eff_prefix[owner], self.lengths[node])

    @functools.cached_property
    def visible_pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 ``(query, node, visible)``: every (query, node) pair where the query sees
        ``visible >= 1`` leading tokens of the node; by query, then root first along its path."""
        owner, node = self.effective_paths
        visible = self.effective_visible
        keep = visible > 0
        if keep.all():
            return owner, node, visible
        return owner[keep], node[keep], visible[keep]

    @functools.cached_property
    def pairs_by_node(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """int64 ``(query, node, next, visible)``: the pairs of :attr:`effective_paths` with
        :attr:`effective_visible`, grouped by node (queries in increasing order within a node);
        ``next`` is the node after ``node`` on the query's path, ``-1`` at its end."""
        eff_node, eff_prefix = self.effective_queries
        topo = self.topology
        q_tin = topo.tin[eff_node]
        if (q_tin[1:] < q_tin[:-1]).any():
            return self._pairs_sorted_by_node()
        # the queries are in pre-order of their effective nodes (leaves numbered in order, say):
        # a node's pairs are those of a range of query ids, its own queries first, then those
        # below each child in turn (children in id order are in pre-order), so all four arrays
        # are runs, made without a sort or a gather per pair
        lo, hi, own = self.queries_below
        below = hi - lo
        ids = np.arange(self.num_nodes)
        kids = topo.child_indices
        # each node's runs of ``next``: -1 for its own queries, then each child for those below it
        first = ids + topo.child_indptr[:-1]
        kid_at = self.parents[kids] + 1 + np.arange(kids.size)
        run_next = np.empty(first.size + kids.size, dtype=np.int64)
        run_len = np.empty_like(run_next)
        run_next[first], run_len[first] = -1, own
        run_next[kid_at], run_len[kid_at] = kids, below[kids]
        visible = self.lengths.repeat(below)
        if not np.array_equal(eff_prefix, self.lengths[eff_node]):  # (else queries see their nodes whole)
            start = below.cumsum() - below
            visible[ranges(start, start + own)] = eff_prefix[ranges(lo, lo + own)]
        return ranges(lo, hi), ids.repeat(below), run_next.repeat(run_len), visible

    def _pairs_sorted_by_node(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:attr:`pairs_by_node` of any tree: :attr:`effective_paths` sorted by node."""
        owner, node = self.effective_paths
        nxt = np.empty_like(node)
        nxt[:-1] = node[1:]
        nxt[-1] = -1
        nxt[np.flatnonzero(owner[1:] != owner[:-1])] = -1
        # numpy's stable sort of 16-bit keys is a (fast) radix sort
        order = np.argsort(node.astype(np.uint16) if self.num_nodes <= 1 << 16 else node, kind="stable")
        return owner[order], node[order], nxt[order], self.effective_visible[order]

    @functools.cached_property
    def node_extent(self) -> np.ndarray:
        """int64 [N]: leading tokens of each node that some query sees (the rest is never read)."""
        # a node is read whole when some query's effective node lies strictly below it, else up
        # to the longest prefix of the queries whose effective node it is (fewer than the pairs)
        node, prefix = self.effective_queries
        extent = np.where(self.subtree_queries > self.queries_below[2], self.lengths, 0)
        np.maximum.at(extent, node, prefix)
        return extent

    @functools.cached_property
    def subtree_queries(self) -> np.ndarray:
        """int64 [N]: queries whose visible KV ends in each node's subtree."""
        return self.queries_below[1] - self.queries_below[0]

    @functools.cached_property
    def queries_below(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 [N] ``(lo, hi, own)``: the queries whose effective node lies in each node's
        subtree are those at ``[lo, hi)`` of the queries in (stable) pre-order of their effective
        nodes, the first ``own`` of them at the node itself."""
        topo = self.topology
        at = np.bincount(topo.tin[self.effective_queries[0]], minlength=self.num_nodes)
        csum = np.zeros(at.size + 1, dtype=np.int64)
        at.cumsum(out=csum[1:])
        return csum[topo.tin], csum[topo.tout], at[topo.tin]

    @functools.cached_property
    def slot_breaks(self) -> np.ndarray:
        """int64: the positions ``i >= 1`` of :attr:`kv_indices` whose slot does not follow the
        one before (``kv_indices[i] != kv_indices[i - 1] + 1``): where the tree's runs of
        consecutive slots start (none where its tokens lie in order in the pool)."""
        return slot_breaks(self.kv_indices)

    @functools.cached_property
    def derived(self) -> dict:
        """Values that planners derive from the tree alone, by name (a tree does not change, so
        ``auto``'s planners share them)."""
        return {}

    def paths(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Root-to-node paths: int64 ``(owner, node)`` listing, for each entry ``k`` of ``nodes``,
        its ancestors root first and then itself (``owner`` = ``k``)."""
        return root_paths(self.parents, self.topology.depth, nodes)

    def sees(self, nodes: np.ndarray, queries: np.ndarray) -> np.ndarray:
        """Tokens of ``nodes`` visible to ``queries`` (element-wise, int64)."""
        topo = self.topology
        qn = self.query_nodes[queries]
        anc = (topo.tin[nodes] <= topo.tin[qn]) & (topo.tin[qn] < topo.tout[nodes])
        own = nodes == qn
        return np.where(own, self.query_prefix[queries], np.where(anc, self.lengths[nodes], 0))

    # ------------------------------------------------------------------ validation
    def _validate(self, check_parents: bool = True) -> None:
        p, ln = self.parents, self.lengths
        n = p.size
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if n == 0:
            raise ValueError("malformed tree: it has no nodes")
        if check_parents:  # (else they are those of a tree that passed)
            bad = np.flatnonzero((p < -1) | (p >= n))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"malformed tree: parent of node {i} is {int(p[i])}, out of range [-1, {n})")
            self_loop = np.flatnonzero(p == np.arange(n))
            if self_loop.size:
                raise ValueError(f"malformed tree: node {int(self_loop[0])} is its own parent (a cycle)")
        neg = np.flatnonzero(ln < 0)
        if neg.size:
            i = int(neg[0])
            raise ValueError(f"malformed tree: node {i} has negative length {int(ln[i])}")
        if check_parents:
            ancestor_table(p)
        if self.kv_indptr.size != n + 1 or self.kv_indptr[0] != 0 or np.any(np.diff(self.kv_indptr) != ln):
            raise ValueError("kv_indptr must be [0, cumsum(lengths)] (one KV slot per token of each node)")
        if self.kv_indices.size != self.kv_indptr[-1]:
            raise ValueError(f"kv_indices has {self.kv_indices.size} slots but the nodes hold "
                             f"{int(self.kv_indptr[-1])} tokens")
        if self.kv_indices.size:
            lo, hi = int(self.kv_indices.min()), int(self.kv_indices.max())
            limit = self.num_slots
            if lo < 0 or (limit is not None and hi >= limit):
                idx = int(np.flatnonzero((self.kv_indices < 0) | (self.kv_indices >= (limit or 1 << 62)))[0])
                node = int(np.searchsorted(self.kv_indptr, idx, side="right") - 1)
                page = int(self.kv_indices[idx]) // self.page_size
                raise ValueError(f"page out of range: node {node} uses page {page} (slot "
                                 f"{int(self.kv_indices[idx])}) but the pool has "
                                 f"{(limit or 0) // self.page_size} pages")
        qn, qp = self.query_nodes, self.query_prefix
        if qn.size != qp.size:
            raise ValueError(f"query_nodes has {qn.size} queries but query_prefix has {qp.size}")
        if qn.size == 0:
            raise ValueError("the tree has no queries")
        badq = np.flatnonzero((qn < 0) | (qn >= n))
        if badq.size:
            j = int(badq[0])
            raise ValueError(f"query {j} is at node {int(qn[j])}, out of range [0, {n})")
        badp = np.flatnonzero((qp < 0) | (qp > ln[qn]))
        if badp.size:
            j = int(badp[0])
            raise ValueError(f"query {j} sees prefix {int(qp[j])} of node {int(qn[j])}, which "
                             f"holds {int(ln[qn[j]])} tokens")
        empty = np.flatnonzero(self.visible_tokens == 0)
        if empty.size:
            j = int(empty[0])
            raise ValueError(f"query {j} (node {int(qn[j])}) sees no KV token")

    def __repr__(self) -> str:
        roots = int((self.parents < 0).sum())
        return (f"DecodingTree(nodes={self.num_nodes}, roots={roots}, tokens={self.num_tokens}, "
                f"queries={self.num_queries}, page_size={self.page_size})")
