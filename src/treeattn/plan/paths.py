"""``paths``: query tiles that read the union of their queries' paths.

With grouped-query attention a query's partial results can cost more than its KV: at 64/8 heads a
tree of 1024 leaves under six levels of shared nodes gives each query seven partial rows of
``hq x head_dim`` to write, read and merge (~50 MB a level) against ~100 MB of KV in all, and
each level loads the query again. Here consecutive queries (depth-first) fill one query tile, and
the tile's work item is the union of their paths, root first: a shared node is read once per tile
(the tiles under it run together, so mostly from L2), each query keeps to its own path through
the tree mask, and it has one row, written directly (no merge), instead of one per node.

A node whose rows fill only part of a tile wastes the rest of the tile's rows on its tokens
(masked). Long such nodes (a private leaf of 256 tokens) stay items of their own, as ``node``'s,
in the variants that keep them apart. When the tiles' programs cannot fill the GPU, variants cut
each tile at its mask lead and split the leads into KV chunks (one row per chunk); where the
leads are the tree's trunk (a token tree over one context), also into a few longer chunks.
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.auto import best_variant
from treeattn.plan.cost import CostModel
from treeattn.plan.items import DeferredItems, WorkItems, _indptr, _same, concat_items, masked_flags
from treeattn.plan.node import node_items
from treeattn.plan.plan import HeadConfig, _block_m_choices
from treeattn.plan.query_ranges import query_ranges
from treeattn.plan.split import fill_length, split_long_items
from treeattn.topology import ranges
from treeattn.tree import DecodingTree

#: 16-row path tiles only for GQA groups of this size or more (at most 4 queries a tile): on the
#: kernel suite they were the fastest plan of the smallest trees at 32/8 and 64/8, while at 32/32
#: the cost model rated them best on deep trees where they ran up to 12% slower than 32-row tiles
#: (results/h200_probe_paths.json, h200_kernels.json at abd268c)
SHORT_TILE_MIN_GROUP = 4
#: a node with fewer rows than the query tile stays an item of its own beyond this many tokens
#: (in the variants that keep such nodes apart)
OWN_ITEM_TOKENS = 64
#: a trunk lead keeps only its run of consecutive KV slots where at most this many of its last
#: tokens lie elsewhere (:func:`run_leads`: a token tree's shared first drafts)
RUN_LEAD_SLACK = 16
#: where the leads are the tree's trunk (a token tree over one context: every tile reads the same
#: context), the split variants also cut them into this many chunks of the longest lead. On Medusa
#: trees the fill split's chunks were too short (t=256 at 800-2500 tokens: 1.18-1.22x faster with
#: these, results/h100_probe_spec_{b21eca5,011377d}.json); on decode trees whose tiles read
#: different leads the cost model picked them where they ran 2-13% slower (h100_probe_lead_*.json).
#: (Measured with 2 chunks as well, which the model picked for no Medusa tree at 32/8 or 32/32.)
LEAD_CHUNKS = (3, 4, 6)
#: the split length of items not to split (np.iinfo costs microseconds a call)
_NEVER = int(np.iinfo(np.int64).max)


def path_tiles(tree: DecodingTree, heads: HeadConfig, rows: int, own: np.ndarray | None = None) -> WorkItems:
    """Work items of query tiles of up to ``rows`` rows (queries x GQA group, consecutive in
    depth-first order), each reading the union of its queries' paths over the nodes not flagged in
    ``own`` (bool [N]); then one item per flagged node with visible tokens (``node``'s).

    A tile's segments are its nodes in pre-order (a node before its descendants), each up to the
    last token one of the tile's queries sees."""
    tiles = (_whole_path_tiles if _whole_paths(tree) else _pair_path_tiles)(tree, heads, rows, own)
    return tiles if own is None or not own.any() else concat_items(tiles, _own_items(tree, own))


def _pair_path_tiles(tree: DecodingTree, heads: HeadConfig, rows: int, own: np.ndarray | None) -> WorkItems:
    """:func:`path_tiles`' tiles (without the nodes apart), from the (query, node) pairs."""
    topo = tree.topology
    eff_node, eff_prefix = tree.effective_queries
    per_tile = max(1, rows // heads.group)
    nq = tree.num_queries
    # depth-first order of the queries: by the pre-order number of their node, then by prefix
    order = np.lexsort((eff_prefix, topo.tin[eff_node]))
    tile = np.empty(nq, dtype=np.int64)
    tile[order] = np.arange(nq) // per_tile
    num_tiles = -(-nq // per_tile)
    q, node, visible = tree.visible_pairs
    if own is not None:
        keep = ~own[node]
        q, node, visible = q[keep], node[keep], visible[keep]
    # one segment per (tile, node), up to the furthest token a query of the tile sees
    key = tile[q] * tree.num_nodes + topo.tin[node]
    by_key = np.argsort(key, kind="stable")
    key = key[by_key]
    first = np.empty(key.size, dtype=bool)
    first[:1] = True
    np.not_equal(key[1:], key[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    seg_tile = key[starts] // tree.num_nodes
    seg_node = node[by_key[starts]]
    seg_hi = np.maximum.reduceat(visible[by_key], starts) if starts.size else starts
    q_tokens = np.bincount(q, visible, minlength=nq).astype(np.int64)[order]
    item_len = np.bincount(seg_tile, seg_hi, minlength=num_tiles).astype(np.int64)
    q_counts = np.bincount(tile, minlength=num_tiles)
    seg_indptr = _indptr(np.bincount(seg_tile, minlength=num_tiles))
    # the mask starts at the tile's first segment that one of its queries does not see whole
    whole = np.diff(np.append(starts, key.size)) == q_counts[seg_tile]
    if starts.size:
        whole &= np.minimum.reduceat(visible[by_key], starts) == seg_hi
    broken = (~whole).cumsum()
    before = np.append(0, broken)[seg_indptr[:-1]][seg_tile]  # broken segments before the tile's
    lead = np.bincount(seg_tile, seg_hi * (broken == before), minlength=num_tiles).astype(np.int64)
    return WorkItems(seg_indptr, seg_node, np.zeros_like(seg_node), seg_hi, _indptr(q_counts), order, q_tokens,
                     lead < item_len, lead).with_item_len(item_len)


def _whole_path_tiles(tree: DecodingTree, heads: HeadConfig, rows: int, own: np.ndarray | None) -> WorkItems:
    """:func:`path_tiles`' tiles (without the nodes apart) when every query sees each node of its
    path whole: a node is in the tiles its range of queries (depth-first) meets, so the segments
    come from the nodes, not from the (query, node) pairs."""
    nq = tree.num_queries
    per_tile = max(1, rows // heads.group)
    num_tiles = -(-nq // per_tile)
    order, seen, node_lo, node_hi = _query_ranges(tree)
    keep = np.zeros(tree.num_nodes, dtype=bool)
    keep[seen] = True
    if own is not None:
        keep &= ~own
    pre = tree.topology.order
    node = pre[keep[pre]]  # in pre-order
    lo, hi = node_lo[node], node_hi[node]
    first, last = lo // per_tile, (hi - 1) // per_tile
    span = last - first + 1
    seg_node = node.repeat(span)
    seg_tile = np.arange(seg_node.size) + (first - (span.cumsum() - span)).repeat(span)
    # a stable sort by tile keeps each tile's nodes in pre-order (16-bit keys: a radix sort)
    by_tile = np.argsort(seg_tile.astype(np.uint16) if num_tiles <= 1 << 16 else seg_tile, kind="stable")
    seg_tile, seg_node = seg_tile[by_tile], seg_node[by_tile]
    seg_hi = tree.lengths[seg_node]
    item_len = np.bincount(seg_tile, seg_hi, minlength=num_tiles).astype(np.int64)
    q_counts = np.full(num_tiles, per_tile, dtype=np.int64)
    q_counts[-1] = nq - (num_tiles - 1) * per_tile
    # a node all of whose tile's queries see it covers the tile's ranks; those nodes are the
    # tile's common ancestors, which come first in pre-order: the lead
    tile_lo = seg_tile * per_tile
    whole = (lo.repeat(span)[by_tile] <= tile_lo) & (hi.repeat(span)[by_tile] >= np.minimum(tile_lo + per_tile, nq))
    lead = np.bincount(seg_tile, seg_hi * whole, minlength=num_tiles).astype(np.int64)
    q_tokens = tree.visible_tokens[order]
    if own is not None and own.any():
        # less the tokens of the nodes apart on each query's path (ranks lo..hi-1 of such a node)
        apart = np.flatnonzero(own & (node_hi > node_lo))
        size = tree.lengths[apart]
        step = np.bincount(node_lo[apart], size, nq + 1) - np.bincount(node_hi[apart], size, nq + 1)
        q_tokens = q_tokens - step.cumsum()[:-1].astype(np.int64)
    return WorkItems(_indptr(np.bincount(seg_tile, minlength=num_tiles)), seg_node, np.zeros_like(seg_node), seg_hi,
                     _indptr(q_counts), order, q_tokens, lead < item_len, lead).with_item_len(item_len)


def _own_items(tree: DecodingTree, own: np.ndarray) -> WorkItems:
    """``node``'s items of the nodes flagged in ``own`` (node items have one segment each)."""
    nodes = node_items(tree)
    return nodes.take(np.flatnonzero(own[nodes.seg_node]))


def deferred_path_tiles(tree: DecodingTree, heads: HeadConfig, rows: int, own: np.ndarray | None = None
                        ) -> WorkItems:
    """:func:`path_tiles`, its segments made when first read: when every query sees each node of
    its path whole, the lengths, leads and queries the cost model reads come from the tokens over
    each query in depth-first order (a subtree's queries are consecutive) without listing the
    (tile, node) pairs."""
    if not _whole_paths(tree):
        return path_tiles(tree, heads, rows, own)
    nq = tree.num_queries
    per_tile = max(1, rows // heads.group)
    num_tiles = -(-nq // per_tile)
    rank, cover, shared, started = _rank_tokens(tree, own)
    # a tile reads the nodes over its first query and those that start (in depth-first order) at
    # its later ones; its lead, the nodes over all its queries, is the fewest tokens two
    # consecutive queries of it share (the shallowest of their lowest common ancestors)
    first = np.arange(0, nq, per_tile)
    last = np.minimum(first + per_tile, nq) - 1
    item_len = cover[first] + started[last] - started[first]
    common = shared.copy()
    common[first] = cover[first]
    lead = np.minimum.reduceat(common, first)
    q_counts = last + 1 - first
    q_item, q_query = rank // per_tile, None  # (a query is in one tile)
    masked = lead < item_len
    if own is not None and own.any():  # (as concat_items lays them out)
        mine = _own_items(tree, own)
        q_item = np.concatenate((q_item, num_tiles + np.arange(mine.num_items).repeat(mine.item_queries)))
        q_query = np.concatenate((np.arange(nq), mine.q_indices))
        item_len = np.concatenate((item_len, mine.item_len))
        q_counts = np.concatenate((q_counts, mine.item_queries))
        masked = np.concatenate((masked, masked_flags(mine)))
        lead = np.concatenate((lead, np.full(mine.num_items, -1, dtype=np.int64)))
    return DeferredItems(item_len, q_counts, lambda: path_tiles(tree, heads, rows, own), q_item, q_query,
                         masked=masked, mask_lead=lead)


def _whole_paths(tree: DecodingTree) -> bool:
    """Whether every query sees each node of its path whole (found once per tree)."""
    got = tree.derived.get("paths_whole")
    if got is None:
        eff_node, eff_prefix = tree.effective_queries
        got = tree.derived["paths_whole"] = _same(eff_prefix, tree.lengths[eff_node])
    return got


def _query_ranges(tree: DecodingTree) -> tuple:
    """``(order, nodes, lo, hi)``: the queries in depth-first order (by their effective node's
    pre-order number; stable), the nodes with tokens that some query sees, and for each node the
    ranks ``lo..hi-1`` in that order of the queries of its subtree (made once per tree)."""
    got = tree.derived.get("paths_query_ranges")
    if got is None:
        order, lo, hi = query_ranges(tree)
        if order is None:
            order = np.arange(tree.num_queries)
        got = tree.derived["paths_query_ranges"] = (order, np.flatnonzero((hi > lo) & (tree.lengths > 0)), lo, hi)
    return got


def _rank_tokens(tree: DecodingTree, own: np.ndarray | None) -> tuple:
    """``(rank, cover, shared, started)``: each query's rank in depth-first order
    (:func:`_query_ranges`), and int64 [queries] by rank: the tokens of the nodes (not flagged in
    ``own``) over the query, those it shares with the previous one, and those of the nodes that
    start at it or before (made once per tree without ``own``)."""
    got = None if own is not None else tree.derived.get("paths_rank_tokens")
    if got is None:
        nq = tree.num_queries
        order, seen, lo, hi = _query_ranges(tree)
        length, lo, hi = tree.lengths[seen], lo[seen], hi[seen]
        if own is not None:
            length = length * ~own[seen]
        starts = np.bincount(lo, length, nq + 1)
        cover = (starts - np.bincount(hi, length, nq + 1)).cumsum()[:-1].astype(np.int64)
        starts = starts[:-1].astype(np.int64)
        rank = np.empty(nq, dtype=np.int64)
        rank[order] = np.arange(nq)
        got = rank, cover, cover - starts, starts.cumsum()
        if own is None:
            tree.derived["paths_rank_tokens"] = got
    return got


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
    base = _indptr(1 + cut)[:-1]
    src = np.arange(n).repeat(1 + cut)
    is_lead = np.zeros(src.size, dtype=bool)
    is_lead[base[cut]] = True
    is_tail = np.zeros(src.size, dtype=bool)
    is_tail[base[cut] + 1] = True
    length = items.item_len[src]
    length = np.where(is_lead, lead[src], np.where(is_tail, length - lead[src], length))
    nq = items.item_queries[src]
    new_lead = np.where(is_tail, 0, lead[src])
    new_masked = np.where(is_lead, False, masked[src])

    def make() -> WorkItems:
        nseg = items.seg_indptr[1:] - items.seg_indptr[:-1]
        seg_item = np.arange(n).repeat(nseg)
        seg_end = np.cumsum(items.seg_hi - items.seg_lo)
        seg_end -= np.append(0, seg_end)[items.seg_indptr[:-1]][seg_item]  # ends within the item
        seg_new = base[seg_item] + (cut[seg_item] & (seg_end > lead[seg_item]))
        q = ranges(items.q_indptr[src], items.q_indptr[src + 1])
        lead_q = lead[src].repeat(nq)
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


def _splittable_lengths(items: WorkItems, at: np.ndarray | None = None) -> np.ndarray:
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
    (:func:`~treeattn.plan.addressing.contig_launches`), and one such lead kept the whole launch
    of a Medusa tree's context chunks gathered."""
    lead = items.mask_lead
    q_item, q_query = items.pairs()
    first = np.full(items.num_items, -1, dtype=np.int64)
    first[q_item[::-1]] = q_query[::-1]  # (each item's first query: the last write wins)
    has = (lead > 0) & items.masked & (first >= 0)
    run = np.minimum(lead, _run_tokens(tree)[tree.effective_queries[0][np.maximum(first, 0)]])
    moved = has & (run > 0) & (run < lead) & (lead - run <= RUN_LEAD_SLACK)
    return np.where(moved, run, lead) if moved.any() else None


def _run_tokens(tree: DecodingTree) -> np.ndarray:
    """int64 [nodes]: how many of the tokens on each node's root path (its ancestors' and its own)
    lie in one run of consecutive KV slots from the path's first token, counted in whole nodes
    (made once per tree)."""
    got = tree.derived.get("paths_run_tokens")
    if got is not None:
        return got
    topo, length, kv = tree.topology, tree.lengths, tree.kv_indices
    above = topo.path_tokens
    full = above + length
    if kv.size == 0:
        tree.derived["paths_run_tokens"] = full
        return full
    start, end = tree.kv_indptr[:-1], tree.kv_indptr[1:]
    nonempty = length > 0
    # breaks between consecutive entries of the flat slot list, counted up to each entry
    breaks = np.concatenate(([0], np.cumsum(kv[1:] != kv[:-1] + 1)))
    inner = np.where(nonempty, breaks[np.maximum(end - 1, 0)] - breaks[np.minimum(start, kv.size - 1)], 0)
    # a node continues its path's run when its first slot is the path's first slot plus the tokens
    # above it: the same offset as the path's head (its topmost node with tokens)
    offset = kv[np.minimum(start, kv.size - 1)] - above
    head = np.flatnonzero(nonempty & (above == 0))
    head = head[np.argsort(topo.tin[head])]  # (their subtrees are disjoint)
    at = np.maximum(np.searchsorted(topo.tin[head], topo.tin, side="right") - 1, 0)
    bad = nonempty & ((inner > 0) | (offset != offset[head[at]]))
    # each node's run ends at its topmost bad ancestor-or-self (the outermost bad subtrees)
    bad = np.flatnonzero(bad)
    if bad.size == 0:
        tree.derived["paths_run_tokens"] = full
        return full
    bad = bad[np.argsort(topo.tin[bad])]
    tout = topo.tout[bad]
    outer = bad[topo.tin[bad] >= np.concatenate(([0], np.maximum.accumulate(tout)[:-1]))]
    j = np.searchsorted(topo.tin[outer], topo.tin, side="right") - 1
    inside = (j >= 0) & (topo.tin < topo.tout[outer[np.maximum(j, 0)]])
    got = tree.derived["paths_run_tokens"] = np.where(inside, above[outer[np.maximum(j, 0)]], full)
    return got


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


def _trunk_leads(tree: DecodingTree, leads: np.ndarray) -> bool:
    """Whether two tiles or more read the tree's trunk as their leads (each at most a KV block
    longer: the tiles of a token tree may share its first draft tokens)."""
    trunk = trunk_tokens(tree)
    return trunk > 0 and int((leads >= trunk).sum()) > 1 and int(leads.max()) <= trunk + 16


def paths_variants(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> list:
    """``[(items, note), ...]``: path tiles of each query-tile height (16 rows only from
    :data:`SHORT_TILE_MIN_GROUP`), with every node in the tiles and, where some are, with long
    nodes of fewer rows than a tile apart; each whole (every query's output written directly) and,
    where their programs would not fill the GPU, with the tiles' leads and the nodes apart split
    into KV chunks (:func:`~treeattn.plan.split.fill_length`;
    on the kernel suite the split variants were the fastest on small trees only)."""
    rows = tree.subtree_queries * heads.group
    extent = tree.node_extent
    out = []
    choices = _block_m_choices(heads.group)
    for block_m in [m for m in choices if m >= 32 or heads.group >= SHORT_TILE_MIN_GROUP] or choices[-1:]:
        own = (rows < block_m) & (extent > OWN_ITEM_TOKENS)
        for apart in ((None, own) if own.any() else (None,)):
            tiles = deferred_path_tiles(tree, heads, block_m, apart)
            note = f"paths: tiles of {block_m} rows" + ("" if apart is None else f", {int(apart.sum())} long nodes apart")
            out.append((tiles, note))
            max_len, why = fill_length(tiles, heads, cost, tile_rows=block_m)
            if max_len is None:
                continue
            # the items are cut at their leads only for the variants that split some
            leads = _splittable_lengths(tiles)
            chunks, at = [], None
            if _trunk_leads(tree, leads):
                at = run_leads(tree, tiles)
                if at is not None:
                    leads = _splittable_lengths(tiles, at)
                longest = int(leads.max())
                chunks = [(k, -(-longest // k)) for k in LEAD_CHUNKS
                          if k != -(-longest // max_len) and -(-longest // k) >= OWN_ITEM_TOKENS]
            if not chunks and not (leads > max_len).any():
                continue
            cut, splittable = cut_at_leads(tiles, at)
            split = split_long_items(cut, np.where(splittable, max_len, _NEVER))
            if split is not cut:
                out.append((split, note + why.replace("long contexts", "leads")))
            for k, chunk in chunks:
                out.append((split_long_items(cut, np.where(splittable, chunk, _NEVER)),
                            note + f"; leads cut into chunks of {chunk} tokens ({k} of the longest)"))
    return out


def plan_paths(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    return best_variant(tree, paths_variants(tree, heads, cost), heads, cost)


# plan_auto rates every variant with the other planners' items
plan_paths.variants = paths_variants
