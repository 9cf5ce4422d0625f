"""The leads of path tiles: the tokens every query of a tile sees whole, first in the tile.

``paths``' split variants cut each tile at its lead (:func:`cut_at_leads`): the lead, unmasked,
may be split into KV chunks, the rest keeps the tree mask. Where the leads are the tree's trunk
(:func:`trunk_tokens`: a token tree over one context), they are also cut into a few longer chunks
(:data:`LEAD_CHUNKS`), and a lead that ends in a few tokens off the context's run of KV slots
keeps only the run (:func:`run_leads`), so the launch over its chunks takes affine addresses.
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.lower.addressing import runs_between
from treeattn.plan.strategies.items import DeferredItems, WorkItems, _indptr
from treeattn.tree.topology import ranges
from treeattn.tree import DecodingTree

__all__ = ["LEAD_CHUNKS", "RUN_LEAD_SLACK", "cut_at_leads", "on_runs", "run_leads", "run_tokens",
           "splittable_lengths", "trunk_leads", "trunk_tokens"]

#: a trunk lead keeps only its run of consecutive KV slots where at most this many of its last
#: tokens lie elsewhere (:func:`run_leads`: a token tree's shared first drafts)
RUN_LEAD_SLACK = 16
#: where the leads are the tree's trunk (a token tree over one context: every tile reads the same
#: context), the split variants also cut them into this many chunks of the longest lead. On Medusa
#: trees the fill split's chunks were too short (t=256 at 800-2500 tokens: 1.18-1.22x faster with
#: these, on an H100); on decode trees whose tiles read different leads the cost model picked them
#: where they ran 2-13% slower.
#: 2 chunks pay where the chunks' launch loads through TMA, which the model rates where the leads
#: are known runs (:func:`on_runs`; Medusa trees 128@800 and 256@2500-3000 on an H100)
LEAD_CHUNKS = (2, 3, 4, 6)


def cut_at_leads(items: WorkItems, at: np.ndarray | None = None) -> tuple[WorkItems, np.ndarray]:
    """``items`` with each masked item of a known lead (:attr:`WorkItems.mask_lead`, on a segment
    boundary) cut in two: its lead, which every query of it sees whole (unmasked), and the rest;
    and bool [new items]: the items that may be split into KV chunks whose queries all see them
    (the leads and the unmasked items). The segments are made when first read.

    ``at`` (int64 [items], default the leads) cuts each item there instead: a segment boundary
    within its lead (:func:`run_leads`)."""
    lead, masked = items.mask_lead if at is None else at, items.masked
    n = items.num_items
    cut = masked & (lead > 0)
    parts = cut + 1  # (1 or 2 new items an item; each gather below is taken once)
    base = _indptr(parts)[:-1]
    src = np.arange(n).repeat(parts)
    lead_at = base[cut]
    is_lead = np.zeros(src.size, dtype=bool)
    is_lead[lead_at] = True
    is_tail = np.zeros(src.size, dtype=bool)
    is_tail[lead_at + 1] = True
    src_lead = lead[src]
    length = items.item_len[src]
    length = np.where(is_lead, src_lead, np.where(is_tail, length - src_lead, length))
    nq = items.item_queries[src]
    new_lead = np.where(is_tail, 0, src_lead)
    new_masked = np.where(is_lead, False, masked[src])

    def make() -> WorkItems:
        nseg = items.seg_indptr[1:] - items.seg_indptr[:-1]
        seg_item = np.arange(n).repeat(nseg)
        seg_end = np.cumsum(items.seg_hi - items.seg_lo)
        seg_end -= np.append(0, seg_end)[items.seg_indptr[:-1]][seg_item]  # ends within the item
        seg_new = base[seg_item] + (cut[seg_item] & (seg_end > lead[seg_item]))
        q = ranges(items.q_indptr[src], items.q_indptr[src + 1])
        lead_q = src_lead.repeat(nq)
        q_tokens = items.q_tokens[q]
        q_tokens = np.where(is_lead.repeat(nq), lead_q, np.where(is_tail.repeat(nq), q_tokens - lead_q, q_tokens))
        return WorkItems(_indptr(np.bincount(seg_new, minlength=src.size)), items.seg_node, items.seg_lo,
                         items.seg_hi, _indptr(nq), items.q_indices[q], q_tokens, new_masked, new_lead)

    return _CutItems(length, nq, make, masked=new_masked, mask_lead=new_lead, source=items, base=base), ~new_masked


class _CutItems(DeferredItems):
    """:func:`cut_at_leads`' items: item ``i`` of ``source`` became the items ``base[i]`` to
    ``base[i + 1] - 1`` (one or two), each with all its queries, so a query's merge rows and
    weights are its source items' (no (item, query) pairs listed)."""

    def __init__(self, *args, source: WorkItems, base: np.ndarray, **kwargs):
        super().__init__(*args, **kwargs)
        self.__dict__.update(source=source, base=base)

    def merge_rows_max(self, used: np.ndarray) -> int:
        rows = self.query_weights(used)
        return int(rows.max()) if rows.size else 0

    def query_weights(self, per_item: np.ndarray) -> np.ndarray:
        # (float64 sums of small integers: exact, as the pairs' bincount)
        return self.source.query_weights(np.add.reduceat(per_item, self.base, dtype=np.float64))


def splittable_lengths(items: WorkItems, at: np.ndarray | None = None) -> np.ndarray:
    """The lengths of the items of :func:`cut_at_leads` (cut ``at``) that may be split (its second
    value), in some order: the leads of the items it cuts and the unmasked items, without cutting
    them."""
    lead, masked = items.mask_lead if at is None else at, items.masked
    return np.where(masked, lead, items.item_len)[~masked | (lead > 0)]


def run_leads(tree: DecodingTree, items: WorkItems) -> np.ndarray | None:
    """int64 [items]: where :func:`cut_at_leads` should cut ``items`` (path tiles) so that their
    leads read one run of consecutive KV slots; None where no lead changes.

    A lead whose last few tokens (at most :data:`RUN_LEAD_SLACK`, whole nodes) lie elsewhere in
    the pool than the run before them (a token tree's first drafts in the engine's scratch slots,
    after a context of consecutive slots) keeps only the run, and those tokens go to the rest of
    the tile (masked anyway): a launch takes affine addresses only when all its units are runs
    (:func:`~treeattn.plan.lower.addressing.contig_launches`), and one such lead kept the whole launch
    of a Medusa tree's context chunks gathered."""
    lead = items.mask_lead
    first, run = _first_runs(tree, items)
    has = (lead > 0) & items.masked & (first >= 0)
    run = np.minimum(lead, run)
    moved = has & (run > 0) & (run < lead) & (lead - run <= RUN_LEAD_SLACK)
    return np.where(moved, run, lead) if moved.any() else None


def on_runs(tree: DecodingTree, items: WorkItems, at: np.ndarray | None = None) -> bool:
    """Whether every item that :func:`cut_at_leads` (cut ``at``) leaves unmasked reads one run of
    consecutive KV slots, for path tiles over every node (no nodes apart): a tile's lead, and a
    tile all of whose queries see it whole, are the first tokens of its first query's path."""
    first, run = _first_runs(tree, items)
    read = np.where(items.masked, items.mask_lead if at is None else at, items.item_len)
    return bool(((read <= run) | (first < 0)).all())


def _first_runs(tree: DecodingTree, items: WorkItems) -> tuple[np.ndarray, np.ndarray]:
    """int64 [items] twice: each item's first query (-1: none) and :func:`run_tokens` of its path."""
    q_item, q_query = items.pairs()
    first = np.full(items.num_items, -1, dtype=np.int64)
    first[q_item[::-1]] = q_query[::-1]  # (each item's first query: the last write wins)
    return first, run_tokens(tree)[tree.effective_queries[0][np.maximum(first, 0)]]


def run_tokens(tree: DecodingTree) -> np.ndarray:
    """int64 [nodes]: how many of the tokens on each node's root path (its ancestors' and its own)
    lie in one run of consecutive KV slots from the path's first token, counted in whole nodes
    (made once per tree)."""
    got = tree.derived.get("run_tokens")
    if got is None:
        got = tree.derived["run_tokens"] = _run_tokens(tree)
    return got


def _run_tokens(tree: DecodingTree) -> np.ndarray:
    topo, length, kv = tree.topology, tree.lengths, tree.kv_indices
    above = topo.path_tokens
    full = above + length
    if kv.size == 0:
        return full
    start = tree.kv_indptr[:-1]
    nonempty = length > 0
    # a node continues its path's run when its own slots are one run and its first slot is the
    # path's first slot plus the tokens above it: the same offset as the path's head (its topmost
    # node with tokens)
    offset = kv[np.minimum(start, kv.size - 1)] - above
    head = np.flatnonzero(nonempty & (above == 0))
    head = head[np.argsort(topo.tin[head])]  # (their subtrees are disjoint)
    at = np.maximum(np.searchsorted(topo.tin[head], topo.tin, side="right") - 1, 0)
    inner_run = runs_between(tree.slot_breaks, start, tree.kv_indptr[1:])
    bad = np.flatnonzero(nonempty & (~inner_run | (offset != offset[head[at]])))
    if bad.size == 0:
        return full
    # each node's run ends at its topmost bad ancestor-or-self (the outermost bad subtrees)
    bad = bad[np.argsort(topo.tin[bad])]
    outer = bad[topo.tin[bad] >= np.concatenate(([0], np.maximum.accumulate(topo.tout[bad])[:-1]))]
    j = np.maximum(np.searchsorted(topo.tin[outer], topo.tin, side="right") - 1, 0)
    inside = (topo.tin >= topo.tin[outer[j]]) & (topo.tin < topo.tout[outer[j]])
    return np.where(inside, above[outer[j]], full)


def trunk_tokens(tree: DecodingTree) -> int:
    """Tokens that every query sees (those of the nodes above all the queries; 0 in a forest)."""
    got = tree.derived.get("trunk_tokens")
    if got is None:
        got = tree.derived["trunk_tokens"] = _trunk_tokens(tree)
    return got


def _trunk_tokens(tree: DecodingTree) -> int:
    above_all = np.flatnonzero(tree.subtree_queries == tree.num_queries)
    if tree.num_queries == 0 or above_all.size == 0:
        return 0
    deepest = above_all[np.argmax(tree.topology.depth[above_all])]
    eff_node, eff_prefix = tree.effective_queries
    at = eff_node == deepest
    seen = int(eff_prefix[at].min()) if at.any() else int(tree.lengths[deepest])
    return int(tree.topology.path_tokens[deepest]) + seen


def trunk_leads(tree: DecodingTree, leads: np.ndarray) -> bool:
    """Whether two tiles or more read the tree's trunk as their leads (each at most a KV block
    longer: the tiles of a token tree may share its first draft tokens)."""
    trunk = trunk_tokens(tree)
    return trunk > 0 and int((leads >= trunk).sum()) > 1 and int(leads.max()) <= trunk + 16
