"""A paged KV cache with reference-counted pages and forkable branches (vLLM-style).

A *branch* is one sequence of KV tokens stored in fixed-size pages. :meth:`KVPool.fork` makes a
child branch that shares every page of its parent (reference counts go up, nothing is copied);
:meth:`KVPool.append` reserves slots at the end of a branch, copying a shared, partially filled
last page first (copy-on-write) so siblings never overwrite each other's tokens. Full shared pages
are never copied. :meth:`KVPool.prune` releases a branch together with every branch forked from it.

Slot ``s`` is token ``s % page_size`` of page ``s // page_size``, the addressing of
:class:`treeattn.tree.decoding_tree.DecodingTree`. Page bookkeeping lives on the host in NumPy; K/V live in one
torch tensor on ``device``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from treeattn.tree import DecodingTree

__all__ = ["KVPool", "KVPoolOutOfMemory"]


class KVPoolOutOfMemory(RuntimeError):
    """Raised when an operation needs more free pages than the pool has; the pool is unchanged."""


@dataclass
class _Branch:
    pages: list[int]
    length: int
    parent: int | None
    children: set[int] = field(default_factory=set)


def _int(x, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if (lo is not None and x < lo) or (hi is not None and x >= hi):
        raise ValueError(f"{name} {x} out of range [{lo}, {'inf' if hi is None else hi})")
    return int(x)


class KVPool:
    """Paged KV cache with reference-counted pages shared between forked branches.

    Parameters
    ----------
    num_pages, page_size : int
        Pages in the pool and tokens per page; the pool has ``num_pages * page_size`` slots.
    num_kv_heads, head_dim : int
        KV heads ``Hkv`` and head dimension ``D``.
    num_layers : int, optional
        Transformer layers sharing the page bookkeeping (one K and one V cache each).
    dtype : torch.dtype, optional
        Element type of the caches (default ``torch.float16``).
    device : str or torch.device, optional
        Where the caches live (default ``"cpu"``).

    Notes
    -----
    Storage is one contiguous tensor of shape ``[num_layers, 2, num_pages, page_size, Hkv, D]``
    (index 0 of dim 1 is K, 1 is V). :meth:`k_cache` / :meth:`v_cache` return contiguous views of
    shape ``[num_pages, page_size, Hkv, D]``: page-major, then token within the page, then KV head,
    then head dim, so ``k_cache(l).view(-1, Hkv, D)[slot]`` is the key of slot ``slot``.
    Free pages are handed out lowest page id first, so allocation is deterministic.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 num_layers: int = 1, dtype: torch.dtype = torch.float16, device="cpu") -> None:
        self.num_pages = _int(num_pages, "num_pages", 1)
        self.page_size = _int(page_size, "page_size", 1)
        self.num_kv_heads = _int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = _int(head_dim, "head_dim", 1)
        self.num_layers = _int(num_layers, "num_layers", 1)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = torch.device(device)
        self._storage = torch.zeros(self.num_layers, 2, self.num_pages, self.page_size,
                                    self.num_kv_heads, self.head_dim, dtype=dtype, device=self.device)
        self._refcount = np.zeros(self.num_pages, dtype=np.int32)
        self._free: list[int] = list(range(self.num_pages))  # a min-heap of free page ids
        self._branches: dict[int, _Branch] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ storage
    @property
    def num_slots(self) -> int:
        """Slots in the pool, ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    def k_cache(self, layer: int = 0) -> torch.Tensor:
        """Key cache of ``layer``: view of shape ``[num_pages, page_size, Hkv, D]``, dtype ``dtype``."""
        return self._storage[_int(layer, 'layer', 0, self.num_layers), 0]

    def v_cache(self, layer: int = 0) -> torch.Tensor:
        """Value cache of ``layer``: view of shape ``[num_pages, page_size, Hkv, D]``, dtype ``dtype``."""
        return self._storage[_int(layer, 'layer', 0, self.num_layers), 1]

    def write(self, branch_slots, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter ``k``, ``v`` (each ``[n, Hkv, D]``, dtype ``dtype``, on ``device``) into the
        slots ``branch_slots`` (int ``[n]``, distinct, e.g. from :meth:`append`) of ``layer``.

        Slots returned by :meth:`append` lie in pages owned by that branch alone (until it is
        forked); writing a slot of a shared page changes it for every branch holding the page."""
        layer = _int(layer, "layer", 0, self.num_layers)
        slots = np.asarray(branch_slots.cpu() if torch.is_tensor(branch_slots) else branch_slots)
        if slots.dtype == bool or (slots.size and not np.issubdtype(slots.dtype, np.integer)):
            raise TypeError(f"slots must hold integers, got dtype {slots.dtype}")
        if slots.ndim != 1:
            raise ValueError(f"slots must be one-dimensional, got shape {slots.shape}")
        slots = slots.astype(np.int64)
        shape = (slots.size, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not torch.is_tensor(t):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape [n, Hkv, D] = {list(shape)}, got {list(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but the pool stores {self.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the pool is on {self.device}")
        if slots.size:
            bad = np.flatnonzero((slots < 0) | (slots >= self.num_slots))
            if bad.size:
                raise ValueError(f"slot {int(slots[bad[0]])} out of range [0, {self.num_slots})")
            if np.unique(slots).size != slots.size:
                raise ValueError("slots must be distinct")
            unowned = np.flatnonzero(self._refcount[slots // self.page_size] == 0)
            if unowned.size:
                s = int(slots[unowned[0]])
                raise ValueError(f"slot {s} lies in page {s // self.page_size}, which no branch holds")
        idx = torch.from_numpy(slots).to(self.device)
        flat = (self.num_slots, self.num_kv_heads, self.head_dim)
        self._storage[layer, 0].view(flat).index_copy_(0, idx, k)
        self._storage[layer, 1].view(flat).index_copy_(0, idx, v)

    # ------------------------------------------------------------------ branches
    def _get(self, branch) -> _Branch:
        b = self._branches.get(_int(branch, "branch id"))
        if b is None:
            raise ValueError(f"unknown branch id {branch} (never created, freed or pruned)")
        return b

    def _add_branch(self, b: _Branch) -> int:
        bid = self._next_id
        self._next_id += 1
        self._branches[bid] = b
        return bid

    def new_branch(self) -> int:
        """Create an empty root branch and return its id."""
        return self._add_branch(_Branch(pages=[], length=0, parent=None))

    def fork(self, branch: int) -> int:
        """Create a child of ``branch`` sharing all its pages (no copy) and return its id."""
        parent = self._get(branch)
        self._refcount[parent.pages] += 1
        child = self._add_branch(_Branch(pages=list(parent.pages), length=parent.length,
                                         parent=int(branch)))
        parent.children.add(child)
        return child

    def append(self, branch: int, n_tokens: int, *, high: bool = False) -> np.ndarray:
        """Reserve ``n_tokens`` slots at the end of ``branch``.

        A partially filled last page that is shared with another branch is first copied into a
        fresh page (all layers, K and V). Raises :class:`KVPoolOutOfMemory`, leaving the pool
        unchanged, when the free pages do not suffice.

        New pages are the lowest free ones, so a branch that grows alone takes consecutive pages
        and its tokens stay one run of slots (which the kernels read with affine addresses).
        ``high`` takes the highest free pages instead: for long-lived side branches (speculative
        drafts' scratch slots, a padding slot) that would otherwise sit between a growing
        sequence's pages.

        Returns
        -------
        np.ndarray
            int64 ``[n_tokens]``: the new slots, in token order, for the caller to write K/V to.
        """
        b = self._get(branch)
        n, p = _int(n_tokens, "n_tokens", 0), self.page_size
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        fill = b.length % p
        cow = fill > 0 and self._refcount[b.pages[-1]] > 1
        room = p - fill if fill else 0
        needed = int(cow) + -(-max(0, n - room) // p)
        if needed > len(self._free):
            raise KVPoolOutOfMemory(
                f"KV pool out of memory: appending {n} token(s) to branch {branch} needs {needed} "
                f"free page(s){' (one for copy-on-write)' if cow else ''} but only "
                f"{len(self._free)} of {self.num_pages} are free")
        if high:  # (rare: O(free pages))
            new = sorted(heapq.nlargest(needed, self._free))
            taken = set(new)
            self._free = [page for page in self._free if page not in taken]
            heapq.heapify(self._free)
        else:
            new = [heapq.heappop(self._free) for _ in range(needed)]
        self._refcount[new] = 1
        if cow:
            old, dst = b.pages[-1], new.pop(0)
            self._storage[:, :, dst, :fill] = self._storage[:, :, old, :fill]
            self._refcount[old] -= 1
            b.pages[-1] = dst
        b.pages.extend(new)
        pos = np.arange(b.length, b.length + n, dtype=np.int64)
        b.length += n
        return np.asarray(b.pages, dtype=np.int64)[pos // p] * p + pos % p

    def _release(self, bid: int) -> None:
        b = self._branches.pop(bid)
        if b.parent is not None and b.parent in self._branches:
            self._branches[b.parent].children.discard(bid)
        if b.pages:
            pages = np.asarray(b.pages, dtype=np.int64)
            self._refcount[pages] -= 1
            for page in pages[self._refcount[pages] == 0].tolist():
                heapq.heappush(self._free, page)

    def prune(self, branch: int) -> None:
        """Release ``branch`` and, recursively, every branch forked from it."""
        self._get(branch)
        stack, subtree = [int(branch)], []
        while stack:
            bid = stack.pop()
            subtree.append(bid)
            stack.extend(sorted(self._branches[bid].children))
        for bid in reversed(subtree):  # leaves first
            self._release(bid)

    def free(self, branch: int) -> None:
        """Release the leaf branch ``branch``; ValueError if it has live children."""
        b = self._get(branch)
        if b.children:
            raise ValueError(f"branch {branch} has live children {sorted(b.children)}; "
                             f"free them first or use prune()")
        self._release(int(branch))

    # ------------------------------------------------------------------ queries
    @property
    def branches(self) -> list[int]:
        """Live branch ids in increasing order."""
        return sorted(self._branches)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> np.ndarray:
        """int64 ``[num_free_pages]``: the free page ids, sorted."""
        return np.asarray(sorted(self._free), dtype=np.int64)

    @property
    def refcounts(self) -> np.ndarray:
        """int32 ``[num_pages]``: a copy of the number of branches holding each page."""
        return self._refcount.copy()

    def parent(self, branch: int) -> int | None:
        """The branch ``branch`` was forked from, or None for a root branch."""
        return self._get(branch).parent

    def children(self, branch: int) -> list[int]:
        """Live branches forked directly from ``branch``, in increasing id order."""
        return sorted(self._get(branch).children)

    def block_table(self, branch: int) -> np.ndarray:
        """int64 ``[ceil(length / page_size)]``: the page ids of ``branch`` in order."""
        return np.asarray(self._get(branch).pages, dtype=np.int64)

    def length(self, branch: int) -> int:
        """Tokens in ``branch``."""
        return self._get(branch).length

    def slots(self, branch: int) -> np.ndarray:
        """int64 ``[length]``: the slot of every token of ``branch``, in order."""
        b = self._get(branch)
        pos = np.arange(b.length, dtype=np.int64)
        return np.asarray(b.pages, dtype=np.int64)[pos // self.page_size] * self.page_size \
            + pos % self.page_size

    def check(self) -> None:
        """Verify the bookkeeping; raise RuntimeError describing the first inconsistency."""
        ref = np.zeros(self.num_pages, dtype=np.int64)
        for bid, b in sorted(self._branches.items()):
            if len(b.pages) != -(-b.length // self.page_size):
                raise RuntimeError(f"branch {bid} has {b.length} tokens but {len(b.pages)} pages")
            if len(set(b.pages)) != len(b.pages):
                raise RuntimeError(f"branch {bid} holds a page twice: {b.pages}")
            up = self._branches.get(b.parent) if b.parent is not None else None
            if b.parent is not None and (up is None or bid not in up.children):
                raise RuntimeError(f"branch {bid} is not among the children of its parent {b.parent}")
            if any(c not in self._branches for c in b.children):
                raise RuntimeError(f"branch {bid} lists released children {sorted(b.children)}")
            np.add.at(ref, np.asarray(b.pages, dtype=np.int64), 1)
        bad = np.flatnonzero(ref != self._refcount)
        if bad.size:
            pg = int(bad[0])
            raise RuntimeError(f"page {pg} has refcount {int(self._refcount[pg])} but "
                               f"{int(ref[pg])} live branches hold it")
        if len(set(self._free)) != len(self._free):
            raise RuntimeError("the free list holds a page twice")
        if sorted(self._free) != np.flatnonzero(ref == 0).tolist():
            raise RuntimeError("the free list differs from the pages with refcount 0")

    def tree(self, branches=None) -> DecodingTree:
        """A :class:`DecodingTree` with one query per branch, sharing common leading pages.

        Parameters
        ----------
        branches : sequence of int, optional
            Live branch ids, each non-empty; default: the leaf branches (no live children) in
            increasing id order. Query ``j`` sees exactly the tokens of ``branches[j]``.
        """
        from treeattn.tree.builders import tree_from_block_tables

        if branches is None:
            branches = [bid for bid in self.branches if not self._branches[bid].children]
        ids = list(branches)
        if not ids:
            raise ValueError("tree() needs at least one branch")
        for bid in ids:
            if self._get(bid).length == 0:
                raise ValueError(f"branch {bid} is empty; a query must see at least one token")
        return tree_from_block_tables([self.block_table(b) for b in ids],
                                      [self.length(b) for b in ids],
                                      page_size=self.page_size, num_pages=self.num_pages)
