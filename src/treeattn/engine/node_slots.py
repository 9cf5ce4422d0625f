"""KV cache manager (DeFT App. A.1): maps decoding-tree nodes to branches of the paged
:class:`treeattn.KVPool` and records the cache slot of every token each node owns.

A node's pool branch is forked from its parent's (shared pages, no copy); the node's own tokens are
the slots returned by its appends. Slots can also be *reserved* ahead of time (a decode window of
several steps planned at once); reserved slots become the node's tokens as they are written, and
unused ones are dropped (they stay allocated in the branch until it is freed).
"""
from __future__ import annotations

import numpy as np
import torch

from treeattn import KVPool
from treeattn.engine import fused

__all__ = ["KVCacheManager"]


class _Slots:
    """A growable int64 array."""

    __slots__ = ("buf", "n")

    def __init__(self):
        self.buf = np.empty(16, dtype=np.int64)
        self.n = 0

    def extend(self, values: np.ndarray) -> None:
        need = self.n + values.size
        if need > self.buf.size:
            grown = np.empty(max(need, 2 * self.buf.size), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n: need] = values
        self.n = need

    def view(self) -> np.ndarray:
        return self.buf[: self.n]


class KVCacheManager:
    """Node -> KV pool branch and slots.

    Parameters
    ----------
    pool : treeattn.KVPool
        With ``num_layers`` equal to the model's layers.
    """

    def __init__(self, pool: KVPool):
        self.pool = pool
        self._branch: dict[int, int] = {}
        self._slots: dict[int, _Slots] = {}
        self._reserved: dict[int, np.ndarray] = {}
        self._scratch: int | None = None
        self._pad: int | None = None
        hkv, d = pool.num_kv_heads, pool.head_dim
        self.caches = [(pool.k_cache(l).view(-1, hkv, d), pool.v_cache(l).view(-1, hkv, d))
                       for l in range(pool.num_layers)]
        self._all = self._stacked_view()
        #: elements from one layer's K (or V) cache to the next layer's, when the pool lays the
        #: layers out evenly (KVPool does); None otherwise
        self.layer_stride = None if self._all is None else self._all.stride(0) * 2

    def _stacked_view(self) -> torch.Tensor | None:
        """``[2 * layers, num_slots, Hkv, D]`` view of every cache (KVPool's documented layout), or
        None when the caches are not laid out that way."""
        p = self.pool
        k0 = p.k_cache(0)
        step = p.num_slots * p.num_kv_heads * p.head_dim
        ok = p.v_cache(0).data_ptr() - k0.data_ptr() == step * k0.element_size() and all(
            p.k_cache(l).data_ptr() - k0.data_ptr() == 2 * l * step * k0.element_size()
            for l in range(p.num_layers))
        if not ok:
            return None
        return k0.as_strided((2 * p.num_layers, p.num_slots, p.num_kv_heads, p.head_dim),
                             (step, p.num_kv_heads * p.head_dim, p.head_dim, 1))

    # ------------------------------------------------------------------ nodes
    def new_root(self, node: int) -> None:
        """Give ``node`` an empty root branch."""
        self._branch[node] = self.pool.new_branch()
        self._slots[node] = _Slots()

    def fork(self, parent: int, child: int) -> None:
        """Give ``child`` a branch forked from ``parent``'s (its pages shared, nothing copied)."""
        self.drop_reserved(parent)
        self._branch[child] = self.pool.fork(self._branch[parent])
        self._slots[child] = _Slots()

    def remove(self, node: int) -> None:
        """Free ``node``'s branch (its children must be removed first)."""
        self.pool.free(self._branch.pop(node))
        del self._slots[node]
        self._reserved.pop(node, None)

    def append(self, node: int, n: int) -> np.ndarray:
        """Slots for ``n`` new tokens of ``node``: reserved ones first, then fresh ones from the pool.

        Returns int64 ``[n]``; raises :class:`treeattn.KVPoolOutOfMemory` when the pool is full.
        """
        res = self._reserved.get(node)
        if res is not None and res.size:
            take, rest = res[:n], res[n:]
            self._reserved[node] = rest
            if take.size < n:
                take = np.concatenate((take, self.pool.append(self._branch[node], n - take.size)))
        else:
            take = self.pool.append(self._branch[node], n)
        self._slots[node].extend(take)
        return take

    def reserve(self, node: int, n: int) -> np.ndarray:
        """Allocate slots so that ``node`` has ``n`` reserved slots; returns them (int64 ``[n]``)."""
        res = self._reserved.get(node, np.zeros(0, dtype=np.int64))
        if res.size < n:
            res = np.concatenate((res, self.pool.append(self._branch[node], n - res.size)))
            self._reserved[node] = res
        return res[:n]

    def drop_reserved(self, node: int, *, keep: int = 0) -> None:
        """Forget ``node``'s unused reserved slots after its first ``keep`` (they stay allocated
        until the branch is freed)."""
        if keep <= 0:
            self._reserved.pop(node, None)
        elif node in self._reserved:
            self._reserved[node] = self._reserved[node][:keep]

    def own_slots(self, node: int) -> np.ndarray:
        """int64 ``[own tokens]``: slots of the tokens ``node`` holds, in order (a view)."""
        return self._slots[node].view()

    def num_tokens(self, node: int) -> int:
        return self._slots[node].n

    # ------------------------------------------------------------------ scratch
    def scratch(self, n: int) -> np.ndarray:
        """``n`` slots of a private scratch branch (speculative draft tokens), reused every call.
        Its pages are the pool's highest, so the verified sequence's own pages stay consecutive."""
        if self._scratch is None:
            self._scratch = self.pool.new_branch()
        have = self.pool.length(self._scratch)
        if have < n:
            self.pool.append(self._scratch, n - have, high=True)
        return self.pool.slots(self._scratch)[:n]

    @property
    def pad_slot(self) -> int:
        """A slot no token uses, written by padded rows of CUDA-graph batches."""
        if self._pad is None:
            self._pad = self.pool.new_branch()
            self.pool.append(self._pad, 1, high=True)
        return int(self.pool.slots(self._pad)[0])

    def copy(self, src: torch.Tensor, dst: torch.Tensor, *, in_place: bool = False) -> None:
        """Copy K and V of slots ``src`` to slots ``dst`` (int64 ``[m]`` on the pool's device), all
        layers, without synchronising.

        With ``in_place`` (the caller guarantees that no slot is both a destination and another
        pair's source), pairs whose source is their destination move no bytes: on CUDA one kernel
        copies the others directly (a gather then a scatter otherwise, through a temporary)."""
        if in_place and self._all is not None:
            if src.is_cuda:
                fused.copy_slots(self._all, src, dst)
            else:                               # (no device to wait for: select the pairs that move)
                moved = src != dst
                self._all[:, dst[moved]] = self._all[:, src[moved]]
            return
        if self._all is not None:
            self._all[:, dst] = self._all[:, src]
            return
        for k, v in self.caches:
            k[dst] = k[src]
            v[dst] = v[src]

    def release_private(self) -> None:
        """Free the scratch and padding branches."""
        for attr in ("_scratch", "_pad"):
            bid = getattr(self, attr)
            if bid is not None:
                self.pool.free(bid)
                setattr(self, attr, None)

    @property
    def nodes(self) -> list[int]:
        return list(self._branch)
