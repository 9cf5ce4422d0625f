"""Sequence tree manager (DeFT App. A.1): the topology of the decoding tree, its tree operations
(branch, prune, finish) and the branch result storage.

Every node holds a run of tokens; a node's full sequence is the tokens of its root-to-node path.
Only leaves grow: branching freezes a node and gives it children, pruning removes a subtree and
then every frozen ancestor left without children. KV operations go to the
:class:`~treeattn.engine.node_slots.KVCacheManager`. Tokens sampled on the device are recorded without
synchronising and copied to the host only when someone reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from treeattn import DecodingTree
from treeattn.engine.node_slots import KVCacheManager

__all__ = ["SequenceTree", "Result"]


@dataclass
class _Node:
    parent: int | None
    prefix: int                      # tokens on the path before this node
    tokens: list = field(default_factory=list)   # ints or (chunk, row) references into the token log
    children: list = field(default_factory=list)
    frozen: bool = False             # branched: never grows again
    done: bool = False               # finished: no longer decoded
    meta: dict = field(default_factory=dict)


@dataclass
class Result:
    """A finished sequence in the branch result storage.

    Attributes
    ----------
    node : int
    tokens : list of int
        The whole root-to-node sequence.
    info : dict
        What the controller recorded (score, last logits, ...).
    """

    node: int
    tokens: list
    info: dict


class _TokenLog:
    """Token ids produced on the device, fetched to the host in one copy when first read (or
    once ``MAX_PENDING`` steps are waiting, so a long-running server holds no device tensors)."""

    MAX_PENDING = 1024

    def __init__(self):
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._host: dict[int, list] = {}
        self._next = 0

    def add(self, t: torch.Tensor) -> int:
        cid = self._next
        self._next += 1
        self._pending.append((cid, t.reshape(-1)))
        if len(self._pending) >= self.MAX_PENDING:
            self._fetch()
        return cid

    def get(self, cid: int, row: int) -> int:
        if cid not in self._host:
            self._fetch()
        return self._host[cid][row]

    def _fetch(self) -> None:
        if self._pending:
            dev = self._pending[0][1].device
            flat = torch.cat([t.to(dev, torch.int64) for _, t in self._pending]).tolist()
            at = 0
            for c, t in self._pending:
                self._host[c] = flat[at: at + t.numel()]
                at += t.numel()
            self._pending.clear()


class SequenceTree:
    """Topology, tokens and results of a decoding tree (or forest) over a KV cache manager.

    Parameters
    ----------
    kv : KVCacheManager
    """

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self._nodes: dict[int, _Node] = {}
        self._next = 0
        self._log = _TokenLog()
        self.results: list = []
        self._last_tree: DecodingTree | None = None  # shares its structure with the next one
        self._chain_slots: dict[tuple, np.ndarray] = {}     # merged chains' slots (decoding_tree)
        self._paths: dict[int, np.ndarray] = {}             # queried nodes' root paths (decoding_tree)

    # ------------------------------------------------------------------ topology
    def _get(self, node: int) -> _Node:
        nd = self._nodes.get(node)
        if nd is None:
            raise ValueError(f"unknown node {node} (never created or already pruned)")
        return nd

    def _new(self, parent: int | None, prefix: int, meta) -> int:
        nid = self._next
        self._next += 1
        self._nodes[nid] = _Node(parent=parent, prefix=prefix, meta=dict(meta or {}))
        return nid

    def add_root(self, meta: dict | None = None) -> int:
        """A new empty root (a new sequence); returns its node id."""
        nid = self._new(None, 0, meta)
        self.kv.new_root(nid)
        return nid

    def branch(self, node: int, k: int, metas=None) -> list:
        """Freeze leaf ``node`` and give it ``k`` children sharing its KV; returns their ids."""
        if self._get(node).children:
            raise ValueError(f"node {node} has already branched")
        return self.add_children(node, k, metas)

    def add_children(self, node: int, k: int = 1, metas=None) -> list:
        """Freeze ``node`` and give it ``k`` more children sharing its KV, whether or not it has
        children already (a prefix cache hangs new requests below a cached prompt); returns their
        ids."""
        nd = self._get(node)
        if k < 1:
            raise ValueError(f"branch needs k >= 1 children, got {k}")
        nd.frozen = True
        # a frozen node is seldom queried again: its cached path moves to its children
        up = self._paths.pop(node, None)
        kids = []
        for i in range(k):
            cid = self._new(node, self.path_len(node), metas[i] if metas else None)
            self.kv.fork(node, cid)
            kids.append(cid)
            if up is not None:
                self._paths[cid] = np.concatenate(([cid], up))
        nd.children.extend(kids)
        return kids

    def prune(self, node: int, *, cascade: bool = True) -> None:
        """Remove ``node``'s subtree and free its KV, then (``cascade``) every frozen ancestor left
        childless; without ``cascade`` the ancestors stay (a prefix cache keeps them)."""
        up = self._get(node).parent
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(self._nodes[n].children)
        for n in reversed(order):
            self._remove(n)
        while cascade and up is not None and self._nodes[up].frozen and not self._nodes[up].children:
            nxt = self._nodes[up].parent
            self._remove(up)
            up = nxt

    def _remove(self, node: int) -> None:
        nd = self._nodes[node]
        if nd.parent is not None and nd.parent in self._nodes:
            self._nodes[nd.parent].children.remove(node)
        self.kv.remove(node)
        del self._nodes[node]
        self._paths.pop(node, None)

    def finish(self, node: int, **info) -> Result:
        """Mark ``node`` finished (no longer decoded, KV kept until pruned) and store its result."""
        nd = self._get(node)
        nd.done = True
        res = Result(node=node, tokens=self._path_refs(node), info=info)
        self.results.append(res)
        return res

    def clear(self) -> None:
        """Prune every root (frees all KV the tree holds)."""
        for r in [n for n, nd in self._nodes.items() if nd.parent is None]:
            if r in self._nodes:
                self.prune(r)

    # ------------------------------------------------------------------ tokens
    def extend(self, node: int, tokens) -> tuple[np.ndarray, np.ndarray]:
        """Append host token ids to leaf ``node``; returns their ``(slots, positions)`` (int64)."""
        tokens = [int(t) for t in tokens]
        nd = self._check_growable(node)
        pos = np.arange(self.path_len(node), self.path_len(node) + len(tokens), dtype=np.int64)
        slots = self.kv.append(node, len(tokens))
        nd.tokens.extend(tokens)
        return slots, pos

    def append_one(self, nodes, tokens: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """One token (``tokens [n]``, any device, not read now) for each leaf of ``nodes``; returns
        ``(slots, positions)`` int64 ``[n]``."""
        cid = self._log.add(tokens)
        slots = np.empty(len(nodes), dtype=np.int64)
        pos = np.empty(len(nodes), dtype=np.int64)
        for i, node in enumerate(nodes):
            nd = self._check_growable(node)
            pos[i] = nd.prefix + len(nd.tokens)
            slots[i] = self.kv.append(node, 1)[0]
            nd.tokens.append((cid, i))
        return slots, pos

    def append_run(self, node: int, tokens: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Append ``tokens [m]`` (any device, not read now) to leaf ``node``; returns
        ``(slots, positions)`` int64 ``[m]``."""
        nd = self._check_growable(node)
        m = int(tokens.numel())
        pos = np.arange(self.path_len(node), self.path_len(node) + m, dtype=np.int64)
        slots = self.kv.append(node, m)
        cid = self._log.add(tokens)
        nd.tokens.extend((cid, i) for i in range(m))
        return slots, pos

    def _check_growable(self, node: int) -> _Node:
        nd = self._get(node)
        if nd.frozen:
            raise ValueError(f"node {node} has branched; only leaves grow")
        return nd

    def _resolve(self, t) -> int:
        return t if isinstance(t, int) else self._log.get(*t)

    def _path_refs(self, node: int) -> list:
        chain = []
        while node is not None:
            chain.append(self._nodes[node].tokens)
            node = self._nodes[node].parent
        return [t for toks in reversed(chain) for t in toks]

    def tokens(self, node: int) -> list:
        """All token ids of ``node``'s sequence (root to node); copies device tokens to the host."""
        self._get(node)
        return [self._resolve(t) for t in self._path_refs(node)]

    def result_tokens(self, res: Result) -> list:
        """Token ids of a stored result."""
        return [self._resolve(t) for t in res.tokens]

    # ------------------------------------------------------------------ queries
    def __contains__(self, node) -> bool:
        return node in self._nodes

    def parent(self, node: int) -> int | None:
        return self._get(node).parent

    def children(self, node: int) -> list:
        return list(self._get(node).children)

    def meta(self, node: int) -> dict:
        """The controller's mutable per-node dict."""
        return self._get(node).meta

    def is_done(self, node: int) -> bool:
        return self._get(node).done

    def own_len(self, node: int) -> int:
        return len(self._get(node).tokens)

    def path_len(self, node: int) -> int:
        nd = self._get(node)
        return nd.prefix + len(nd.tokens)

    def active(self) -> list:
        """Leaves that are not finished, in creation order: the sequences decoded next."""
        return [n for n, nd in self._nodes.items() if not nd.children and not nd.done and not nd.frozen]

    def leaves(self) -> list:
        """Every leaf, finished or not, in creation order."""
        return [n for n, nd in self._nodes.items() if not nd.children]

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def path_slots(self, node: int) -> np.ndarray:
        """int64 ``[path_len]``: cache slots of the whole sequence of ``node``."""
        chain = []
        while node is not None:
            chain.append(self.kv.own_slots(node))
            node = self._nodes[node].parent
        return np.concatenate(chain[::-1]) if chain else np.zeros(0, dtype=np.int64)

    def _path(self, node: int) -> np.ndarray:
        """int64 ``[depth]``: ``node`` and its ancestors, bottom-up. Cached for the nodes queried,
        as a live node's ancestors never change; a node that branches hands its entry to its
        children, so the cache holds about one path per leaf however deep the tree grows."""
        path = self._paths.get(node)
        if path is None:
            up = [node]
            while (p := self._get(up[-1]).parent) is not None:
                up.append(p)
            path = self._paths[node] = np.array(up, dtype=np.int64)
        return path

    def decoding_tree(self, query_nodes, *, extra=None, drafts=None) -> DecodingTree:
        """The :class:`~treeattn.DecodingTree` that ``query_nodes`` see.

        Parameters
        ----------
        query_nodes : sequence of int
            One query per node, seeing its whole path (own tokens plus ``extra[node]``).
        extra : dict node -> int64 array, optional
            Slots appended to a node's own tokens (reserved decode-window slots).
        drafts : tuple ``(anchor, parents, slots)``, optional
            Draft tokens (speculative verification), one node and one query each, after the
            ``query_nodes`` queries: draft ``i`` hangs under draft ``parents[i]`` or, for ``-1``,
            under node ``anchor``.
        """
        if not len(query_nodes):
            raise ValueError("decoding_tree needs at least one query node")
        extra = extra or {}
        # Every query's root path, concatenated: a node's first occurrence there is where the
        # walk up from the queries first reaches it, so the first occurrences in order are the
        # tree's nodes (numpy over ~1e3 path entries instead of a Python walk over each node)
        paths = [self._path(q) for q in query_nodes]
        walk = np.concatenate(paths)
        is_root = np.zeros(walk.size, dtype=bool)
        is_root[np.cumsum([p.size for p in paths]) - 1] = True
        ids, first = np.unique(walk, return_index=True)
        at = np.sort(first)                  # walk positions of the nodes, in order
        order = walk[at]
        rank = np.empty(ids.size, dtype=np.int64)   # ids[k] is order[rank[k]]
        rank[np.argsort(first)] = np.arange(ids.size)

        def where(n) -> np.ndarray:          # order positions of nodes on the queries' paths
            return rank[np.searchsorted(ids, n)]

        # each node's parent (the next entry of its path) as an order position, -1 at a root
        up = np.where(is_root[at], -1, where(walk[np.minimum(at + 1, walk.size - 1)]))
        has_up = up >= 0
        pu = np.where(has_up, up, 0)
        keep = np.zeros(order.size, dtype=bool)
        keep[where(query_nodes)] = True
        if drafts is not None:
            k = int(np.searchsorted(ids, drafts[0]))
            if k == ids.size or ids[k] != drafts[0]:
                raise ValueError(f"draft anchor {drafts[0]} is not on the path of a query node")
            keep[rank[k]] = True
        # Merge the chains of single-child nodes that hold no query (a prompt cached in blocks is
        # one node a block) into one node each: a node whose parent has it as its only child and
        # neither is kept goes into its parent. A chain is consecutive in ``order`` (each of its
        # nodes is first reached from its one child), so an absorbed node's chain top is the
        # next node left.
        # Its tokens follow its parent's, so every query sees the same tokens in the same order;
        # a query's node keeps its own tokens only (what ``extra`` and the decode windows'
        # prefixes count). Fewer, longer nodes make cheaper plans and longer work items.
        kids = np.bincount(up[has_up], minlength=order.size)
        absorbed = has_up & (kids[pu] == 1) & ~keep[pu] & ~keep
        left = np.flatnonzero(~absorbed)
        index = np.searchsorted(left, np.arange(order.size))   # order position -> node after merging
        parents = np.where(has_up[left], index[pu[left]], -1)
        # a chain's slots are fixed while it exists (its nodes have children, so they no longer
        # grow): kept from the call before, where a serving batch's cached prompts recur
        cache, self._chain_slots = self._chain_slots, {}
        chunks, lengths = [], []             # (a node's extra slots: a chunk of their own)
        order, lo = order.tolist(), 0
        for j in left.tolist():
            n = order[j]
            if j > lo:                       # order[lo:j] merge into n: its chain, top-down
                key = tuple(order[lo:j + 1][::-1])
                c = cache.get(key)
                if c is None:
                    c = np.concatenate([self.kv.own_slots(m) for m in key])
                self._chain_slots[key] = c
            else:
                c = self.kv.own_slots(n)
            chunks.append(c)
            e = extra.get(n)
            if e is None:
                lengths.append(c.size)
            else:
                chunks.append(e)
                lengths.append(c.size + e.size)
            lo = j + 1
        qn = index[where(query_nodes)]
        if drafts is not None:
            anchor, dpar, dslots = drafts
            base = left.size
            dpar = np.asarray(dpar, dtype=np.int64)
            parents = np.concatenate((parents, np.where(dpar < 0, index[where(anchor)], base + dpar)))
            lengths = np.concatenate((lengths, np.ones(dpar.size, dtype=np.int64)))
            chunks.append(np.asarray(dslots, dtype=np.int64))
            qn = np.concatenate((qn, np.arange(base, base + dpar.size)))
        lengths = np.asarray(lengths, dtype=np.int64)
        indptr = np.zeros(lengths.size + 1, dtype=np.int64)
        lengths.cumsum(out=indptr[1:])
        # every array is a fresh int64 one made here: the constructor takes them as they are
        # (from_parents would copy the ~1e5 slots once more)
        self._last_tree = DecodingTree(
            parents, lengths, indptr, np.concatenate(chunks), qn, lengths[qn],
            self.kv.pool.page_size, self.kv.pool.num_slots, self._last_tree)
        return self._last_tree
