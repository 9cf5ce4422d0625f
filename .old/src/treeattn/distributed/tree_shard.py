"""Decoding trees spread over ranks: a balanced KV split and prefix-aware sharded tree attention.

:func:`shard_tree` cuts the depth-first flattened token order of a tree (the order of
``DecodingTree.topology.flat_start``: a node's tokens, then its subtrees) into ``world_size``
contiguous ranges of ``floor``/``ceil(T / p)`` tokens. A range holds whole nodes except at its two
ends, and consecutive nodes of the depth-first order (a prefix and its descendants) stay together,
so a shared prefix is split across ranks only when it is longer than what is left of the range.

:func:`sharded_tree_attention` gives each rank a *local tree* (the global nodes with local token
counts) and plans it with treeattn's prefix-aware planners, so each local KV token is read once for
all the queries that see it. Visibility stays exact for any partition of the tokens: a query at
node ``u`` with prefix ``P`` sees the local tokens of ``u``'s proper ancestors and those local
tokens of ``u`` at in-node positions ``< P``, which are a prefix of ``u``'s local tokens in
position order (see :func:`local_tree_part`). Partial states are merged with one max and one sum
all-reduce (:func:`treeattn.distributed.allreduce_merge`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treeattn.api import TreeAttention
from treeattn.distributed.combine import allreduce_merge
from treeattn.distributed.comm import CommStats, group_info
from treeattn.distributed.local import LocalPlan, plan_local, run_local
from treeattn.tree import DecodingTree

__all__ = [
    "LocalTreePart",
    "local_tree_part",
    "plan_tree_shard",
    "shard_tree",
    "sharded_decode",
    "sharded_tree_attention",
]


def shard_tree(parents, lengths, world_size: int) -> list:
    """Balanced, deterministic split of a tree's KV across ``world_size`` ranks.

    Parameters
    ----------
    parents : int sequence [N]
        ``-1`` marks a root (forests allowed).
    lengths : int sequence [N]
        Tokens of each node.
    world_size : int

    Returns
    -------
    list of ``world_size`` int64 LongTensors (CPU)
        Rank ``r`` gets flattened positions ``[floor(r T / p), floor((r + 1) T / p))`` of the
        depth-first token order, as indices into the node-id-ordered KV of
        :func:`treeattn.tree_attention` (node ``i``'s tokens at ``sum(lengths[:i]) ...``), in
        depth-first order. Shards are disjoint, cover every token and differ in size by at most
        one token; with fewer tokens than ranks some shards are empty.
    """
    if int(world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    p = int(world_size)
    tree = _kv_tree(parents, lengths)
    t = tree.num_tokens
    tok_node = np.repeat(np.arange(tree.num_nodes), tree.lengths)
    flat_pos = tree.topology.flat_start[tok_node] + (np.arange(t) - tree.kv_indptr[tok_node])
    by_flat = np.empty(t, dtype=np.int64)
    by_flat[flat_pos] = np.arange(t)  # node-ordered KV index of each depth-first position
    bounds = [(r * t) // p for r in range(p + 1)]
    return [torch.from_numpy(by_flat[bounds[r]:bounds[r + 1]].copy()) for r in range(p)]


def _kv_tree(parents, lengths) -> DecodingTree:
    """The tree's KV layout and topology, with one placeholder query (queries do not matter)."""
    ln = np.asarray(lengths.cpu().numpy() if isinstance(lengths, torch.Tensor) else lengths)
    if ln.ndim != 1 or ln.size == 0 or not np.issubdtype(ln.dtype, np.integer):
        raise ValueError("lengths must be a non-empty one-dimensional integer sequence")
    if np.any(ln < 0):
        raise ValueError(f"malformed tree: node {int(np.flatnonzero(ln < 0)[0])} has a negative length")
    anchor = int(np.argmax(ln))
    if ln[anchor] == 0:
        raise ValueError("the tree holds no KV token")
    return DecodingTree.from_parents(parents, ln, query_nodes=[anchor], query_prefix=[int(ln[anchor])])


@dataclass(frozen=True)
class LocalTreePart:
    """One rank's part of a decoding tree (the input of :func:`treeattn.distributed.plan_local`).

    Attributes
    ----------
    parents : int64 [N]
        The global parent links.
    lengths : int64 [N]
        Local tokens of each node.
    kv_indices : int64 [n_local]
        Row of ``k_local`` of each local token, nodes in id order and tokens in position order.
    query_nodes : int64 [Q]
        Node of each query (global).
    query_prefix : int64 [Q]
        Local tokens of its own node each query sees.
    """

    parents: np.ndarray
    lengths: np.ndarray
    kv_indices: np.ndarray
    query_nodes: np.ndarray
    query_prefix: np.ndarray


def local_tree_part(parents, lengths, shard, *, query_nodes=None, query_prefix=None) -> LocalTreePart:
    """The local tree of the rank holding KV tokens ``shard`` (host-side).

    Parameters
    ----------
    parents, lengths : int sequences [N]
        The global tree (layout of :func:`treeattn.tree_attention`).
    shard : LongTensor or int sequence [n_local]
        Node-id-ordered KV indices this rank holds, in the order of its ``k_local`` rows (any
        subset of distinct tokens, e.g. from :func:`shard_tree`; the shards of all ranks must
        partition the tokens).
    query_nodes, query_prefix : int sequences [Q], optional
        Global query semantics of :func:`treeattn.tree_attention` (default: one query per leaf).

    Returns
    -------
    LocalTreePart
        A query at node ``u`` with global prefix ``P`` sees locally the local tokens of ``u`` at
        in-node positions ``< P``: the first ``query_prefix`` of ``u``'s local tokens.
    """
    tree = DecodingTree.from_parents(parents, lengths, query_nodes=query_nodes,
                                     query_prefix=query_prefix)
    if isinstance(shard, torch.Tensor):
        shard = shard.detach().cpu().numpy()
    s = np.asarray(shard)
    if s.ndim != 1 or (s.size and not np.issubdtype(s.dtype, np.integer)):
        raise TypeError("shard must be a one-dimensional integer sequence")
    s = s.astype(np.int64)
    if s.size and (s.min() < 0 or s.max() >= tree.num_tokens):
        raise ValueError(f"shard holds KV index {int(s.min() if s.min() < 0 else s.max())}, out of "
                         f"range [0, {tree.num_tokens})")
    order = np.argsort(s, kind="stable")
    srt = s[order]
    if srt.size > 1 and np.any(srt[1:] == srt[:-1]):
        raise ValueError("shard holds a KV index twice")
    node = np.searchsorted(tree.kv_indptr, srt, side="right") - 1
    local_len = np.bincount(node, minlength=tree.num_nodes).astype(np.int64)
    start = tree.kv_indptr[tree.query_nodes]
    prefix = np.searchsorted(srt, start + tree.query_prefix) - np.searchsorted(srt, start)
    return LocalTreePart(tree.parents, local_len, order.astype(np.int64), tree.query_nodes,
                         prefix.astype(np.int64))


def plan_tree_shard(wrapper: TreeAttention, part, *, num_qo_heads: int, num_kv_heads: int,
                    head_dim: int, dtype: torch.dtype = torch.float16,
                    strategy: str = "auto") -> LocalPlan:
    """Plan a rank's local part (host-side).

    Parameters
    ----------
    wrapper : TreeAttention
    part : LocalTreePart, DecodingTree or any object with the same attributes
        ``parents``, ``lengths`` (local), ``kv_indices`` (local KV slots), ``query_nodes``,
        ``query_prefix`` (local), and optionally ``page_size`` and ``num_slots`` (an engine's
        per-rank view of its paged pool; unlike a DecodingTree it may have queries that see no
        local token).
    num_qo_heads, num_kv_heads, head_dim : int
    dtype : torch.dtype
    strategy : str
        Local planner (see :data:`treeattn.STRATEGIES`).
    """
    return plan_local(wrapper, part.parents, part.lengths, query_nodes=part.query_nodes,
                      query_prefix=part.query_prefix, kv_indices=part.kv_indices,
                      page_size=getattr(part, "page_size", 1), num_slots=getattr(part, "num_slots", None),
                      num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype=dtype, strategy=strategy)


def sharded_decode(wrapper: TreeAttention, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, lplan: LocalPlan, *, group=None,
                   sm_scale: float | None = None, stats: CommStats | None = None) -> torch.Tensor:
    """One layer of sharded tree decoding (collective): local attention of ``lplan`` over the
    local pool, then the all-reduce merge. The entry point for an engine with a paged KV pool
    per rank: build ``lplan`` with :func:`plan_local` once per step, call this per layer.

    Parameters
    ----------
    q : [Q, Hq, D], the same on every rank
    k_cache, v_cache : [num_pages, page_size, Hkv, D]
        This rank's pool (``lplan``'s KV slots address it).

    Returns
    -------
    o : [Q, Hq, D] in q's dtype, identical on every rank.
    """
    o, lse = run_local(wrapper, q, k_cache, v_cache, lplan, sm_scale=sm_scale)
    return allreduce_merge(o, lse, group=group, stats=stats)


def sharded_tree_attention(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, parents,
                           lengths, shard, *, query_nodes=None, query_prefix=None, group=None,
                           sm_scale: float | None = None, strategy: str = "auto",
                           backend: str = "auto", stats: CommStats | None = None) -> torch.Tensor:
    """Exact tree attention over a tree whose KV is spread across ranks (collective).

    Parameters
    ----------
    q : [Q, Hq, D] float16 / bfloat16 / float32, the same on every rank
    k_local, v_local : [len(shard), Hkv, D], q's dtype
        Row ``i`` holds token ``shard[i]`` of the node-id-ordered KV of
        :func:`treeattn.tree_attention` (e.g. ``k[shard]``).
    parents, lengths : int sequences [N]
        The global tree.
    shard : LongTensor [n_local]
        This rank's tokens (e.g. ``shard_tree(parents, lengths, world_size)[rank]``).
    query_nodes, query_prefix : int sequences [Q], optional
        As in :func:`treeattn.tree_attention`.
    group : ProcessGroup, optional
    sm_scale : float, default ``1 / sqrt(D)``
    strategy : str
        Local planner (prefix-aware: see :data:`treeattn.STRATEGIES`).
    backend : {"auto", "triton", "torch"}
    stats : CommStats, optional

    Returns
    -------
    o : [Q, Hq, D] in q's dtype, identical on every rank.

    Notes
    -----
    Plans on every call (host-side, no communication); for reuse across layers call
    :func:`local_tree_part`, :func:`plan_tree_shard` and :func:`sharded_decode`.
    """
    group_info(group)
    for name, t in (("q", q), ("k_local", k_local), ("v_local", v_local)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a three-dimensional torch.Tensor")
    part = local_tree_part(parents, lengths, shard, query_nodes=query_nodes, query_prefix=query_prefix)
    if k_local.shape[0] != part.kv_indices.size or v_local.shape != k_local.shape:
        raise ValueError(f"k_local and v_local must both hold the shard's {part.kv_indices.size} "
                         f"tokens, got {tuple(k_local.shape)} and {tuple(v_local.shape)}")
    if q.shape[0] != part.query_nodes.size:
        raise ValueError(f"q has {q.shape[0]} queries but the tree has {part.query_nodes.size}")
    if q.shape[2] != k_local.shape[2] or q.shape[1] % k_local.shape[1]:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not match KV heads/dim "
                         f"{tuple(k_local.shape[1:])}")
    wrapper = TreeAttention(device=q.device, backend=backend)
    lplan = plan_tree_shard(wrapper, part, num_qo_heads=q.shape[1], num_kv_heads=k_local.shape[1],
                            head_dim=q.shape[2], dtype=q.dtype, strategy=strategy)
    return sharded_decode(wrapper, q, k_local.unsqueeze(1), v_local.unsqueeze(1), lplan,
                          group=group, sm_scale=sm_scale, stats=stats)
