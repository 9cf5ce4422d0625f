"""The Plan: work items lowered to int32 index tensors, built once per tree and reused by every
layer and decode step until the tree changes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treeattn.plan.items import WorkItems, group_order
from treeattn.topology import ranges
from treeattn.tree import DecodingTree

__all__ = ["Plan", "PlanIO", "PlanHost", "Launch", "HeadConfig", "build_plan", "launch_shapes"]

#: Query-tile heights (rows = queries x GQA group) the kernel is compiled for; an item takes the
#: smallest that holds all its rows (PAT's round-up rule), else it is split into several tiles.
BLOCK_M_CHOICES = (16, 32, 64, 128)


@dataclass(frozen=True)
class HeadConfig:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self):
        for name in ("num_qo_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(f"num_qo_heads ({self.num_qo_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def partial_dtype(self) -> torch.dtype:
        """dtype of the partial outputs the merge reads: 16-bit inputs keep 16-bit partials (each
        is normalised, so it rounds like the output, and the partial traffic halves), fp32 fp32.
        Their LSEs are always fp32."""
        return self.dtype if self.dtype in (torch.float16, torch.bfloat16) else torch.float32

    def partial_row_bytes(self) -> int:
        """Bytes of one partial row: ``Hq x D`` outputs in :attr:`partial_dtype` and ``Hq`` fp32
        LSEs."""
        return self.num_qo_heads * (self.head_dim * self.partial_dtype.itemsize + 4)


@dataclass(frozen=True)
class PlanIO:
    """Bytes moved between HBM and the chip by one run of a plan (DeFT Tables 12 and 17).

    ``kv`` counts each work item's KV once per KV head (what the planner decided);
    ``kv_tile_rereads`` the extra reads when an item's queries need several query tiles (these
    programs run side by side and mostly hit L2). ``partial`` is the fp32 partial outputs and LSEs
    written by the attention kernel and read back by the merge (rows of queries with more than
    one; a query's only row goes straight to the output).
    """

    kv: int
    kv_tile_rereads: int
    queries: int
    partial_write: int
    partial_read: int
    mask: int
    index: int
    output: int

    @property
    def total(self) -> int:
        return (self.kv + self.kv_tile_rereads + self.queries + self.partial_write + self.partial_read
                + self.mask + self.index + self.output)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["total"] = self.total
        return d


@dataclass(frozen=True)
class Launch:
    """One kernel launch over work items ``[work_start, work_end)`` with one tile shape.

    ``masked``: the launch applies the plan's tree mask when the plan has one. The builder clears
    it for the launches of a masked plan whose queries all see their items whole (a long context
    under a speculative token tree), which then skip the mask's loads and compares.
    """

    block_m: int
    block_n: int
    work_start: int
    work_end: int
    num_warps: int = 4
    num_stages: int = 2
    masked: bool = True


@dataclass(frozen=True, eq=False)
class PlanHost:
    """Host copies a plan keeps for its lazy update (:func:`treeattn.plan.update.update_plan`).

    Attributes
    ----------
    kv_slots : int32 [nnz_kv]
        The planned slots (``kv_indices`` on the host).
    tail_pos : int32 [n_tails]
        Every planned entry that is the last token of its node.
    tail_node : intp [n_tails]
        The node of each.
    seg_len : int64 [S] or None
        Entries of each segment (a run of one node's tokens) of the KV list, in order.
    seg_lo, seg_tin, seg_tout : int32 [S] or None
        Position in its node of each segment's first entry, and its node's pre-order range: the
        tree mask by segment, from which updates rebuild it. All four are None without a mask.
    tail_seg : intp [n_tails] or None
        The segment ending at each tail (plans with a tree mask).
    work_kv_start, work_kv_end : int32 [W]
    start_tails, end_tails : intp [W]
        Tails before each work unit's start and end (``tail_pos < work_kv_start``); fixed for
        the plan's life, as updates only insert entries right after tails.
    tail_cover : int64 [n_tails]
        Work units whose KV range holds each tail (``start_tails <= k < end_tails``).
    tail_cover_masked : int64 [n_tails]
        The same, counting only work units of launches that apply the tree mask.
    saw_all : bool [Q]
        Queries that see the whole of their node.
    tree : DecodingTree
        The tree the plan was made for.
    """

    kv_slots: np.ndarray
    tail_pos: np.ndarray
    tail_node: np.ndarray
    seg_len: np.ndarray | None
    seg_lo: np.ndarray | None
    seg_tin: np.ndarray | None
    seg_tout: np.ndarray | None
    tail_seg: np.ndarray | None
    work_kv_start: np.ndarray
    work_kv_end: np.ndarray
    start_tails: np.ndarray
    end_tails: np.ndarray
    tail_cover: np.ndarray
    tail_cover_masked: np.ndarray
    saw_all: np.ndarray
    tree: DecodingTree


@dataclass(frozen=True, eq=False)
class Plan:
    """Work for the partial-attention and merge kernels (int32 tensors on the plan's device).

    Attributes
    ----------
    strategy, requested_strategy : str
        The planner that made the items, and the one asked for (``auto`` or the same).
    kv_indices : int32 [nnz_kv]
        KV-cache slot (``page * page_size + offset``) of each planned KV token, item after item.
    work_kv_start, work_kv_end : int32 [W]
        KV range of each work unit (one query tile of one item) into ``kv_indices``.
    work_row_indptr : int32 [W + 1]
        Partial-result rows of each work unit; row ``r`` is query ``row_q_indices[r]``.
    row_q_indices : int32 [R]
    merge_indptr, merge_indices : int32 [Q + 1], [R]
        Partial rows that make up each query's output (the merge map).
    row_direct : int32 [R]
        1 for the only row of its query: the attention kernel writes it to the output itself.
    merge_q_indices : int32 [M]
        The other queries (none, or several partial rows): the ones the merge kernel writes.
    num_direct : int
        Rows with ``row_direct`` set (host copy; 0 means the kernel writes no output).
    mask_lo, mask_hi, mask_pos : int32 [nnz_kv] or None
        Tree mask, present when some query of an item sees only part of it: token ``t`` (at
        offset ``mask_pos`` of a node with pre-order range ``[mask_lo, mask_hi)``) is visible to
        query ``q`` iff ``mask_lo <= qpos < mask_hi`` and (``mask_lo < qpos`` or
        ``mask_pos < qprefix``), with ``qpos, qprefix = query_pos[q], query_prefix[q]``. This is
        DeFT's bit causal mask in O(1) words per token for any number of queries.
    query_pos, query_prefix : int32 [Q] or None
    launches : tuple of Launch
    candidates : tuple of (str, float)
        ``auto`` plans: every strategy with the cost model's estimate in seconds, best first
        (the engine times the near-best ones); empty for other plans.
    """

    strategy: str
    requested_strategy: str
    heads: HeadConfig
    num_queries: int
    page_size: int
    min_slots: int
    kv_indices: torch.Tensor
    work_kv_start: torch.Tensor
    work_kv_end: torch.Tensor
    work_row_indptr: torch.Tensor
    row_q_indices: torch.Tensor
    merge_indptr: torch.Tensor
    merge_indices: torch.Tensor
    row_direct: torch.Tensor
    merge_q_indices: torch.Tensor
    num_direct: int
    mask_lo: torch.Tensor | None
    mask_hi: torch.Tensor | None
    mask_pos: torch.Tensor | None
    query_pos: torch.Tensor | None
    query_prefix: torch.Tensor | None
    launches: tuple
    io: PlanIO
    num_items: int
    reason: str = ""
    host: PlanHost | None = None
    candidates: tuple = ()

    @property
    def num_rows(self) -> int:
        return int(self.row_q_indices.numel())

    @property
    def num_work(self) -> int:
        return int(self.work_kv_start.numel())

    @property
    def has_mask(self) -> bool:
        return self.mask_lo is not None

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    def workspace_bytes(self) -> int:
        """Bytes of partial outputs and LSEs that :meth:`TreeAttention.run` needs (a multiple of
        4: the outputs are padded so that the fp32 LSEs after them stay aligned)."""
        h = self.heads
        outputs = self.num_rows * h.num_qo_heads * h.head_dim * h.partial_dtype.itemsize
        return -(-outputs // 4) * 4 + self.num_rows * h.num_qo_heads * 4

    def explain(self) -> str:
        """Why this plan: the strategy, its choice (for ``auto``) and its IO."""
        io = self.io
        lines = [f"strategy={self.strategy}: {self.num_items} work items -> {self.num_work} "
                 f"query tiles in {len(self.launches)} launch(es), {self.num_rows} rows "
                 f"({self.num_direct} written directly, {self.merge_q_indices.numel()} queries "
                 f"merged), mask={'on' if self.has_mask else 'off'}",
                 f"IO bytes: kv={io.kv:,} (+{io.kv_tile_rereads:,} query-tile re-reads) "
                 f"queries={io.queries:,} partials={io.partial_write + io.partial_read:,} "
                 f"mask={io.mask:,} index={io.index:,} output={io.output:,} total={io.total:,}"]
        if self.reason:
            lines.append(self.reason)
        return "\n".join(lines)


def _block_m_choices(group: int) -> list:
    return [m for m in BLOCK_M_CHOICES if m >= group] or [1 << (group - 1).bit_length()]


def _pair_visibility(tree: DecodingTree, items: WorkItems, q_item: np.ndarray) -> np.ndarray:
    """int64 [nnz]: tokens of its item that each (item, query) pair sees (``q_item``: the item of
    each pair)."""
    nseg = np.diff(items.seg_indptr)[q_item]
    one_seg = bool(np.all(nseg == 1))  # (the common case: one entry per pair)
    pair_seg = items.seg_indptr[q_item] if one_seg else ranges(items.seg_indptr[q_item],
                                                                 items.seg_indptr[q_item + 1])
    pair_q = items.q_indices if one_seg else np.repeat(items.q_indices, nseg)
    vis = np.minimum(items.seg_hi[pair_seg], tree.sees(items.seg_node[pair_seg], pair_q))
    vis -= items.seg_lo[pair_seg]
    np.maximum(vis, 0, out=vis)
    if one_seg:
        return vis
    # sum over each pair's segments (pairs are in order, each with nseg consecutive entries)
    csum = np.zeros(vis.size + 1, dtype=np.int64)
    np.cumsum(vis, out=csum[1:])
    end = np.cumsum(nseg)
    return csum[end] - csum[end - nseg]


#: KV-tile launch configs (block_n, num_warps, num_stages), picked per item by KV length (PAT's
#: tile selector): short items waste less of a small tile, long ones pipeline deeper. Measured on
#: an H200 over the kernel suite (benchmarks/sweep_kernels.py, benchmarks/NOTES.md).
SHORT_ITEM_TOKENS = 48
TILE_SHORT = (32, 4, 2)
TILE_LONG = (64, 4, 3)
TILE_LONG_HEAD256 = (32, 4, 2)


def launch_shapes(heads: HeadConfig) -> list:
    """Every ``(block_m, block_n, num_warps, num_stages)`` a plan for these heads can launch."""
    tiles = sorted({TILE_SHORT, TILE_LONG if heads.head_dim <= 128 else TILE_LONG_HEAD256})
    return [(m, *t) for m in _block_m_choices(heads.group) for t in tiles]


#: Plan index tensors start at multiples of this many int32 (64 bytes) of their shared buffer,
#: keeping the pointer alignment the kernels are specialised for.
_ALIGN = 16
#: Mean segment length from which the KV slot list is copied segment by segment.
_SLICE_MIN_TOKENS = 256


def _to_tensors(arrays: dict, device) -> tuple[dict, dict]:
    """int32 tensors on ``device`` for the arrays (``None`` stays ``None``) and their int32 host
    copies, which CPU tensors share; other devices get them in one copy of one buffer."""
    device = torch.device(device)
    tensors = dict.fromkeys(arrays)
    if device.type == "cpu":
        host = {k: np.ascontiguousarray(a, dtype=np.int32) for k, a in arrays.items() if a is not None}
        tensors.update((k, torch.from_numpy(h)) for k, h in host.items())
        return tensors, host
    spans, at = {}, 0
    for k, a in arrays.items():
        if a is not None:
            spans[k] = (at, at + a.size)
            at += -(-a.size // _ALIGN) * _ALIGN
    buf = np.empty(at, dtype=np.int32)
    host = {}
    for k, (lo, hi) in spans.items():
        buf[lo:hi] = arrays[k]
        host[k] = buf[lo:hi]
    dev = torch.from_numpy(buf).to(device)
    tensors.update((k, dev[lo:hi]) for k, (lo, hi) in spans.items())
    return tensors, host


def _gather_slots(tree: DecodingTree, start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """int32: ``tree.kv_indices[start:start + count]`` of every segment, concatenated."""
    if count.size * _SLICE_MIN_TOKENS <= count.sum():
        # long segments: slice copies are cheaper than a per-token index array
        kv = tree.kv_indices
        return np.concatenate([kv[a:b] for a, b in zip(start.tolist(), (start + count).tolist())]
                              + [np.zeros(0, np.int64)], dtype=np.int32)
    return tree.kv_indices[ranges(start, start + count)].astype(np.int32)


def _positions(seg_lo: np.ndarray, seg_len: np.ndarray, seg_kv: np.ndarray, total: int) -> np.ndarray:
    """int32 [total]: position in its node of every entry of segments of ``seg_len`` entries,
    ``seg_lo`` the first's and ``seg_kv`` where each segment's entries start."""
    pos = np.arange(total, dtype=np.int32)
    pos -= np.repeat((seg_kv - seg_lo).astype(np.int32, copy=False), seg_len)
    return pos


def _cover(start_tails: np.ndarray, end_tails: np.ndarray, n_tails: int) -> np.ndarray:
    """int64 [n_tails]: ranges ``[start_tails, end_tails)`` that hold each tail."""
    return np.cumsum(np.bincount(start_tails, minlength=n_tails + 1)
                     - np.bincount(end_tails, minlength=n_tails + 1))[:-1]


def build_plan(tree: DecodingTree, items: WorkItems, heads: HeadConfig, *, strategy: str,
               device="cpu", reason: str = "", requested_strategy: str | None = None,
               candidates: tuple = ()) -> Plan:
    """Lower planner work items to a :class:`Plan`.

    Drops empty segments, items without tokens or queries; picks each item's query tile;
    builds the KV slot list, the merge map, the tree mask (only when needed) and the IO report.
    """
    topo = tree.topology
    group = heads.group
    # -- (item, query) pairs: how many of the item's tokens each query sees. Splitting an item
    # (long-KV split) can leave a query of a partially visible node with nothing in a chunk;
    # such pairs are dropped, then items without tokens or queries.
    if np.any(items.seg_hi < items.seg_lo):
        raise ValueError("planner produced a segment with negative length")
    length = items.item_len
    q_item = np.repeat(np.arange(items.num_items), items.item_queries)
    vis = _pair_visibility(tree, items, q_item) if items.q_tokens is None else items.q_tokens
    keep_pair = vis > 0
    if not keep_pair.all():
        counts = np.bincount(q_item[keep_pair], minlength=items.num_items)
        items = WorkItems(items.seg_indptr, items.seg_node, items.seg_lo, items.seg_hi,
                          np.concatenate(([0], np.cumsum(counts))), items.q_indices[keep_pair])
        vis = vis[keep_pair]
        q_item = q_item[keep_pair]
    nq = items.item_queries
    partial = vis < length[q_item]
    needs_mask = bool(np.any(partial))
    # items some query sees only part of: their launches apply the mask (every launch when the
    # plan has none: a mask added later, for decode windows, applies everywhere)
    item_masked = (np.bincount(q_item[partial], minlength=items.num_items) > 0 if needs_mask
                   else np.ones(items.num_items, dtype=bool))
    keep = np.flatnonzero((length > 0) & (nq > 0))
    length, nq, item_masked = length[keep], nq[keep], item_masked[keep]
    # -- query tiles: PAT round-up, split only beyond the largest tile. One launch per shape
    # (query tile, KV tile config); ``shape`` numbers them in launch order
    m_choices = np.array(_block_m_choices(group))
    m_idx = np.minimum(np.searchsorted(m_choices, nq * group), m_choices.size - 1)
    long_cfg = TILE_LONG if heads.head_dim <= 128 else TILE_LONG_HEAD256
    kv_cfgs = sorted({TILE_SHORT, long_cfg})  # KV tile configs by block_n
    shape = m_idx * len(kv_cfgs)
    if len(kv_cfgs) > 1:
        shape += (length > SHORT_ITEM_TOKENS) == (kv_cfgs[1] == long_cfg)
    # launch order: by shape, longest items first inside a launch so the long programs start
    # early (less tail)
    order = np.lexsort((-length, shape))
    length, nq, shape, item_masked = length[order], nq[order], shape[order], item_masked[order]
    keep = keep[order]
    n_items = keep.size
    block_m = m_choices[shape // len(kv_cfgs)]
    q_per_tile = np.maximum(block_m // group, 1)
    tiles = -(-nq // q_per_tile)
    # segments and queries, item after item
    seg = ranges(items.seg_indptr[keep], items.seg_indptr[keep + 1])
    seg_node, seg_lo, seg_hi = items.seg_node[seg], items.seg_lo[seg], items.seg_hi[seg]
    q_start = items.q_indptr[keep]
    row_q = items.q_indices[ranges(q_start, q_start + nq)]  # a tile takes its item's queries in order
    # KV slots
    seg_len = seg_hi - seg_lo
    kv_indices = _gather_slots(tree, tree.kv_indptr[seg_node] + seg_lo, seg_len)
    seg_kv = np.cumsum(seg_len) - seg_len  # each segment's first entry
    # entries holding the last token of their node: at most one per segment
    node_len = tree.lengths[seg_node]
    at_tail = (seg_lo < node_len) & (node_len <= seg_hi)
    tail = (seg_kv + node_len - 1 - seg_lo)[at_tail]
    item_kv_start = np.concatenate(([0], np.cumsum(length)))[:-1]
    # work units = query tiles
    w_item = np.repeat(np.arange(n_items), tiles)
    w_first = np.cumsum(tiles) - tiles
    w_tile = np.arange(w_item.size) - w_first[w_item]
    w_rows = np.minimum(q_per_tile[w_item], nq[w_item] - w_tile * q_per_tile[w_item])
    work_row_indptr = np.concatenate(([0], np.cumsum(w_rows)))
    work_kv_start = item_kv_start[w_item]
    work_kv_end = work_kv_start + length[w_item]
    merge_order = group_order(row_q, tree.num_queries)
    if merge_order is None:
        merge_order = np.arange(row_q.size)
    q_rows = np.bincount(row_q, minlength=tree.num_queries)
    merge_indptr = np.concatenate(([0], np.cumsum(q_rows)))
    row_direct = q_rows[row_q] == 1
    num_direct = int(np.count_nonzero(row_direct))
    merge_q = np.flatnonzero(q_rows != 1)
    # launches: items (so work units) are grouped by shape. A launch applies the tree mask when
    # one of its items needs it (an extra launch would cost more)
    first = [0] + (np.flatnonzero(shape[1:] != shape[:-1]) + 1).tolist()
    if n_items:
        item_masked = np.repeat(np.logical_or.reduceat(item_masked, first), np.diff(first + [n_items]))
    w_bounds = np.append(w_first, w_item.size).tolist()
    launches = []
    for a, b in zip(first, first[1:] + [n_items]):
        if w_bounds[b] > w_bounds[a]:
            block_n, num_warps, num_stages = kv_cfgs[int(shape[a]) % len(kv_cfgs)]
            launches.append(Launch(int(block_m[a]), block_n, w_bounds[a], w_bounds[b], num_warps, num_stages,
                                   masked=bool(item_masked[a])))
    # tree mask, built as int32: each entry's node range and position in its node
    mask, seg_mask = [None] * 5, [None] * 5
    if needs_mask:
        seg_mask = [seg_len, seg_lo.astype(np.int32), topo.tin[seg_node].astype(np.int32),
                    topo.tout[seg_node].astype(np.int32), np.flatnonzero(at_tail)]
        mask = [np.repeat(seg_mask[2], seg_len), np.repeat(seg_mask[3], seg_len),
                _positions(seg_mask[1], seg_len, seg_kv, kv_indices.size),
                topo.tin[tree.query_nodes], tree.query_prefix]
    # IO
    hq, hkv, d, eb = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim, heads.elem_bytes
    kv_tok = int(length.sum())
    kv_tok_tiles = int((length * tiles).sum())
    io = PlanIO(
        kv=kv_tok * hkv * d * 2 * eb,
        kv_tile_rereads=(kv_tok_tiles - kv_tok) * hkv * d * 2 * eb,
        queries=int(row_q.size) * hq * d * eb,
        partial_write=(int(row_q.size) - num_direct) * heads.partial_row_bytes(),
        partial_read=(int(row_q.size) - num_direct) * heads.partial_row_bytes(),
        mask=int((length * tiles)[item_masked].sum()) * 3 * 4 * hkv if needs_mask else 0,
        index=kv_tok_tiles * 4 * hkv,
        output=tree.num_queries * hq * d * eb,
    )
    t, h = _to_tensors({
        "kv_indices": kv_indices, "work_kv_start": work_kv_start, "work_kv_end": work_kv_end,
        "work_row_indptr": work_row_indptr, "row_q_indices": row_q, "merge_indptr": merge_indptr,
        "merge_indices": merge_order, "row_direct": row_direct, "merge_q_indices": merge_q,
        "mask_lo": mask[0], "mask_hi": mask[1], "mask_pos": mask[2],
        "query_pos": mask[3], "query_prefix": mask[4]}, device)
    min_slots = int(kv_indices.max()) + 1 if kv_indices.size else 0
    tail_node = seg_node[at_tail].astype(np.intp, copy=False)
    start_tails = np.searchsorted(tail, work_kv_start)
    w_masked = item_masked[w_item]
    end_tails = np.searchsorted(tail, work_kv_end)
    return Plan(
        strategy=strategy, requested_strategy=requested_strategy or strategy, heads=heads,
        num_queries=tree.num_queries, page_size=tree.page_size, min_slots=min_slots,
        kv_indices=t["kv_indices"], work_kv_start=t["work_kv_start"], work_kv_end=t["work_kv_end"],
        work_row_indptr=t["work_row_indptr"], row_q_indices=t["row_q_indices"],
        merge_indptr=t["merge_indptr"], merge_indices=t["merge_indices"], row_direct=t["row_direct"],
        merge_q_indices=t["merge_q_indices"], num_direct=num_direct, mask_lo=t["mask_lo"],
        mask_hi=t["mask_hi"], mask_pos=t["mask_pos"], query_pos=t["query_pos"],
        query_prefix=t["query_prefix"], launches=tuple(launches), io=io, num_items=n_items, reason=reason,
        candidates=candidates,
        host=PlanHost(kv_slots=h["kv_indices"], tail_pos=tail.astype(np.int32),
                      tail_node=tail_node, seg_len=seg_mask[0], seg_lo=seg_mask[1], seg_tin=seg_mask[2],
                      seg_tout=seg_mask[3], tail_seg=seg_mask[4],
                      work_kv_start=h["work_kv_start"], work_kv_end=h["work_kv_end"],
                      start_tails=start_tails, end_tails=end_tails,
                      tail_cover=_cover(start_tails, end_tails, tail.size),
                      tail_cover_masked=_cover(start_tails[w_masked], end_tails[w_masked], tail.size),
                      saw_all=tree.query_prefix == tree.lengths[tree.query_nodes], tree=tree),
    )
