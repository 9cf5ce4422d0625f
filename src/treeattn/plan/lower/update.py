"""Lazy plan update (PAT Sec. 5.1): after a decode step appends tokens to nodes whose whole KV was
planned (typically every leaf gains one token), patch the plan instead of planning again.

Each grown node's new slots are spliced in right after every planned copy of its old last token,
so they join the work items that already read that node's tail (with the same queries, which now
see them too), and every work range is shifted by the tokens inserted before it. The structure
(items, query tiles, merge map, launches) is kept. Work is O(nodes + work units) plus one pass
over the tree's slots (to check that the old ones are unchanged; none for a tree made from the
plan's by :meth:`~treeattn.tree.decoding_tree.DecodingTree.append`) and one copy of the planned KV list; a
tree mask is rebuilt from its segments (the new entries lengthen the segments that end at their
tails), which is cheaper than splicing it.
"""
from __future__ import annotations

import numpy as np
import torch

from treeattn.plan.lower.addressing import beside_persistent, contig_launches, unit_runs
from treeattn.plan.lower.build import mask_rows
from treeattn.plan.format import Plan, PlanHost, masked_entries_by_unit
from treeattn.tree import DecodingTree

__all__ = ["update_plan"]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` for integer arrays of one dtype, a few times cheaper on small ones."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _grown(h: PlanHost, tree: DecodingTree) -> np.ndarray | None:
    """Tokens each node gained, or None when ``tree`` is not ``h.tree`` with tokens appended to
    some nodes: same parents and queries, queries that saw their whole node see it whole again,
    the others keep their prefix. (Whether the old tokens keep their slots is left to the
    caller.)"""
    old = h.tree
    if tree.page_size != old.page_size or tree.num_nodes != old.num_nodes or \
            tree.num_queries != old.num_queries:
        return None
    if not (_same(tree.parents, old.parents) and _same(tree.query_nodes, old.query_nodes)):
        return None
    grown = tree.lengths - old.lengths
    if grown.min() < 0:
        return None
    expect = np.where(h.saw_all, tree.lengths[old.query_nodes], old.query_prefix)
    return grown if _same(tree.query_prefix, expect) else None


def _replace(obj, **changes):
    """``dataclasses.replace`` for the frozen dataclasses here (none has ``__post_init__``) at a
    fraction of its cost: a new instance with the fields copied and the changed ones set."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    # (kept kernels belong to the plan's own tensors; inputs are checked against its own sizes)
    new.__dict__.pop("_launch_cache", None)
    new.__dict__.pop("_checked_inputs", None)
    return new


def _launches(plan: Plan, counts: np.ndarray, inserted: np.ndarray, new_slots: np.ndarray, host: dict) -> tuple:
    """:func:`~treeattn.plan.lower.addressing.contig_launches` of the patched plan (``host``: its KV list and
    ranges), from the tails inside each launch's KV range where they tell, without a pass over the
    KV list: a launch where nothing was inserted reads what it read (it keeps its launch); one
    whose first grown tail's first new slot does not follow the tail's slot has a unit that is no
    run (the pair of them lies inside the tail's unit), so it gathers. Otherwise every unit is
    checked.

    ``counts``, ``inserted`` and ``new_slots`` are the update's: entries inserted after each tail,
    their prefix sum and the new entries' slots, tail after tail."""
    h = plan.host
    out = []
    for ln, now in zip(h.gather_launches, plan.launches):
        # a launch's units hold its items one after the other (the builder makes no empty
        # launch): its tails are those from its first unit's start to its last one's end
        lo, hi = int(h.start_tails[ln.work_start]), int(h.end_tails[ln.work_end - 1])
        if inserted[hi] == inserted[lo]:
            out.append(now)
            continue
        k = lo + int(np.argmax(counts[lo:hi] > 0))
        if new_slots[inserted[k]] != h.kv_slots[h.tail_pos[k]] + 1:
            # configured as a fresh plan's launch with a unit that is no run
            gathers = contig_launches((ln,), np.zeros(ln.work_end, dtype=bool), plan.heads.num_kv_heads,
                                      profile=h.profile, has_mask=plan.has_mask, elem_bytes=plan.heads.elem_bytes,
                                      unit_tokens=np.zeros(ln.work_end, dtype=np.int64))[0]
            out.append(_with_hints(gathers, now))
        else:
            is_run = unit_runs(host["kv_indices"], host["work_kv_start"], host["work_kv_end"])
            out = [_with_hints(x, now) for x, now in zip(
                contig_launches(h.gather_launches, is_run, plan.heads.num_kv_heads, profile=h.profile,
                                has_mask=plan.has_mask, elem_bytes=plan.heads.elem_bytes,
                                unit_tokens=host["work_kv_end"] - host["work_kv_start"]), plan.launches)]
            break
    # (launches reconfigured beside a persistent one take its neighbours' tile again)
    return beside_persistent(out, group=plan.heads.group, profile=h.profile)


def _with_hints(launch, now):
    """``launch`` with the patched plan's ``split_tail`` hint (kept, not re-checked: grown units may
    end in a partial tile, which the kernel runs after the loop), its persistence and persistent
    tile where it still gathers (:func:`~treeattn.plan.lower.addressing.persistent_tall`: grown leaves
    only add to the leaf launches) and, where it still reads runs, its TMA tile and persistence
    (grown units are no shorter: :func:`~treeattn.plan.lower.addressing.tma_launches`)."""
    if now.programs and not launch.contig and not now.tma:
        launch = _replace(launch, programs=now.programs, block_n=now.block_n, num_warps=now.num_warps,
                          num_stages=now.num_stages)
    if now.tma and launch.contig:
        return _replace(launch, block_n=now.block_n, num_warps=now.num_warps, num_stages=now.num_stages,
                        split_tail=True, tma=True, programs=now.programs)
    return _replace(launch, split_tail=now.split_tail) if launch.split_tail != now.split_tail else launch


def update_plan(plan: Plan, tree: DecodingTree) -> Plan | None:
    """``plan`` patched for ``tree`` (``plan``'s tree with tokens appended to some nodes), or None
    when the change is not such an append (the caller then plans again).

    Appends to a node whose tail no work item reads (nobody saw it) also return None.
    """
    h = plan.host
    if h is None:
        return None
    old = h.tree
    grown = tree.appended_to(old)
    checked = grown is not None  # made by old.append(): nothing else changed
    if not checked:
        grown = _grown(h, tree)
        if grown is None:
            return None
    appended = tree.kv_indices.size - old.kv_indices.size  # == grown.sum()
    if appended == 0:
        return plan if np.array_equal(tree.kv_indices, old.kv_indices) else None
    counts = grown[h.tail_node]  # tokens appended after each planned tail (0: not grown)
    inserted = np.zeros(counts.size + 1, dtype=counts.dtype)  # inserted[k]: after tails[:k]
    counts.cumsum(out=inserted[1:])  # (a cumsum into another dtype costs 3x more than the cast)
    inserted = inserted.astype(np.int32)  # (so the patched ranges stay int32)
    added = int(inserted[-1])
    # new entry i (the j-th of tail k, so i = inserted[k] + j) goes right after that tail, which
    # moves to tail_pos[k] + inserted[k]; it holds token kv_indptr[node + 1] - counts[k] + j
    src = np.arange(counts.size).repeat(counts)  # k of each new entry
    i = np.arange(added)
    token = (tree.kv_indptr[1:][h.tail_node] - inserted[1:])[src] + i
    if checked:
        # every grown node needs a planned tail (one nobody read has no entry to follow)
        if grown[h.untailed].any():
            return None
    else:
        # the new entries name the appended tokens of every grown node with a planned tail (some
        # more than once); the other tokens must be the old slots, in order (so a grown node whose
        # tail no item reads leaves too many: plan again)
        old_token = np.ones(tree.kv_indices.size, dtype=bool)
        old_token[token] = False
        if not np.array_equal(tree.kv_indices[old_token], old.kv_indices):
            return None
    new_at = h.tail_pos[src] + (i + 1)
    kv = np.ones(h.kv_slots.size + added, dtype=bool)  # where the old entries go
    kv[new_at] = False
    new_slots = tree.kv_indices[token]
    host = {"kv_indices": np.empty(kv.size, dtype=np.int32)}
    host["kv_indices"][kv] = h.kv_slots
    host["kv_indices"][new_at] = new_slots
    # a range [s, e) moves by the tokens inserted after the tails before s (its end: before e)
    host["work_kv_start"] = h.work_kv_start + inserted[h.start_tails]
    host["work_kv_end"] = h.work_kv_end + inserted[h.end_tails]
    seg = {}
    if plan.has_mask:
        # so does a mask start: the entries inserted before it extend a segment every row of the
        # unit saw whole, and still do (only a query that saw its whole node sees what it gained)
        host["work_mask_start"] = h.work_mask_start + inserted[h.mask_tails]
        # the new entries extend the segments ending at their tails: rebuild the mask by segment
        # (tin/tout depend on the parents only)
        seg_len = h.seg_len.copy()
        seg_len[h.tail_seg] += counts
        seg = {"seg_len": seg_len}
        host["tree_mask"] = mask_rows(h.seg_rec, seg_len, seg_len.cumsum() - seg_len)
        host["query_prefix"] = tree.query_prefix.astype(np.int32)
    t = {k: torch.from_numpy(a) for k, a in host.items()}  # CPU tensors share the host copies
    device = plan.device
    if device.type != "cpu":
        t = {k: a.to(device, non_blocking=True) for k, a in t.items()}
    if not plan.has_mask:  # the mask starts are the ends (and never read)
        host["work_mask_start"], t["work_mask_start"] = host["work_kv_end"], t["work_kv_end"]
    heads = plan.heads
    per_token = heads.num_kv_heads * heads.head_dim * 2 * heads.elem_bytes
    added_tiles = int(counts @ h.tail_cover)  # each work unit over a tail reads its new entries
    io = plan.io
    t["io"] = _replace(
        io, kv=io.kv + added * per_token,
        kv_tile_rereads=io.kv_tile_rereads + (added_tiles - added) * per_token,
        index=io.index + added_tiles * 4 * heads.num_kv_heads,
        mask=masked_entries_by_unit(host["work_kv_start"], host["work_mask_start"], host["work_kv_end"],
                                    h.unit_mask) * 12 * heads.num_kv_heads if plan.has_mask else 0)
    t["min_slots"] = max(plan.min_slots, int(new_slots.max()) + 1)
    if any(ln.contig for ln in plan.launches):
        # appended slots rarely follow their tail's: those units gather their slots again (a
        # unit that was not a run stays one, so plans without contig launches skip the check)
        t["launches"] = _launches(plan, counts, inserted, new_slots, host)
    t["host"] = _replace(
        h, kv_slots=host["kv_indices"], tail_pos=h.tail_pos + inserted[1:],
        work_kv_start=host["work_kv_start"], work_kv_end=host["work_kv_end"],
        work_mask_start=host["work_mask_start"], tree=tree, **seg)
    return _replace(plan, **t)
