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
leads are the tree's trunk (a token tree over one context), also into a few longer chunks
(:mod:`treeattn.plan.strategies.leads`).
"""
from __future__ import annotations

import numpy as np

from treeattn.plan.select.estimate import best_variant
from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import DeferredItems, WorkItems, _indptr, _same, concat_items, masked_flags
from treeattn.plan.strategies.leads import LEAD_CHUNKS, cut_at_leads, on_runs, run_leads, splittable_lengths, trunk_leads
from treeattn.plan.strategies.node import node_items
from treeattn.plan.format import HeadConfig, _block_m_choices
from treeattn.plan.strategies.query_ranges import query_ranges
from treeattn.plan.strategies.split import fill_length, split_long_items
from treeattn.tree import DecodingTree

#: 16-row path tiles only for GQA groups of this size or more (at most 4 queries a tile): on the
#: kernel suite they were the fastest plan of the smallest trees at 32/8 and 64/8, while at 32/32
#: the cost model rated them best on deep trees where they ran up to 12% slower than 32-row tiles
#: (H200)
SHORT_TILE_MIN_GROUP = 4
#: a node with fewer rows than the query tile stays an item of its own beyond this many tokens
#: (in the variants that keep such nodes apart)
OWN_ITEM_TOKENS = 64
#: the split length of items not to split (np.iinfo costs microseconds a call)
_NEVER = int(np.iinfo(np.int64).max)


def path_tiles(tree: DecodingTree, heads: HeadConfig, rows: int, own: np.ndarray | None = None,
               sizes: tuple | None = None) -> WorkItems:
    """Work items of query tiles of up to ``rows`` rows (queries x GQA group, consecutive in
    depth-first order), each reading the union of its queries' paths over the nodes not flagged in
    ``own`` (bool [N]); then one item per flagged node with visible tokens (``node``'s).

    A tile's segments are its nodes in pre-order (a node before its descendants), each up to the
    last token one of the tile's queries sees."""
    if _whole_paths(tree):
        tiles = _whole_path_tiles(tree, heads, rows, own, sizes)
    else:
        tiles = _pair_path_tiles(tree, heads, rows, own)
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


def _whole_path_tiles(tree: DecodingTree, heads: HeadConfig, rows: int, own: np.ndarray | None,
                      sizes: tuple | None = None) -> WorkItems:
    """:func:`path_tiles`' tiles (without the nodes apart) when every query sees each node of its
    path whole: a node is in the tiles its range of queries (depth-first) meets, so the segments
    come from the nodes, not from the (query, node) pairs. ``sizes``: :func:`_tile_sizes`, when
    known."""
    nq = tree.num_queries
    per_tile = max(1, rows // heads.group)
    _, q_tokens, item_len, lead, q_counts, masked = sizes or _tile_sizes(tree, per_tile, own)
    num_tiles = item_len.size
    order, node_lo, node_hi = query_ranges(tree)
    keep = tree.node_extent > 0  # (the nodes with tokens some query sees)
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
    seg_node = seg_node[by_tile]
    return WorkItems(_indptr(np.bincount(seg_tile, minlength=num_tiles)), seg_node, np.zeros_like(seg_node),
                     tree.lengths[seg_node], _indptr(q_counts), np.arange(nq) if order is None else order,
                     q_tokens, masked, lead).with_item_len(item_len)


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
    sizes = rank, _, item_len, lead, q_counts, masked = _tile_sizes(tree, per_tile, own)
    num_tiles = item_len.size
    q_item, q_query = rank // per_tile, None  # (a query is in one tile)
    if own is not None and own.any():  # (as concat_items lays them out)
        mine = _own_items(tree, own)
        q_item = np.concatenate((q_item, num_tiles + np.arange(mine.num_items).repeat(mine.item_queries)))
        q_query = np.concatenate((np.arange(nq), mine.q_indices))
        item_len = np.concatenate((item_len, mine.item_len))
        q_counts = np.concatenate((q_counts, mine.item_queries))
        masked = np.concatenate((masked, masked_flags(mine)))
        lead = np.concatenate((lead, np.full(mine.num_items, -1, dtype=np.int64)))
    return DeferredItems(item_len, q_counts, lambda: path_tiles(tree, heads, rows, own, sizes), q_item, q_query,
                         masked=masked, mask_lead=lead)


def _tile_sizes(tree: DecodingTree, per_tile: int, own: np.ndarray | None) -> tuple:
    """``(rank, q_tokens, item_len, lead, q_counts, masked)`` of the path tiles of ``per_tile``
    queries (without the nodes flagged in ``own``) of a tree whose queries see their paths whole:
    each query's rank in depth-first order, its tokens by rank, and each tile's tokens, mask lead,
    queries and mask flag."""
    rank, cover, shared, started, done = _rank_tokens(tree, own)
    nq = rank.size
    first = np.arange(0, nq, per_tile)
    last = np.arange(per_tile - 1, nq + per_tile - 1, per_tile)
    last[-1] = nq - 1
    # a tile reads the nodes that start (in depth-first order) at or before its last query but
    # those that end before its first; its lead, the nodes over all its queries, is the fewest
    # tokens two consecutive queries of it share (the shallowest of their lowest common ancestors)
    item_len = started[last] - done[first]
    common = shared.copy()
    common[first] = cover[first]
    lead = np.minimum.reduceat(common, first)
    q_counts = np.full(first.size, per_tile, dtype=np.int64)
    q_counts[-1] = nq - first[-1]
    return rank, cover, item_len, lead, q_counts, lead < item_len


def _whole_paths(tree: DecodingTree) -> bool:
    """Whether every query sees each node of its path whole (found once per tree)."""
    got = tree.derived.get("paths_whole")
    if got is None:
        eff_node, eff_prefix = tree.effective_queries
        got = tree.derived["paths_whole"] = _same(eff_prefix, tree.lengths[eff_node])
    return got


def _rank_tokens(tree: DecodingTree, own: np.ndarray | None) -> tuple:
    """``(rank, cover, shared, started, done)``: each query's rank in depth-first order
    (:func:`~treeattn.plan.strategies.query_ranges.query_ranges`), and int64 [queries] by rank: the tokens
    of the nodes (not flagged in ``own``) over the query, those it shares with the previous one,
    those of the nodes that start at it or before and those of the nodes that end before it
    (made once per tree without ``own``)."""
    got = None if own is not None else tree.derived.get("paths_rank_tokens")
    if got is None:
        nq = tree.num_queries
        order, lo, hi = query_ranges(tree)
        # (queries see their paths whole: a node's extent is its length, 0 where no query is below)
        length = tree.node_extent if own is None else tree.node_extent * ~own
        starts = np.bincount(lo, length, nq + 1)
        if own is None:  # the nodes over a query are those of its path
            cover = tree.visible_tokens if order is None else tree.visible_tokens[order]
        else:
            cover = (starts - np.bincount(hi, length, nq + 1)).cumsum()[:-1].astype(np.int64)
        starts = starts[:-1].astype(np.int64)
        if order is None:
            rank = np.arange(nq)
        else:
            rank = np.empty(nq, dtype=np.int64)
            rank[order] = np.arange(nq)
        started = starts.cumsum()
        got = rank, cover, cover - starts, started, started - cover
        if own is None:
            tree.derived["paths_rank_tokens"] = got
    return got


def paths_variants(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> list:
    """``[(items, note), ...]``: path tiles of each query-tile height (16 rows only from
    :data:`SHORT_TILE_MIN_GROUP`), with every node in the tiles and, where some are, with long
    nodes of fewer rows than a tile apart; each whole (every query's output written directly) and,
    where their programs would not fill the GPU, with the tiles' leads and the nodes apart split
    into KV chunks (:func:`~treeattn.plan.strategies.split.fill_length`;
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
            leads = splittable_lengths(tiles)
            chunks, at, runs = [], None, False
            if trunk_leads(tree, leads):
                at = run_leads(tree, tiles)
                if at is not None:
                    leads = splittable_lengths(tiles, at)
                longest = int(leads.max())
                chunks = [(k, -(-longest // k)) for k in LEAD_CHUNKS
                          if k != -(-longest // max_len) and -(-longest // k) >= OWN_ITEM_TOKENS]
                runs = apart is None and on_runs(tree, tiles, at)
            if not chunks and not (leads > max_len).any():
                continue
            cut, splittable = cut_at_leads(tiles, at)
            split = split_long_items(cut, np.where(splittable, max_len, _NEVER))
            if split is not cut:
                out.append((_runs_known(split, runs), note + why.replace("long contexts", "leads")))
            for k, chunk in chunks:
                out.append((_runs_known(split_long_items(cut, np.where(splittable, chunk, _NEVER)), runs),
                            note + f"; leads cut into chunks of {chunk} tokens ({k} of the longest)"))
    return out


def _runs_known(items: WorkItems, runs: bool) -> WorkItems:
    """``items`` (made here) with :attr:`~WorkItems.unmasked_runs` set to ``runs``."""
    if runs:
        object.__setattr__(items, "unmasked_runs", True)  # (not a field: the frozen items keep theirs)
    return items


def plan_paths(tree: DecodingTree, heads: HeadConfig, cost: CostModel) -> tuple[WorkItems, str]:
    return best_variant(tree, paths_variants(tree, heads, cost), heads, cost)


# plan_auto rates every variant with the other planners' items
plan_paths.variants = paths_variants
