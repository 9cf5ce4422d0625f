"""Per-step attention planning for the engine: host planning, one pinned host-to-device copy per
plan, ``auto`` decisions reused while the tree keeps its shape, PAT's lazy update of the last plan
when the tree only grew at planned tails (a speculative verify loop: the context gains the
accepted tokens, the draft tree keeps its scratch slots), and *decode windows*.

A decode window plans ``K`` steps at once: every query's node already holds the slots of its next
``K`` tokens, the plan carries a tree mask, and before each step only the device-side
``query_prefix`` (how many of its own node's tokens each query sees) is advanced. This is exact:
planners keep every (work item, query) pair the final prefix can see, and the mask hides the
not-yet-written tokens.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from treeattn import CostModel, DecodingTree, HeadConfig, Plan, make_plan
from treeattn.plan.format import masked_entries, split_masked_launches, unit_mask_terms
from treeattn.plan.lower.build import mask_rows, segment_records
from treeattn.plan.lower.tensors import plan_to_device
from treeattn.plan.lower.update import update_plan
from treeattn.tree.topology import ranges, slot_breaks

__all__ = ["StepPlanner", "upload"]

def upload(arr: np.ndarray, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """``arr`` as a tensor on ``device``; CUDA copies go through pinned memory without blocking."""
    t = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _entry_segments(slots: np.ndarray, tree: DecodingTree) -> tuple:
    """A plan's KV list ``slots`` (int ``[nnz]``, each a slot of ``tree``) as segments: runs of
    consecutive entries holding consecutive tokens of one node. Returns int64 ``(entry, count,
    node, pos)`` [S]: each segment's first entry, its entries, its node and the position in that
    node of its first entry.

    The tree's tokens are cut into pieces (runs of consecutive slots within one node) and each
    run of consecutive slots of the list into the pieces it spans: a few hundred segments where
    the per-entry lookups they replace touched every one of tens of thousands of entries.
    """
    kv, indptr = tree.kv_indices, tree.kv_indptr
    n_tok = kv.size
    # pieces: the tree's runs of slots cut at node starts (empty nodes' starts coincide)
    piece = np.union1d(tree.slot_breaks, indptr[:-1])
    piece = piece[piece < n_tok]
    piece_len = np.diff(piece, append=n_tok)
    piece_node = indptr.searchsorted(piece, side="right") - 1
    by_slot = np.argsort(kv[piece], kind="stable")
    first = kv[piece][by_slot]
    last = first + piece_len[by_slot]        # (one past each piece's last slot)
    if (first[1:] < last[:-1]).any():
        raise RuntimeError("cannot build a tree mask: the tree's slots are not unique")
    # the list's runs of slots, and the pieces each spans (those must be contiguous in slots)
    run = np.concatenate(([0], slot_breaks(slots)))
    run_len = np.diff(run, append=slots.size)
    run_first = slots[run].astype(np.int64)
    lo = first.searchsorted(run_first, side="right") - 1
    hi = first.searchsorted(run_first + run_len - 1, side="right") - 1
    gaps = np.concatenate(([0], np.cumsum(first[1:] != last[:-1])))
    if (lo < 0).any() or (gaps[hi] != gaps[lo]).any() or (run_first + run_len > last[hi]).any():
        raise RuntimeError("cannot build a tree mask: the plan's slots do not map to unique tokens")
    spans = hi - lo + 1
    p = ranges(lo, hi + 1)
    r = np.repeat(np.arange(run.size), spans)
    seg_first = np.maximum(run_first[r], first[p])
    seg_len = np.minimum(run_first[r] + run_len[r], last[p]) - seg_first
    entry = run[r] + seg_first - run_first[r]
    at = by_slot[p]
    return entry, seg_len, piece_node[at], piece[at] - indptr[piece_node[at]] + seg_first - first[p]


class StepPlanner:
    """Plans decode steps of one model shape.

    Parameters
    ----------
    heads : treeattn.HeadConfig
    strategy : str
        One of :data:`treeattn.STRATEGIES`.
    device : torch.device
        Where plans are used.
    cost : treeattn.CostModel, optional
    auto_refresh : int
        With ``strategy="auto"``, the concrete strategy auto picks is reused for up to this many
        plans while the tree's nodes, queries, KV tokens and sharing (tokens read by all queries
        over distinct tokens) stay within the same powers of two (1: decide every plan). A plan
        without a decode window is also patched (:func:`~treeattn.plan.lower.update.update_plan`) for
        up to this many following trees that only append tokens to its planned tails, while
        that shape key holds.
    """

    def __init__(self, heads: HeadConfig, *, strategy: str, device, cost: CostModel | None = None,
                 auto_refresh: int = 32):
        self.heads = heads
        self.strategy = strategy
        self.device = torch.device(device)
        self.cost = cost or CostModel()
        self.auto_refresh = max(1, int(auto_refresh))
        self._auto: tuple | None = None       # (shape key, chosen strategy, plans left)
        self._last: tuple | None = None       # (host plan, shape key, updates left) for update_plan
        self.last_ms = 0.0
        self.last_reason = ""
        self.last_patched = False             # the last plan was the one before it, patched

    @staticmethod
    def _shape_key(tree: DecodingTree) -> tuple:
        # a speculative verify loop keeps its nodes and queries while the prefix grows from a few
        # tokens (sequence wins) to thousands (prefix-aware plans win): decide again per octave.
        # A serving batch changes its requests every few steps: deciding again each time cost
        # `auto` ~1 ms a step over `sequence` at 3 req/s (measured on an H200)
        sharing = int(tree.visible_tokens.sum()) * 4 // max(1, int(tree.num_tokens))
        return (int(tree.num_nodes).bit_length(), int(tree.num_queries).bit_length(),
                int(tree.num_tokens).bit_length(), sharing.bit_length())

    def _choose(self, key: tuple | None) -> str:
        """The strategy to plan with: ``auto``'s last choice while its shape key holds."""
        if key is None:
            return self.strategy
        if self._auto is not None and self._auto[0] == key and self._auto[2] > 0:
            self._auto = (key, self._auto[1], self._auto[2] - 1)
            return self._auto[1]
        return "auto"

    def plan(self, tree: DecodingTree, *, first_prefix: np.ndarray | None = None) -> Plan:
        """Plan ``tree`` and move the plan to the device.

        With ``first_prefix`` (int ``[num_queries]``: how many of its own node's tokens each query
        sees at the window's first step; ``tree.query_prefix`` is what it sees at the last) the
        plan always carries a tree mask and a private ``query_prefix`` tensor that
        :meth:`set_prefix` rewrites (decode windows).
        """
        t0 = time.perf_counter()
        plan = plan_to_device(self.plan_host(tree, first_prefix=first_prefix), self.device)
        self.last_ms = (time.perf_counter() - t0) * 1e3
        return plan

    def plan_host(self, tree: DecodingTree, *, first_prefix: np.ndarray | None = None) -> Plan:
        """:meth:`plan` without the move to the device: host work only, so that it can run on a
        background thread (the engine plans its next decode window there) while the caller's
        thread keeps the device busy or captures CUDA graphs. One call at a time per planner."""
        key = self._shape_key(tree) if self.strategy == "auto" else None
        patched = self._update(tree, key) if first_prefix is None else None
        self.last_patched = patched is not None
        if patched is not None:
            return patched
        self._last = None
        strategy = self._choose(key)
        plan = make_plan(tree, self.heads, strategy=strategy, device="cpu", cost=self.cost)
        if strategy == "auto":
            self._auto = (key, plan.strategy, self.auto_refresh - 1)
        self.last_reason = plan.reason
        if first_prefix is not None:
            return self._masked(plan, tree, np.asarray(first_prefix, dtype=np.int64))
        self._last = (plan, key, self.auto_refresh - 1)
        return plan

    def to_device(self, plan: Plan) -> Plan:
        """A host plan (:meth:`plan_host`) on the planner's device."""
        return plan_to_device(plan, self.device)

    def _update(self, tree: DecodingTree, key: tuple | None) -> Plan | None:
        """The last plan patched for ``tree`` (a host plan), or None where that is not allowed or
        ``tree`` is not the last one with tokens appended at planned tails."""
        if self._last is None:
            return None
        last, last_key, left = self._last
        if left <= 0 or last_key != key:
            return None
        plan = update_plan(last, tree)
        if plan is not None:
            self._last = (plan, key, left - 1)
        return plan

    def set_prefix(self, plan: Plan, prefix: np.ndarray) -> None:
        """Let query ``j`` of ``plan`` see ``prefix[j]`` tokens of its own node (no host sync)."""
        src = torch.from_numpy(np.ascontiguousarray(prefix, dtype=np.int32))
        if self.device.type == "cpu":
            plan.query_prefix.copy_(src)
        else:
            plan.query_prefix.copy_(src.pin_memory(), non_blocking=True)

    @staticmethod
    def _masked(plan: Plan, tree: DecodingTree, first_prefix: np.ndarray) -> Plan:
        """``plan`` with a tree mask (built from the tree when the planner made none), a private
        query_prefix tensor, and the mask applied by every launch that reads a token some step
        of the window hides: position ``p >= first_prefix[j]`` of query ``j``'s own node, each
        work unit from its first such entry (or the builder's mask start, if earlier) on."""
        topo, h = tree.topology, plan.host
        # per segment of the KV list, not per entry (tens of thousands in a served batch)
        seg_kv, seg_len, node, pos = _entry_segments(h.kv_slots, tree)
        # the first token a step of the window hides, per node (queries of one node share it)
        hide_from = np.full(tree.num_nodes, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(hide_from, tree.query_nodes, first_prefix)
        # a segment's positions ascend: its hidden entries are a suffix [hid_start, seg end)
        seg_end = seg_kv + seg_len
        hid_start = seg_kv + np.clip(hide_from[node] - pos, 0, seg_len)
        some = hid_start < seg_end
        hid_start, hid_end = hid_start[some], seg_end[some]
        start, end = h.work_kv_start, h.work_kv_end
        # each unit's first hidden entry at or after its start (the list's end if none)
        after = hid_end.searchsorted(start, side="right")
        first_hidden = np.maximum(np.append(hid_start, h.kv_slots.size)[after], start)
        unit_hidden = first_hidden < end
        # each unit's mask starts at its first hidden entry, or earlier where the builder's does
        # (a plan built without a mask has its starts at the ends)
        mask_start = np.minimum(h.work_mask_start, first_hidden).astype(np.int32)

        def masked(launches):
            # a launch the builder flagged keeps its flag: some query sees part of its items already
            return split_masked_launches(tuple(dataclasses.replace(ln, masked=bool(
                (plan.has_mask and ln.masked) or unit_hidden[ln.work_start: ln.work_end].any()))
                for ln in launches), start, mask_start)

        launches = masked(plan.launches)
        hkv = plan.heads.num_kv_heads
        io = dataclasses.replace(plan.io, mask=masked_entries(start, mask_start, end, launches) * 12 * hkv)
        common = dict(query_prefix=torch.from_numpy(tree.query_prefix.astype(np.int32)), launches=launches,
                      work_mask_start=torch.from_numpy(mask_start), io=io,
                      host=dataclasses.replace(h, work_mask_start=mask_start,
                                               mask_tails=np.searchsorted(h.tail_pos, mask_start),
                                               unit_mask=unit_mask_terms(launches, plan.num_work),
                                               gather_launches=masked(h.gather_launches)))
        if plan.has_mask:
            return dataclasses.replace(plan, **common)

        def i32(a):
            return torch.from_numpy(np.asarray(a, dtype=np.int32))

        # (the Plan.tree_mask record of each entry: one per segment, repeated)
        rec = mask_rows(segment_records(topo.tin[node], topo.tout[node], pos), seg_len, seg_kv)
        return dataclasses.replace(plan, tree_mask=torch.from_numpy(rec),
                                   query_pos=i32(topo.tin[tree.query_nodes]), **common)
