"""One rank's part of a sharded decoding tree: plan it, run it, get ``(o, lse)`` partial states.

A rank holds some of the KV tokens of a decoding tree (a *local part*). Its local tree has the
global tree's nodes and parent links with *local* token counts (``0`` where the rank holds none of
a node's tokens), and each query sees

* every local token of every proper ancestor of its node, and
* the first ``query_prefix[j]`` local tokens of its own node (local prefix, in KV order).

Queries that see no local token at all are left out of the plan and get ``o = 0`` and
``lse = -inf``: the neutral element of the LSE merge. This is what an engine with a per-rank paged
KV pool calls (:func:`plan_local` once per step, :func:`run_local` per layer), followed by
:func:`treeattn.distributed.allreduce_merge`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treeattn.api import TreeAttention
from treeattn.plan import Plan
from treeattn.tree import DecodingTree

__all__ = ["LocalPlan", "plan_local", "plan_sequence_shard", "run_local"]


@dataclass(frozen=True)
class LocalPlan:
    """A rank's plan for its local part.

    Attributes
    ----------
    plan : Plan or None
        Plan over the queries that see at least one local token; ``None`` when none does.
    active : torch.Tensor or None
        int64 [A] on the plan's device: the queries in ``plan`` (global query ids, increasing);
        ``None`` when every query is in ``plan``.
    num_queries : int
        Queries of the global step (rows of ``q``).
    num_local_tokens : int
        KV tokens this rank holds.
    """

    plan: Plan | None
    active: torch.Tensor | None
    num_queries: int
    num_local_tokens: int


def _ints(x, name: str, size: int | None = None) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a one-dimensional integer sequence")
    if size is not None and arr.size != size:
        raise ValueError(f"{name} has {arr.size} entries, expected {size}")
    return arr.astype(np.int64)


def plan_local(wrapper: TreeAttention, parents, lengths, *, query_nodes, query_prefix,
               num_qo_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype = torch.float16, strategy: str = "auto", kv_indices=None,
               page_size: int = 1, num_slots: int | None = None) -> LocalPlan:
    """Plan a rank's local part (host-side; once per decode step).

    Parameters
    ----------
    wrapper : TreeAttention
        Makes and later runs the plan (its device is where the plan lives).
    parents : int sequence [N]
        The global tree's parent links (``-1`` for roots).
    lengths : int sequence [N]
        Local tokens of each node (``>= 0``; ``0`` for nodes held elsewhere).
    query_nodes : int sequence [Q]
        Node of every query of the step.
    query_prefix : int sequence [Q]
        Local tokens of its own node each query sees (``0 <= query_prefix[j] <= lengths[node]``).
    num_qo_heads, num_kv_heads, head_dim : int
    dtype : torch.dtype
        Dtype of q and KV.
    strategy : one of :data:`treeattn.STRATEGIES`
        Planner for the local tree (prefix-aware planners share each local KV token among the
        queries that see it).
    kv_indices : int sequence [sum(lengths)], optional
        KV slot of each local token, nodes in id order (default: contiguous slots
        ``0 .. sum(lengths) - 1``).
    page_size : int
        Tokens per page of the local KV pool that ``kv_indices`` address.
    num_slots : int, optional
        Slots in the local pool, for range checks.

    Returns
    -------
    LocalPlan
    """
    parents = _ints(parents, "parents")
    lengths = _ints(lengths, "lengths", parents.size)
    qn = _ints(query_nodes, "query_nodes")
    qp = _ints(query_prefix, "query_prefix", qn.size)
    if qn.size == 0:
        raise ValueError("the step has no queries")
    if np.any(lengths < 0):
        raise ValueError("lengths must be >= 0")
    bad = np.flatnonzero((qn < 0) | (qn >= parents.size))
    if bad.size:
        raise ValueError(f"query {int(bad[0])} is at node {int(qn[bad[0]])}, out of range "
                         f"[0, {parents.size})")
    bad = np.flatnonzero((qp < 0) | (qp > lengths[qn]))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"query {j} sees local prefix {int(qp[j])} of node {int(qn[j])}, which "
                         f"holds {int(lengths[qn[j]])} local tokens")
    total = int(lengths.sum())
    if total == 0:
        return LocalPlan(None, None, int(qn.size), 0)
    anchor = int(np.argmax(lengths))  # a valid placeholder query, only to build the topology
    base = DecodingTree.from_parents(parents, lengths, query_nodes=[anchor],
                                     query_prefix=[int(lengths[anchor])], kv_indices=kv_indices,
                                     page_size=page_size, num_slots=num_slots)
    act = np.flatnonzero(base.topology.path_tokens[qn] + qp > 0)
    if act.size == 0:
        return LocalPlan(None, None, int(qn.size), total)
    tree = base.with_queries(qn[act], qp[act])
    plan = wrapper.plan(tree, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, dtype=dtype, strategy=strategy)
    active = None if act.size == qn.size else torch.as_tensor(act, device=wrapper.device)
    return LocalPlan(plan, active, int(qn.size), total)


def plan_sequence_shard(wrapper: TreeAttention, num_local_tokens: int, *, num_queries: int,
                        num_qo_heads: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.float16, strategy: str = "auto") -> LocalPlan:
    """Plan a contiguous shard of one sequence's KV that every query sees whole: a one-node tree
    of ``num_local_tokens`` tokens with all ``num_queries`` queries at that node (KV slots
    ``0 .. num_local_tokens - 1``)."""
    n = int(num_local_tokens)
    if n < 0:
        raise ValueError(f"num_local_tokens must be >= 0, got {n}")
    return plan_local(wrapper, [-1], [n], query_nodes=np.zeros(num_queries, dtype=np.int64),
                      query_prefix=np.full(num_queries, n, dtype=np.int64),
                      num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype=dtype, strategy=strategy)


def run_local(wrapper: TreeAttention, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              lplan: LocalPlan, *, sm_scale: float | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of every query over this rank's local KV.

    Parameters
    ----------
    wrapper : TreeAttention
        The wrapper that made ``lplan``.
    q : [Q, Hq, D], float16 / bfloat16 / float32
    k_cache, v_cache : [num_pages, page_size, Hkv, D], q's dtype
        The local KV pool (for contiguous KV ``[n, Hkv, D]`` pass ``k.unsqueeze(1)``).
    lplan : LocalPlan
    sm_scale : float, default ``1 / sqrt(D)``

    Returns
    -------
    o : [Q, Hq, D] in q's dtype (``0`` for queries that see no local token)
    lse : [Q, Hq] float32, natural log (``-inf`` for those queries)
    """
    if q.dim() != 3 or q.shape[0] != lplan.num_queries:
        raise ValueError(f"q must be [{lplan.num_queries}, Hq, D], got {tuple(q.shape)}")
    nq, hq, _ = q.shape
    if lplan.plan is None:
        return torch.zeros_like(q), torch.full((nq, hq), float("-inf"), dtype=torch.float32,
                                               device=q.device)
    if lplan.active is None:
        return wrapper.run(q, k_cache, v_cache, lplan.plan, sm_scale=sm_scale, return_lse=True)
    o_act, lse_act = wrapper.run(q.index_select(0, lplan.active), k_cache, v_cache, lplan.plan,
                                 sm_scale=sm_scale, return_lse=True)
    o = torch.zeros_like(q).index_copy_(0, lplan.active, o_act)
    lse = torch.full((nq, hq), float("-inf"), dtype=torch.float32, device=q.device)
    lse.index_copy_(0, lplan.active, lse_act)
    return o, lse
