"""Decode attention over one sequence whose KV is sharded across ranks: Tree Attention and the Ring
Attention baseline.

Every rank passes the same queries ``q [B, Hq, D]`` (``B`` queries sharing the context, e.g. one
decode token or parallel samples) and its contiguous slice of the context's KV, slices in rank
order; a rank may hold no token. Every rank gets the exact attention output.

``method="tree"`` (the paper's Alg. 3): local partial ``(o, lse)`` with treeattn's kernels, one
max all-reduce of ``lse`` and one sum all-reduce of the packed fp32 numerator and denominator
(:func:`treeattn.distributed.allreduce_merge`). KV never moves.

``method="ring"``: Ring Attention for decode. The ranks exchange their token counts once (at plan
time), then for ``p - 1`` steps each rank passes the KV shard it holds to ``rank + 1`` and receives
the next from ``rank - 1`` (``batch_isend_irecv``, double-buffered, overlapped with the attention
over the shard in hand), accumulating with an online softmax. It moves ``(p - 1) / p`` of the KV
through every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treeattn.api import TreeAttention
from treeattn.distributed.combine import allreduce_merge, merge_running
from treeattn.distributed.comm import CommStats, all_gather_counts, group_info, ring_exchange
from treeattn.distributed.local import LocalPlan, plan_sequence_shard, run_local

__all__ = ["METHODS", "ShardPlan", "ShardedAttention", "sharded_attention"]

METHODS = ("tree", "ring")


@dataclass(frozen=True)
class ShardPlan:
    """Plan of one sharded decode step on one rank (see :meth:`ShardedAttention.plan`).

    Attributes
    ----------
    method : {"tree", "ring"}
    rank, world_size : int
        Position in the group.
    shard_lengths : tuple of int
        Tokens of every rank's shard (ring; for tree only this rank's count is known: ``(n,)``).
    local : dict
        ``{num_tokens: LocalPlan}`` for every shard length this rank attends over.
    num_queries, num_qo_heads, num_kv_heads, head_dim : int
    dtype : torch.dtype
    """

    method: str
    rank: int
    world_size: int
    shard_lengths: tuple
    local: dict
    num_queries: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


class ShardedAttention:
    """Plan/run wrapper for sharded-KV decode attention (collective: every rank of ``group``
    calls ``plan`` and ``run`` in the same order).

    Parameters
    ----------
    method : {"tree", "ring"}
    group : torch.distributed ProcessGroup, optional
        Default: the world.
    device : torch.device or str, optional
        Where plans and buffers live (the device of q and KV).
    backend : {"auto", "triton", "torch"}
        Local attention backend (see :class:`treeattn.TreeAttention`).
    strategy : str
        Planner for the local attention (``"auto"`` picks).

    Examples
    --------
    >>> sa = ShardedAttention("tree", device="cuda")
    >>> plan = sa.plan(k_local.shape[0], num_queries=1, num_qo_heads=32, num_kv_heads=8,
    ...                head_dim=128, dtype=torch.bfloat16)
    >>> o = sa.run(q, k_local, v_local, plan)          # every layer, every step of the same length
    """

    def __init__(self, method: str = "tree", *, group=None, device=None, backend: str = "auto",
                 strategy: str = "auto"):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
        self.method = method
        self.group = group
        self.strategy = strategy
        self.wrapper = TreeAttention(device=device, backend=backend)
        self.device = self.wrapper.device

    def plan(self, num_local_tokens: int, *, num_queries: int, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16,
             stats: CommStats | None = None) -> ShardPlan:
        """Plan a step whose local shard holds ``num_local_tokens`` tokens (host-side; the ring
        method exchanges the shard lengths: one all-gather)."""
        rank, world = group_info(self.group)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        if self.method == "ring" and world > 1:
            lengths = tuple(all_gather_counts(num_local_tokens, device=self.device, group=self.group,
                                              stats=stats))
        else:
            lengths = (int(num_local_tokens),)
        local = {}
        for n in sorted(set(lengths)):
            local[n] = plan_sequence_shard(self.wrapper, n, num_queries=num_queries,
                                           num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                           head_dim=head_dim, dtype=dtype, strategy=self.strategy)
        return ShardPlan(self.method, rank, world, lengths, local, int(num_queries),
                         int(num_qo_heads), int(num_kv_heads), int(head_dim), dtype)

    def _check(self, q, k_local, v_local, plan: ShardPlan) -> None:
        for name, t in (("q", q), ("k_local", k_local), ("v_local", v_local)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not isinstance(plan, ShardPlan) or plan.method != self.method:
            raise TypeError(f"plan must be a ShardPlan from this wrapper's plan() ({self.method})")
        shape_q = (plan.num_queries, plan.num_qo_heads, plan.head_dim)
        if tuple(q.shape) != shape_q:
            raise ValueError(f"q must be {list(shape_q)}, got {list(q.shape)}")
        mine = plan.shard_lengths[plan.rank] if len(plan.shard_lengths) > 1 else plan.shard_lengths[0]
        shape_kv = (mine, plan.num_kv_heads, plan.head_dim)
        if tuple(k_local.shape) != shape_kv or tuple(v_local.shape) != shape_kv:
            raise ValueError(f"k_local and v_local must be {list(shape_kv)}, got "
                             f"{list(k_local.shape)} and {list(v_local.shape)}")
        if not (q.dtype == k_local.dtype == v_local.dtype == plan.dtype):
            raise TypeError(f"dtype mismatch: q {q.dtype}, k_local {k_local.dtype}, v_local "
                            f"{v_local.dtype}, plan {plan.dtype}")

    def _local(self, q, k, v, lplan: LocalPlan, sm_scale):
        return run_local(self.wrapper, q, k.unsqueeze(1), v.unsqueeze(1), lplan, sm_scale=sm_scale)

    def run(self, q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, plan: ShardPlan, *,
            sm_scale: float | None = None, stats: CommStats | None = None) -> torch.Tensor:
        """Exact attention of ``q`` over the whole sharded context (collective).

        Parameters
        ----------
        q : [B, Hq, D] float16 / bfloat16 / float32, the same on every rank
        k_local, v_local : [n_local, Hkv, D], q's dtype
            This rank's contiguous slice of the context's KV.
        plan : ShardPlan from :meth:`plan`
        sm_scale : float, default ``1 / sqrt(D)``
        stats : CommStats, optional
            Records every collective / send / receive.

        Returns
        -------
        o : [B, Hq, D] in q's dtype on every rank (bitwise identical across ranks for ``"tree"``;
        for ``"ring"`` each rank merges the shards in its own order, so results differ in
        rounding).
        """
        self._check(q, k_local, v_local, plan)
        if plan.method == "tree":
            o, lse = self._local(q, k_local, v_local, plan.local[plan.shard_lengths[0]], sm_scale)
            if plan.world_size == 1:
                return o
            return allreduce_merge(o, lse, group=self.group, stats=stats)
        return self._run_ring(q, k_local, v_local, plan, sm_scale, stats)

    def _run_ring(self, q, k_local, v_local, plan: ShardPlan, sm_scale, stats) -> torch.Tensor:
        rank, world, lengths = plan.rank, plan.world_size, plan.shard_lengths
        if world == 1:
            return self._local(q, k_local, v_local, plan.local[lengths[0]], sm_scale)[0]
        others = [lengths[(rank - s) % world] for s in range(1, world)]
        cap = max(others)
        shape = (2, cap) + tuple(k_local.shape[1:])
        bufs = [torch.empty(shape, dtype=k_local.dtype, device=k_local.device)
                for _ in range(min(2, world - 1))] if cap else []
        cur_k, cur_v = k_local.contiguous(), v_local.contiguous()
        acc_o = acc_lse = None
        for step in range(world):
            src = (rank - step) % world
            works = []
            if step < world - 1:  # pass the shard in hand on, fetch the next one
                nxt = lengths[(rank - step - 1) % world]
                send = [cur_k, cur_v] if lengths[src] else []
                recv = [bufs[step % 2][0, :nxt], bufs[step % 2][1, :nxt]] if nxt else []
                works = ring_exchange(send, recv, rank=rank, world_size=world, group=self.group,
                                      stats=stats)
            o, lse = self._local(q, cur_k, cur_v, plan.local[lengths[src]], sm_scale)
            if acc_o is None:
                acc_o, acc_lse = o.float(), lse
            else:
                acc_o, acc_lse = merge_running(acc_o, acc_lse, o, lse)
            for w in works:
                w.wait()
            if step < world - 1:
                cur_k, cur_v = recv if recv else (cur_k[:0], cur_v[:0])
        return acc_o.to(q.dtype)


def sharded_attention(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, *,
                      method: str = "tree", group=None, sm_scale: float | None = None,
                      strategy: str = "auto", backend: str = "auto",
                      stats: CommStats | None = None) -> torch.Tensor:
    """Exact decode attention over a context whose KV is sharded across ranks (collective).

    Parameters
    ----------
    q : [B, Hq, D] float16 / bfloat16 / float32
        The same queries on every rank; each sees the whole context.
    k_local, v_local : [n_local, Hkv, D], q's dtype
        This rank's contiguous slice of the context's KV (slices in rank order; ``n_local`` may be
        ``0``; ``Hq`` a multiple of ``Hkv``).
    method : {"tree", "ring"}
    group : ProcessGroup, optional
    sm_scale : float, default ``1 / sqrt(D)``
    strategy : str
        Local planner (see :data:`treeattn.STRATEGIES`).
    backend : {"auto", "triton", "torch"}
    stats : CommStats, optional
        Records the bytes communicated.

    Returns
    -------
    o : [B, Hq, D] in q's dtype on every rank (equal up to rounding for ``"ring"``).

    Notes
    -----
    Plans on every call; to reuse a plan across layers use :class:`ShardedAttention`.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a [B, Hq, D] torch.Tensor")
    if not isinstance(k_local, torch.Tensor) or k_local.dim() != 3:
        raise ValueError("k_local must be a [n_local, Hkv, D] torch.Tensor")
    sa = ShardedAttention(method, group=group, device=q.device, backend=backend, strategy=strategy)
    plan = sa.plan(k_local.shape[0], num_queries=q.shape[0], num_qo_heads=q.shape[1],
                   num_kv_heads=k_local.shape[1], head_dim=q.shape[2], dtype=q.dtype, stats=stats)
    return sa.run(q, k_local, v_local, plan, sm_scale=sm_scale, stats=stats)
