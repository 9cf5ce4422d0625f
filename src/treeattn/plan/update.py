"""Lazy plan update (PAT Sec. 5.1): after a decode step appends tokens to nodes whose whole KV was
planned (typically every leaf gains one token), patch the plan instead of planning again.

Each grown node's new slots are spliced in right after every planned copy of its old last token,
so they join the work items that already read that node's tail (with the same queries, which now
see them too), and every work range is shifted by the tokens inserted before it. The structure
(items, query tiles, merge map, launches) is kept. Work is O(leaves) plus a few passes over the
planned KV list; no per-entry gathers.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from treeattn.plan.plan import Plan, PlanHost
from treeattn.tree import DecodingTree, ranges

__all__ = ["update_plan"]


def _grown(plan: Plan, tree: DecodingTree) -> np.ndarray | None:
    """Tokens each node gained, or None when ``tree`` is not ``plan``'s tree grown at node tails
    (same parents and queries, queries that saw a whole grown node see it whole again, and every
    old token keeps its slot)."""
    old = plan.host.tree
    if tree.page_size != old.page_size or tree.num_nodes != old.num_nodes or \
            tree.num_queries != old.num_queries:
        return None
    if not (np.array_equal(tree.parents, old.parents) and np.array_equal(tree.query_nodes, old.query_nodes)):
        return None
    grown = tree.lengths - old.lengths
    if np.any(grown < 0):
        return None
    qn = old.query_nodes
    saw_all = old.query_prefix == old.lengths[qn]
    expect = np.where(saw_all & (grown[qn] > 0), tree.lengths[qn], old.query_prefix)
    if not np.array_equal(tree.query_prefix, expect):
        return None
    nodes = np.flatnonzero(grown)
    new_tokens = np.ones(tree.num_tokens, dtype=bool)
    new_tokens[ranges(tree.kv_indptr[nodes] + old.lengths[nodes], tree.kv_indptr[nodes + 1])] = False
    if not np.array_equal(tree.kv_indices[new_tokens], old.kv_indices):
        return None
    return grown


def update_plan(plan: Plan, tree: DecodingTree) -> Plan | None:
    """``plan`` patched for ``tree`` (``plan``'s tree with tokens appended to some nodes), or None
    when the change is not such an append (the caller then plans again).

    Appends to a node whose tail no work item reads (nobody saw it) also return None.
    """
    if plan.host is None:
        return None
    grown = _grown(plan, tree)
    if grown is None:
        return None
    if not grown.any():
        return plan
    h = plan.host
    sel = grown[h.tail_node] > 0
    tails, tail_node = h.tail_pos[sel], h.tail_node[sel]
    if np.any(np.bincount(tail_node, minlength=grown.size)[grown > 0] == 0):
        return None  # a grown node whose tail no item reads: plan again
    counts = grown[tail_node].astype(np.int32)
    # the new list repeats each grown tail entry 1 + count times; the copies become the new tokens
    reps = np.ones(h.kv_slots.size, dtype=np.int32)
    reps[tails] += counts
    kv_slots = np.repeat(h.kv_slots, reps)
    shift = np.zeros(h.kv_slots.size + 1, dtype=np.int32)
    shift[tails + 1] = counts
    np.cumsum(shift, out=shift)
    offset = ranges(np.ones(tails.size, np.int64), counts + 1)  # 1..count for each tail
    new_at = np.repeat(tails + shift[tails], counts) + offset
    new_node = np.repeat(tail_node, counts)
    new_pos = h.tree.lengths[new_node] + offset - 1
    kv_slots[new_at] = tree.kv_indices[tree.kv_indptr[new_node] + new_pos]
    # a range [s, e) moves by the tokens inserted at positions <= s (tails of earlier ranges) and
    # its end also by those after its own last entry
    start = h.work_kv_start + shift[h.work_kv_start]
    end = h.work_kv_end + shift[h.work_kv_end]
    # old tails move; grown ones now end at their last new token
    tail_pos = h.tail_pos + shift[h.tail_pos]
    tail_pos[sel] += counts
    kv_node = kv_pos = None
    device = plan.device

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device, non_blocking=True)

    changes = dict(kv_indices=t(kv_slots), work_kv_start=t(start), work_kv_end=t(end),
                   min_slots=max(plan.min_slots, int(kv_slots[new_at].max()) + 1))
    if plan.has_mask:
        kv_node = np.repeat(h.kv_node, reps)
        kv_pos = np.repeat(h.kv_pos, reps)
        kv_pos[new_at] = new_pos
        topo = tree.topology
        changes.update(mask_lo=t(topo.tin[kv_node]), mask_hi=t(topo.tout[kv_node]), mask_pos=t(kv_pos),
                       query_prefix=t(tree.query_prefix))
    heads = plan.heads
    per_token = heads.num_kv_heads * heads.head_dim * 2 * heads.elem_bytes
    added = int(counts.sum())
    added_tiles = int((end - start).sum()) - int((h.work_kv_end - h.work_kv_start).sum())
    io = plan.io
    changes["io"] = dataclasses.replace(
        io, kv=io.kv + added * per_token,
        kv_tile_rereads=io.kv_tile_rereads + (added_tiles - added) * per_token,
        index=io.index + added_tiles * 4 * heads.num_kv_heads,
        mask=io.mask + (added_tiles * 12 * heads.num_kv_heads if plan.has_mask else 0))
    changes["host"] = PlanHost(kv_slots=kv_slots, tail_pos=tail_pos, tail_node=h.tail_node, kv_node=kv_node,
                               kv_pos=kv_pos, work_kv_start=start, work_kv_end=end, tree=tree)
    return dataclasses.replace(plan, **changes)
