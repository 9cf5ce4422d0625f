"""The plan builder: planner work items lowered to a :class:`~treeattn.plan.format.Plan` (query
tiles, launches, the KV slot list, the merge map, the tree mask when needed, and the host copies
the lazy update patches)."""
from __future__ import annotations

import numpy as np

from treeattn.plan.lower.addressing import (
    contig_launches,
    persistent_tall,
    runs_between,
    split_tails,
    tma_launches,
    tma_loads,
)
from treeattn.plan.select.cost import CostModel
from treeattn.plan.strategies.items import WorkItems, _indptr, group_order
from treeattn.plan.lower.merge_config import merge_launch
from treeattn.plan.lower.tensors import pack_int32
from treeattn.plan.format import (
    HeadConfig,
    Launch,
    Plan,
    PlanHost,
    PlanIO,
    _block_m_choices,
    unit_mask_terms,
)
from treeattn.tree.topology import ranges, slot_breaks
from treeattn.tree import DecodingTree

__all__ = ["build_plan", "mask_rows"]


def _pair_visibility(tree: DecodingTree, items: WorkItems, q_item: np.ndarray) -> np.ndarray:
    """int64 [nnz]: tokens of its item that each (item, query) pair sees (``q_item``: the item of
    each pair)."""
    nseg = (items.seg_indptr[1:] - items.seg_indptr[:-1])[q_item]
    one_seg = bool(np.all(nseg == 1))  # (the common case: one entry per pair)
    pair_seg = items.seg_indptr[q_item] if one_seg else ranges(items.seg_indptr[q_item],
                                                                 items.seg_indptr[q_item + 1])
    pair_q = items.q_indices if one_seg else items.q_indices.repeat(nseg)
    vis = np.minimum(items.seg_hi[pair_seg], tree.sees(items.seg_node[pair_seg], pair_q))
    vis -= items.seg_lo[pair_seg]
    np.maximum(vis, 0, out=vis)
    if one_seg:
        return vis
    # sum over each pair's segments (pairs are in order, each with nseg consecutive entries)
    csum = np.zeros(vis.size + 1, dtype=np.int64)
    vis.cumsum(out=csum[1:])
    end = nseg.cumsum()
    return csum[end] - csum[end - nseg]


#: Above every KV position and key (np.iinfo is slow to call).
_NEVER = int(np.iinfo(np.int64).max)
#: Mean segment length from which the KV slot list is copied segment by segment.
_SLICE_MIN_TOKENS = 256
#: One tree-mask record (four int32) as a single numpy item.
_RECORD = np.dtype((np.void, 16))


def _slot_list(tree: DecodingTree, start: np.ndarray, count: np.ndarray,
               entry: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The KV slot list of segments of ``count`` entries from ``tree.kv_indices[start]`` on, the
    segment's first entry at ``entry``: int32 the slots, concatenated, int64 their
    :func:`~treeattn.tree.topology.slot_breaks`, and the pool slots it needs (its largest + 1, 0 if
    empty)."""
    if not count.all():
        nonempty = np.flatnonzero(count)
        start, count, entry = start[nonempty], count[nonempty], entry[nonempty]
    breaks = tree.slot_breaks
    if breaks.size == 0 or (breaks.searchsorted(start, side="right") ==
                            breaks.searchsorted(start + count, side="left")).all():
        # every segment is a run of slots (no break inside): the list is made from the segments'
        # first slots, and so are its breaks, without a per-entry gather or compare
        first = tree.kv_indices[start]
        end = first + count  # (past each segment's last slot)
        slots = np.arange(entry[-1] + count[-1] if count.size else 0, dtype=np.int32)
        slots += (first - entry).astype(np.int32).repeat(count)
        return slots, entry[1:][first[1:] != end[:-1]], int(end.max()) if count.size else 0
    if count.size * _SLICE_MIN_TOKENS <= count.sum():  # (some segment: none takes the path above)
        # long segments: slice copies are cheaper than a per-token index array
        kv = tree.kv_indices
        slots = np.concatenate([kv[a:b] for a, b in zip(start.tolist(), (start + count).tolist())], dtype=np.int32)
    else:
        idx = ranges(start, start + count)
        slots = np.take(tree.kv_indices, idx, out=np.empty(idx.size, dtype=np.int32))  # (gather and cast in one pass)
    return slots, slot_breaks(slots), int(slots.max()) + 1


def segment_records(seg_tin: np.ndarray, seg_tout: np.ndarray, seg_lo: np.ndarray) -> np.ndarray:
    """int32 [S, 4]: each segment's node range (``seg_tin``, ``seg_tout``), the position in its
    node of its first entry (``seg_lo``) and 0, from which :func:`mask_rows` builds the mask."""
    rec = np.zeros((seg_lo.size, 4), dtype=np.int32)
    rec[:, 0], rec[:, 1], rec[:, 2] = seg_tin, seg_tout, seg_lo
    return rec


def mask_rows(seg_rec: np.ndarray, seg_len: np.ndarray, seg_kv: np.ndarray) -> np.ndarray:
    """int32 [total, 4]: the :attr:`~treeattn.plan.format.Plan.tree_mask` record of every entry of
    segments of ``seg_len`` entries that start at entries ``seg_kv``, from their
    :func:`segment_records`. A segment's entries share one record, so this is one repeat of
    16-byte items, which numpy copies about 4x faster than three int32 rows (the lazy update's
    largest pass)."""
    rec = seg_rec.copy()
    rec[:, 2] -= seg_kv.astype(np.int32)  # (an int64 operand would cast every element of the strided column)
    return rec.view(_RECORD).ravel().repeat(seg_len).view(np.int32).reshape(-1, 4)


def _seen_whole_until(key: np.ndarray, span: int, run_item: np.ndarray | None, run_pairs: np.ndarray,
                      seg_key: np.ndarray, seg_tout: np.ndarray, seg_kv: np.ndarray, nseg: np.ndarray,
                      item_end: np.ndarray) -> np.ndarray:
    """int64 [items]: the first KV entry of each item's first segment that some of its queries
    does not see whole, or the item's end (``item_end``) if none.

    Only the queries that see part of their item count: their keys ``tin * span + prefix``
    (``key``, ``tin`` of the query's node) come in runs of ``run_pairs``, one for each item
    ``run_item`` (None: every item, in order); the others see every segment whole. A segment
    (``seg_key = tin * span + hi``, of node ``u`` ending at ``hi``) is seen whole by an item's
    such queries iff ``u`` is an ancestor-or-self of each one's node and ``hi`` is within the
    prefix of those whose node it is: with pre-order numbers,
    ``tin[u] <= min tin <= max tin < tout[u]``, ``u`` being some query's node iff ``tin[u]`` is
    the minimum, then ``hi`` at most the least prefix of that node's queries. As ``span`` exceeds
    every ``hi`` and prefix, all but the last test is ``seg_key <= min key`` and the last
    ``max key < tout[u] * span``.
    """
    first = run_pairs.cumsum() - run_pairs
    k_min, k_max = np.minimum.reduceat(key, first), np.maximum.reduceat(key, first)
    if run_item is not None:  # items without such queries get keys that make every segment whole
        run_min, run_max = k_min, k_max
        k_min = np.full(item_end.size, _NEVER, dtype=np.int64)
        k_max = np.full(item_end.size, -1, dtype=np.int64)
        k_min[run_item], k_max[run_item] = run_min, run_max
    whole = (seg_key <= k_min.repeat(nseg)) & (k_max.repeat(nseg) < seg_tout * span)
    # segments are in KV order: the least start of one not seen whole
    cut = np.minimum.reduceat(np.where(whole, _NEVER, seg_kv), nseg.cumsum() - nseg)
    return np.minimum(cut, item_end)


def _untailed(tail_node: np.ndarray, num_nodes: int) -> np.ndarray:
    """intp: the nodes not in ``tail_node``."""
    untailed = np.ones(num_nodes, dtype=bool)
    untailed[tail_node] = False
    return np.flatnonzero(untailed)


def _cover(start_tails: np.ndarray, end_tails: np.ndarray, n_tails: int) -> np.ndarray:
    """int64 [n_tails]: ranges ``[start_tails, end_tails)`` that hold each tail."""
    change = np.bincount(start_tails, minlength=n_tails + 1) - np.bincount(end_tails, minlength=n_tails + 1)
    return change.cumsum()[:-1]


def build_plan(tree: DecodingTree, items: WorkItems, heads: HeadConfig, *, strategy: str,
               device="cpu", reason: str = "", requested_strategy: str | None = None,
               candidates: tuple = (), cost: CostModel | None = None) -> Plan:
    """Lower planner work items to a :class:`Plan`.

    Drops empty segments, items without tokens or queries; picks each item's query tile;
    builds the KV slot list, the merge map, the tree mask (only when needed, with each work
    unit's mask start) and the IO report. ``cost`` (default :class:`CostModel`): its profile
    gives the items' KV tiles, the grid order and the lowering rules' tiles and thresholds
    (:mod:`treeattn.plan.lower.addressing`); it decides :attr:`Plan.tall_first` and whether the
    last launch may merge (the profile's
    :attr:`~treeattn.plan.select.profiles.DeviceProfile.merge_last_min_group`).
    """
    cost = cost or CostModel()
    topo = tree.topology
    group = heads.group
    # -- (item, query) pairs: how many of the item's tokens each query sees. Splitting an item
    # (long-KV split) can leave a query of a partially visible node with nothing in a chunk;
    # such pairs are dropped, then items without tokens or queries.
    seg_len = items.seg_hi - items.seg_lo  # (every segment's, for now)
    if seg_len.size and seg_len.min() < 0:
        raise ValueError("planner produced a segment with negative length")
    length = items.item_len
    q_item = np.arange(items.num_items).repeat(items.item_queries)
    vis = _pair_visibility(tree, items, q_item) if items.q_tokens is None else items.q_tokens
    keep_pair = vis > 0
    if not keep_pair.all():
        counts = np.bincount(q_item[keep_pair], minlength=items.num_items)
        items = WorkItems(items.seg_indptr, items.seg_node, items.seg_lo, items.seg_hi,
                          _indptr(counts), items.q_indices[keep_pair])
        vis = vis[keep_pair]
        q_item = q_item[keep_pair]
    nq = items.item_queries
    partial = vis < length[q_item]
    needs_mask = bool(partial.any())
    # items some query sees only part of: their launches apply the mask (every launch when the
    # plan has none: a mask added later, for decode windows, applies everywhere)
    item_partial = np.bincount(q_item[partial], minlength=items.num_items) if needs_mask else None
    item_masked = item_partial > 0 if needs_mask else np.ones(items.num_items, dtype=bool)
    used = (length > 0) & (nq > 0)
    keep = None if used.all() else np.flatnonzero(used)  # (None: every item, in order)
    if keep is not None:
        length, nq, item_masked = length[keep], nq[keep], item_masked[keep]
    # -- query tiles: PAT round-up, split only beyond the largest tile. One launch per shape
    # (query tile, KV tile config); ``shape`` numbers them in launch order
    m_choices = np.array(_block_m_choices(group))
    m_idx = np.minimum(m_choices.searchsorted(nq * group), m_choices.size - 1)
    profile = cost.profile  # (the lowering's tiles and thresholds are the device's, as its rates)
    long_cfg = profile.long_tile(heads.head_dim)
    kv_cfgs = sorted({profile.tile_short, long_cfg})  # KV tile configs by block_n
    shape = m_idx * len(kv_cfgs)
    if len(kv_cfgs) > 1:
        short_tokens = profile.short_item_tokens
        shape += length > short_tokens if kv_cfgs[1] == long_cfg else length <= short_tokens
    # launch order: by shape, longest items first inside a launch so the long programs start
    # early (less tail). One key for both (lengths are positive): its stable sort is
    # lexsort((-length, shape)), and the planners' items often come in this order already
    n_items = length.size
    key = shape * (int(length.max()) + 1) - length if n_items else shape
    if not (key[1:] >= key[:-1]).all():
        order = np.argsort(key, kind="stable")
        length, nq, shape, item_masked = length[order], nq[order], shape[order], item_masked[order]
        keep = order if keep is None else keep[order]
    block_m = m_choices[shape // len(kv_cfgs)]
    q_per_tile = np.maximum(block_m // group, 1)
    tiles = -(-nq // q_per_tile)
    # segments and queries, item after item
    if keep is None:  # (all the planner's segments and queries, as they are)
        seg_all = slice(int(items.seg_indptr[0]), int(items.seg_indptr[-1]))
        nseg = items.seg_indptr[1:] - items.seg_indptr[:-1]
        seg_node, seg_lo, seg_hi = items.seg_node[seg_all], items.seg_lo[seg_all], items.seg_hi[seg_all]
        seg_len = seg_len[seg_all]
        row_q = items.q_indices[int(items.q_indptr[0]): int(items.q_indptr[-1])]
    else:
        seg_start, seg_end = items.seg_indptr[keep], items.seg_indptr[keep + 1]
        nseg = seg_end - seg_start
        seg = ranges(seg_start, seg_end)
        seg_node, seg_lo, seg_hi, seg_len = items.seg_node[seg], items.seg_lo[seg], items.seg_hi[seg], seg_len[seg]
        q_start = items.q_indptr[keep]
        row_q = items.q_indices[ranges(q_start, q_start + nq)]  # a tile takes its item's queries in order
    # KV slots
    seg_kv = seg_len.cumsum() - seg_len  # each segment's first entry
    kv_indices, breaks, min_slots = _slot_list(tree, tree.kv_indptr[seg_node] + seg_lo, seg_len, seg_kv)
    # entries holding the last token of their node: at most one per segment
    node_len = tree.lengths[seg_node]
    tail_seg = np.flatnonzero((seg_lo < node_len) & (node_len <= seg_hi))
    tail = (seg_kv + node_len - 1 - seg_lo)[tail_seg]
    item_bound = _indptr(length)  # each item's first entry, and the end
    item_kv_start, item_kv_end = item_bound[:-1], item_bound[1:]
    # work units = query tiles (``w_item``: the item of each; None: one tile per item)
    w_bound = _indptr(tiles)
    num_work = int(w_bound[-1])
    if num_work == n_items:
        w_item = None
        work_row_indptr = _indptr(nq)
        work_kv_start, work_kv_end = item_kv_start, item_kv_end
    else:
        w_item = np.arange(n_items).repeat(tiles)
        w_tile = np.arange(num_work) - w_bound[w_item]
        w_rows = np.minimum(q_per_tile[w_item], nq[w_item] - w_tile * q_per_tile[w_item])
        work_row_indptr = _indptr(w_rows)
        work_kv_start, work_kv_end = item_kv_start[w_item], item_kv_end[w_item]
    # tree mask: each entry's node range and position in its node, one record a node run
    mask, seg_mask = [None] * 3, [None] * 3
    if needs_mask:
        seg_tin, seg_tout, q_tin = topo.tin[seg_node], topo.tout[seg_node], topo.tin[tree.query_nodes]
        seg_mask = [seg_len, segment_records(seg_tin, seg_tout, seg_lo), tail_seg]
        mask = [mask_rows(seg_mask[1], seg_len, seg_kv), q_tin, tree.query_prefix]
    # where each item's mask starts (its end if none; without a plan mask, every end: a mask
    # added later sets its own starts)
    item_mask_start = item_kv_end
    if needs_mask:
        runs = np.flatnonzero(item_partial)  # (pairs are grouped by item, in the planner's order)
        run_item = None  # (every item, in order)
        if keep is not None:  # the items' new numbers
            new_item = np.empty(items.num_items, dtype=np.intp)
            new_item[keep] = np.arange(n_items)
            run_item = new_item[runs]
        elif runs.size < n_items:
            run_item = runs
        span = tree.kv_indices.size + 1  # above every segment end and prefix
        item_mask_start = _seen_whole_until(
            (q_tin * span + tree.query_prefix)[items.q_indices[partial]], span, run_item,
            item_partial if run_item is None else item_partial[runs], seg_tin * span + seg_hi, seg_tout,
            seg_kv, nseg, item_mask_start)
    work_mask_start = item_mask_start if w_item is None else item_mask_start[w_item]
    merge_order = group_order(row_q, tree.num_queries)
    if merge_order is None:
        merge_order = np.arange(row_q.size)
    q_rows = np.bincount(row_q, minlength=tree.num_queries)
    if row_q.size == q_rows.size and q_rows.max(initial=0) <= 1:  # (every query has one row)
        merge_indptr, row_direct = np.arange(row_q.size + 1, dtype=np.int32), np.ones(row_q.size, dtype=np.int32)
        num_direct, merge_q = row_q.size, np.zeros(0, dtype=np.int32)
    else:
        merge_indptr = _indptr(q_rows)
        row_direct = q_rows[row_q] == 1
        num_direct = int(np.count_nonzero(row_direct))
        merge_q = np.flatnonzero(q_rows != 1)
    # launches: items (so work units) are grouped by shape. A launch applies the tree mask when
    # one of its items needs it (an extra launch would cost more)
    first = [0]  # (shapes are sorted: one launch when the first and last agree)
    if n_items and shape[0] != shape[-1]:
        first += (np.flatnonzero(shape[1:] != shape[:-1]) + 1).tolist()
    bounds = first + [n_items]
    kv_tiles = length * tiles  # KV entries of all of each item's work units
    launches, mask_entries, longest_s = [], 0, []
    if n_items:
        masked = np.logical_or.reduceat(item_masked, first).tolist()
        # grid order: KV heads side by side for launches of long work units, unless an item has
        # several query tiles (those re-read the item's KV, and hit L2 when adjacent in the grid)
        multi_tile = np.logical_or.reduceat(tiles > 1, first).tolist()
        w_bounds, item_tokens = w_bound[bounds].tolist(), item_bound[bounds].tolist()
        if needs_mask:  # (masked_entries and split_masked_launches, from the items)
            lead = item_mask_start - item_kv_start
            longest_lead = np.maximum.reduceat(lead, first).tolist()
            item_block_n = np.array([c[0] for c in kv_cfgs])[shape % len(kv_cfgs)]
            split_tiles = tiles * (length - lead + (lead & (item_block_n - 1)))  # (from the tile of the start)
            sums = list(zip(np.add.reduceat(kv_tiles, first).tolist(), np.add.reduceat(split_tiles, first).tolist()))
        for i, (a, b) in enumerate(zip(first, bounds[1:])):
            block_n, num_warps, num_stages = kv_cfgs[int(shape[a]) % len(kv_cfgs)]
            long_units = item_tokens[i + 1] - item_tokens[i] >= profile.heads_inner_min_tokens * (b - a)
            split = needs_mask and masked[i] and longest_lead[i] >= block_n
            if needs_mask and masked[i]:
                mask_entries += sums[i][split]
            launches.append(Launch(int(block_m[a]), block_n, w_bounds[i], w_bounds[i + 1], num_warps, num_stages,
                                   masked=masked[i], heads_inner=long_units and not multi_tile[i], mask_split=split))
            # (a launch's first item is its longest)
            longest_s.append(cost.program_s(int(block_m[a]), block_n, -(-int(length[a]) // block_n), heads,
                                            tall_first=True))
    gather_launches = tuple(launches)
    launches = contig_launches(gather_launches, runs_between(breaks, work_kv_start, work_kv_end),
                               heads.num_kv_heads, profile=profile, has_mask=needs_mask, elem_bytes=heads.elem_bytes,
                               unit_tokens=work_kv_end - work_kv_start)
    if tma_loads(heads, cost):
        launches = tma_launches(launches, work_kv_start, work_kv_end, heads.num_kv_heads, profile=profile)
    tall_first = cost.tall_first(longest_s)
    if tall_first and cost.pdl:
        launches = persistent_tall(launches, work_kv_start, work_kv_end, heads.num_kv_heads,
                                   group=heads.group, elem_bytes=heads.elem_bytes, profile=profile)
    launches = split_tails(launches, work_kv_start, work_kv_end, has_mask=needs_mask, profile=profile)
    # IO
    hq, hkv, d, eb = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim, heads.elem_bytes
    kv_tok = int(item_bound[-1])
    kv_tok_tiles = int(kv_tiles.sum())
    io = PlanIO(
        kv=kv_tok * hkv * d * 2 * eb,
        kv_tile_rereads=(kv_tok_tiles - kv_tok) * hkv * d * 2 * eb,
        queries=int(row_q.size) * hq * d * eb,
        partial_write=(int(row_q.size) - num_direct) * heads.partial_row_bytes(),
        partial_read=(int(row_q.size) - num_direct) * heads.partial_row_bytes(),
        mask=mask_entries * 3 * 4 * hkv,
        index=kv_tok_tiles * 4 * hkv,
        output=tree.num_queries * hq * d * eb,
    )
    t, h = pack_int32({
        "kv_indices": kv_indices, "work_kv_start": work_kv_start, "work_kv_end": work_kv_end,
        "work_mask_start": work_mask_start,
        "work_row_indptr": work_row_indptr, "row_q_indices": row_q, "merge_indptr": merge_indptr,
        "merge_indices": merge_order, "row_direct": row_direct, "merge_q_indices": merge_q,
        "tree_mask": mask[0], "query_pos": mask[1], "query_prefix": mask[2]}, device)
    tail_node = seg_node[tail_seg].astype(np.intp, copy=False)
    if w_item is None:  # the units are the items, which partition the KV list: one holds each tail
        bound_tails = tail.searchsorted(item_bound)
        start_tails, end_tails = bound_tails[:-1], bound_tails[1:]
        tail_cover = np.ones(tail.size, dtype=np.int64)
    else:
        start_tails, end_tails = tail.searchsorted(work_kv_start), tail.searchsorted(work_kv_end)
        tail_cover = _cover(start_tails, end_tails, tail.size)
    return Plan(
        strategy=strategy, requested_strategy=requested_strategy or strategy, heads=heads,
        num_queries=tree.num_queries, page_size=tree.page_size, min_slots=min_slots,
        kv_indices=t["kv_indices"], work_kv_start=t["work_kv_start"], work_kv_end=t["work_kv_end"],
        work_mask_start=t["work_mask_start"],
        work_row_indptr=t["work_row_indptr"], row_q_indices=t["row_q_indices"],
        merge_indptr=t["merge_indptr"], merge_indices=t["merge_indices"], row_direct=t["row_direct"],
        merge_q_indices=t["merge_q_indices"], num_direct=num_direct,
        merge_rows_max=int(q_rows.max(initial=0)) if merge_q.size else 0,
        tree_mask=t["tree_mask"], query_pos=t["query_pos"], query_prefix=t["query_prefix"],
        launches=tuple(launches), io=io, num_items=n_items, reason=reason,
        candidates=candidates, tall_first=tall_first,
        # (a persistent tall launch runs beside the leaf launch, whose fold would wait for it)
        merge_launch=merge_launch(launches, tall_first, work_row_indptr, row_q, q_rows)
        if cost.merges_last(heads) and not any(ln.programs for ln in launches) else -1,
        host=PlanHost(kv_slots=h["kv_indices"], tail_pos=tail.astype(np.int32),
                      tail_node=tail_node, untailed=_untailed(tail_node, tree.num_nodes), seg_len=seg_mask[0], seg_rec=seg_mask[1],
                      tail_seg=seg_mask[2],
                      work_kv_start=h["work_kv_start"], work_kv_end=h["work_kv_end"],
                      start_tails=start_tails, end_tails=end_tails,
                      tail_cover=tail_cover,
                      work_mask_start=h["work_mask_start"],
                      mask_tails=tail.searchsorted(work_mask_start) if needs_mask else None,
                      unit_mask=unit_mask_terms(gather_launches, num_work) if needs_mask else None,
                      saw_all=tree.query_prefix == tree.lengths[tree.query_nodes],
                      gather_launches=gather_launches, profile=profile, tree=tree),
    )
