"""Lazy plan update (PAT Sec. 5.1): after a decode step appends tokens to nodes whose whole KV was
planned (typically every leaf gains one token), patch the plan instead of planning again.

Each grown node's new slots are spliced in right after every planned copy of its old last token,
so they join the work items that already read that node's tail (with the same queries, which now
see them too), and every work range is shifted by the tokens inserted before it. The structure
(items, query tiles, merge map, launches) is kept. Work is O(leaves + work units) plus one copy
of the planned KV list (and of the tree mask, when the plan has one).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from treeattn.plan.plan import Plan
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
    if grown.min() < 0:
        return None
    qn = old.query_nodes
    saw_all = old.query_prefix == old.lengths[qn]
    expect = np.where(saw_all & (grown[qn] > 0), tree.lengths[qn], old.query_prefix)
    if not np.array_equal(tree.query_prefix, expect):
        return None
    nodes = np.flatnonzero(grown)
    old_tokens = np.ones(tree.num_tokens, dtype=bool)
    old_tokens[ranges(tree.kv_indptr[nodes] + old.lengths[nodes], tree.kv_indptr[nodes + 1])] = False
    if not np.array_equal(tree.kv_indices[old_tokens], old.kv_indices):
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
    if np.any(grown[~h.tail_read]):
        return None  # a grown node whose tail no item reads: plan again
    counts = grown[h.tail_node]  # tokens appended after each planned tail (0: not grown)
    inserted = np.zeros(counts.size + 1, dtype=np.int64)  # inserted[k]: after tails[:k]
    np.cumsum(counts, out=inserted[1:])
    added = int(inserted[-1])
    # new entry j of tail k goes to tail_pos[k] + inserted[k] + 1 + j, the old entries fill the rest
    src = np.repeat(np.arange(counts.size), counts)  # the tail of each new entry
    offset = np.arange(1, added + 1) - inserted[src]  # 1..count for each tail
    new_at = (h.tail_pos + inserted[:-1])[src] + offset
    keep_old = np.ones(h.kv_slots.size + added, dtype=bool)
    keep_old[new_at] = False

    def splice(old: np.ndarray, new: np.ndarray) -> np.ndarray:
        out = np.empty(keep_old.size, dtype=old.dtype)
        out[keep_old] = old
        out[new_at] = new
        return out

    new_node = h.tail_node[src]
    new_pos = h.tree.lengths[new_node] + offset - 1
    new_slots = tree.kv_indices[tree.kv_indptr[new_node] + new_pos]
    # a range [s, e) moves by the tokens inserted after the tails before s (its end: before e)
    arrays = {"kv_indices": splice(h.kv_slots, new_slots),
              "work_kv_start": h.work_kv_start + inserted[h.start_tails],
              "work_kv_end": h.work_kv_end + inserted[h.end_tails]}
    if plan.has_mask:
        # tin/tout depend on the parents only, so new entries copy their tail's mask range
        for name in ("mask_lo", "mask_hi"):
            old = getattr(h, name)
            arrays[name] = splice(old, old[h.tail_pos[src]])
        arrays["mask_pos"] = splice(h.mask_pos, new_pos)
        arrays["query_prefix"] = tree.query_prefix
    device = plan.device
    host = {k: np.ascontiguousarray(a, dtype=np.int32) for k, a in arrays.items()}
    t = {k: torch.from_numpy(a) for k, a in host.items()}  # CPU tensors share the host copies
    if device.type != "cpu":
        t = {k: a.to(device, non_blocking=True) for k, a in t.items()}
    heads = plan.heads
    per_token = heads.num_kv_heads * heads.head_dim * 2 * heads.elem_bytes
    added_tiles = int((arrays["work_kv_end"] - arrays["work_kv_start"]).sum()) - \
        int((h.work_kv_end - h.work_kv_start).sum())
    io = plan.io
    t["io"] = dataclasses.replace(
        io, kv=io.kv + added * per_token,
        kv_tile_rereads=io.kv_tile_rereads + (added_tiles - added) * per_token,
        index=io.index + added_tiles * 4 * heads.num_kv_heads,
        mask=io.mask + (added_tiles * 12 * heads.num_kv_heads if plan.has_mask else 0))
    t["min_slots"] = max(plan.min_slots, int(new_slots.max()) + 1)
    t["host"] = dataclasses.replace(
        h, kv_slots=host["kv_indices"], tail_pos=(h.tail_pos + inserted[1:]).astype(np.int32),
        mask_lo=host.get("mask_lo"), mask_hi=host.get("mask_hi"), mask_pos=host.get("mask_pos"),
        work_kv_start=host["work_kv_start"], work_kv_end=host["work_kv_end"], tree=tree)
    return dataclasses.replace(plan, **t)
