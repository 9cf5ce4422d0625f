"""Sequence-sharded KV decoding: :class:`ShardedTreeEngine`, one per rank of a
``torch.distributed`` group (``treeattn run --sp N`` under ``torchrun``).

Every rank of the group runs the same model (the whole model, or the same tensor-parallel share
of it: :mod:`treeattn.engine.parallel`) on the same inputs with the same sampler seed, so every
rank picks the same tokens; only the KV cache is sharded along the sequence. A token at position ``p`` of a sequence is *owned* by rank ``(p // block) % world``
(block-cyclic, ``block`` defaults to the page size), and only its owner stores its K/V: each
rank's :class:`~treeattn.KVPool` holds about ``1 / world`` of the tree's tokens. Tokens a rank
does not own are written to one throw-away slot.

Attention of each layer is local partial attention over the rank's part of the tree
(:func:`treeattn.distributed.plan_local` / :func:`~treeattn.distributed.run_local`) merged across
ranks with the Tree Attention all-reduce (:func:`treeattn.distributed.allreduce_merge`); prefill
does the same over the cached context, plus the causal attention among the new tokens (whose K/V
every rank computes) on rank 0 only.

Limitations: one plan per step (no decode windows), no CUDA graphs, no speculative
verification (:meth:`ShardedTreeEngine.verify` raises).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from treeattn.distributed import allreduce_merge, plan_local, run_local
from treeattn.distributed.combine import merge_running
from treeattn.engine.engine import TreeEngine
from treeattn.engine.node_slots import KVCacheManager
from treeattn.engine.planning import upload
from treeattn.engine.tree_manager import SequenceTree

__all__ = ["ShardedKVCacheManager", "ShardedTreeEngine"]


class ShardedKVCacheManager(KVCacheManager):
    """A :class:`~treeattn.engine.node_slots.KVCacheManager` that stores only this rank's tokens.

    ``append`` returns a slot for every new token (the model writes all of them); the tokens of
    other ranks get :attr:`pad_slot`, a slot no token reads. ``own_slots`` / ``num_tokens`` report
    the local tokens only, so ``SequenceTree.path_slots`` and the local tree see this rank's part.

    Parameters
    ----------
    pool : treeattn.KVPool
    rank, world : int
    block : int
        Consecutive positions owned by one rank.
    """

    def __init__(self, pool, rank: int, world: int, block: int):
        super().__init__(pool)
        if not 0 <= rank < world or block < 1:
            raise ValueError(f"bad shard: rank {rank}, world {world}, block {block}")
        self.rank, self.world, self.block = rank, world, block
        self._start: dict[int, int] = {}   # position of a node's first token
        self._total: dict[int, int] = {}   # tokens appended to a node (all ranks)

    def owner(self, positions: np.ndarray) -> np.ndarray:
        """Rank owning each position (int64 array)."""
        return (np.asarray(positions, dtype=np.int64) // self.block) % self.world

    def new_root(self, node: int) -> None:
        super().new_root(node)
        self._start[node], self._total[node] = 0, 0

    def fork(self, parent: int, child: int) -> None:
        super().fork(parent, child)
        self._start[child], self._total[child] = self._start[parent] + self._total[parent], 0

    def remove(self, node: int) -> None:
        super().remove(node)
        del self._start[node], self._total[node]

    def append(self, node: int, n: int) -> np.ndarray:
        first = self._start[node] + self._total[node]
        mine = self.owner(np.arange(first, first + n)) == self.rank
        self._total[node] += n
        out = np.full(n, -1, dtype=np.int64)
        k = int(mine.sum())
        if k:
            out[mine] = super().append(node, k)
        if k < n:
            out[~mine] = self.pad_slot
        return out

    def reserve(self, node: int, n: int) -> np.ndarray:
        raise NotImplementedError("a sharded KV cache plans one step at a time (window=1)")

    def total_tokens(self, node: int) -> int:
        """Tokens of ``node`` over all ranks."""
        return self._total[node]


def _attn_lse(q, k, v, mask=None):
    """Exact attention ``q [L, Hq, D]`` over ``k, v [S, Hkv, D]`` (GQA) with its natural-log LSE
    ``[L, Hq]`` float32; ``o = 0``, ``lse = -inf`` when ``S == 0``. ``mask [L, S]`` bool: seen."""
    n, hq, d = q.shape
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full((n, hq), float("-inf"), device=q.device)
    g = hq // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = q.float().transpose(0, 1) @ kf.transpose(1, 2) / d ** 0.5          # [Hq, L, S]
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                        # [Hq, L]
    o = torch.exp(s - lse[..., None]) @ vf
    return o.transpose(0, 1).to(q.dtype), lse.transpose(0, 1).contiguous()


class ShardedTreeEngine(TreeEngine):
    """:class:`~treeattn.engine.TreeEngine` whose KV is sequence-sharded over a process group.

    Collective: every rank of ``group`` drives the same controller with the same seed, and every
    decode / prefill step runs two all-reduces per layer over ``group`` (and a tensor-parallel
    model's own collectives over its TP group).

    Parameters
    ----------
    model : TreeModel
        The full model on every rank of ``group``, or, in a TP x SP grid
        (:func:`~treeattn.engine.parallel.make_grid`), the same TP share on every rank of
        ``group`` (its SP group).
    group : ProcessGroup, optional
        The ranks that share the sequence. Default: the world (``torch.distributed`` must be
        initialised).
    block : int, optional
        Positions per ownership block (default: ``page_size``).
    **kw
        :class:`~treeattn.engine.TreeEngine` options; ``kv_tokens`` is the per-rank capacity,
        ``window`` and ``cuda_graphs`` are ignored (1 and off).
    """

    def __init__(self, model, *, group=None, block: int | None = None, **kw):
        if model.config.query_pre_attn_scalar is not None:
            raise ValueError("query_pre_attn_scalar (Gemma 3) is not supported with a sharded KV cache")
        kw["window"], kw["cuda_graphs"] = 1, False
        super().__init__(model, **kw)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.kv = ShardedKVCacheManager(self.pool, self.rank, self.world,
                                        block or self.pool.page_size)
        self.tree = SequenceTree(self.kv)
        self._lplan = None

    # ------------------------------------------------------------------ prefill
    def _prefill_model(self, tokens, positions, slots, contexts: list, lengths: list) -> torch.Tensor:
        """One sharded pass per segment (each merges its partial attentions across ranks)."""
        out, a = [], 0
        for ctx, n in zip(contexts, lengths):
            out.append(self._prefill_one(tokens[a:a + n], positions[a:a + n], slots[a:a + n], ctx))
            a += n
        return torch.stack(out)

    def _prefill_one(self, tokens, positions, slots, context_slots) -> torch.Tensor:
        m, c = self.model, self.model.config
        n = tokens.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        with torch.no_grad():
            h = m.embed(tokens)
            for layer in range(c.num_layers):
                q, k, v = m.pre_attention(layer, h, positions, slots, self.kv.caches)
                kc, vc = self.kv.caches[layer]
                o, lse = _attn_lse(q, kc.index_select(0, context_slots), vc.index_select(0, context_slots))
                if self.rank == 0:      # the new tokens' own causal part, counted once
                    o2, lse2 = _attn_lse(q, k, v, causal)
                    o, lse = merge_running(o.float(), lse, o2, lse2)
                h = m.post_attention(layer, h, allreduce_merge(o.to(q.dtype), lse, group=self.group))
            return m.logits(h[-1:])[0]

    # ------------------------------------------------------------------ decode
    def _local_part(self, nodes):
        """This rank's part of the tree ``nodes`` see: parents, local lengths, slots, query nodes."""
        index, order = {}, []
        for q in nodes:
            n = q
            while n is not None and n not in index:
                index[n] = len(order)
                order.append(n)
                n = self.tree.parent(n)
        parents = [index[p] if (p := self.tree.parent(n)) is not None else -1 for n in order]
        chunks = [self.kv.own_slots(n) for n in order]
        lengths = np.asarray([ch.size for ch in chunks], dtype=np.int64)
        qn = np.asarray([index[q] for q in nodes], dtype=np.int64)
        kv = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        return np.asarray(parents, dtype=np.int64), lengths, kv, qn

    def _warm_model(self) -> None:
        """One tiny prefill and decode step on every rank, then a reset (the single-GPU engine's
        warm-up runs controllers whose steps this engine was not checked with at creation)."""
        root = self.tree.add_root()
        self.prefill(root, [0] * 32)
        self.decode(self.tree.branch(root, 2), torch.zeros(2, dtype=torch.int64, device=self.device))
        self.reset()
        self.stats.clear()

    def plan_ahead(self, nodes, horizon: int, *, after: int) -> bool:
        """Nothing (False): a sharded engine plans every step in :meth:`decode`."""
        return False

    def decode(self, nodes, tokens: torch.Tensor, *, horizon: int = 1, events: tuple | None = None) -> torch.Tensor:
        """One new token for each leaf of ``nodes`` (see :meth:`TreeEngine.decode`); ``horizon``
        is ignored (one plan per step)."""
        self.flush_prefill()
        t0 = time.perf_counter()
        nodes = list(nodes)
        if not self.compute:
            return self._skip(nodes, tokens, t0)
        self._close_window()
        slots, pos = self.tree.append_one(nodes, tokens)
        self._check_positions(pos)
        parents, lengths, kv, qn = self._local_part(nodes)
        c = self.model.config
        t1 = time.perf_counter()
        self._lplan = plan_local(self.attention, parents, lengths, query_nodes=qn, query_prefix=lengths[qn],
                                 num_qo_heads=self.model.num_heads, num_kv_heads=self.model.num_kv_heads,
                                 head_dim=c.head_dim,
                                 dtype=self.model.dtype, strategy=self.strategy, kv_indices=kv,
                                 page_size=self.pool.page_size, num_slots=self.pool.num_slots)
        plan_ms = (time.perf_counter() - t1) * 1e3
        logits = self._forward(tokens, pos, slots, self._lplan.plan, "decode", t0, plan_ms,
                               int(lengths.sum()), events=events)
        for i, n in enumerate(nodes):
            self._logits[n] = (logits, i)
        return logits

    def _run_model(self, tokens, pos, slots, plan, sliding=None) -> torch.Tensor:
        if plan is not None:
            self._ensure_workspace(plan)
        lplan = self._lplan

        def attend(layer, q, out=None):
            self._fire("attn_begin", layer)
            o, lse = run_local(self.attention, q, *self._paged[layer], lplan)
            o = allreduce_merge(o, lse, group=self.group)
            self._fire("attn_end", layer)
            return o
        d = self.device
        return self.model.decode(tokens, upload(pos, d), upload(slots, d), self.kv.caches, attend)

    def _check_positions(self, pos: np.ndarray) -> None:
        w = self.sliding_window
        if w is not None and pos.size and int(pos.max()) >= w:
            raise ValueError(f"position {int(pos.max())} exceeds the model's sliding window ({w}); "
                             "sliding-window attention is not supported with a sharded KV cache")
        super()._check_positions(pos)

    def verify(self, *args, **kw):
        raise NotImplementedError("speculative verification is not supported with a sharded KV cache")

    def prepare_graphs(self, counts) -> None:
        """No CUDA graphs in sharded mode."""

