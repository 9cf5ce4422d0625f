"""The Plan: work items lowered to int32 index tensors, built once per tree and reused by every
layer and decode step until the tree changes."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from treeattn.plan.select.profiles import DeviceProfile
from treeattn.tree import DecodingTree

__all__ = ["Plan", "PlanIO", "PlanHost", "Launch", "HeadConfig", "launch_shapes", "masked_entries",
           "masked_entries_by_unit", "unit_mask_terms"]

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
    one; a query's only row goes straight to the output). ``mask`` is the tree mask's three words
    per KV entry the kernel masks (:func:`masked_entries`), per KV head.
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

    ``heads_inner``: the grid runs a work unit's KV heads next to each other (one grid dimension,
    the KV head varying fastest) instead of all work units of one KV head first. The builder sets
    it for launches of long work units (the device profile's ``heads_inner_min_tokens``) whose
    items have one query tile each: programs reading the same tokens' ``[Hkv, D]`` rows at the
    same time share DRAM pages.

    ``mask_split``: a masked launch runs each unit's tiles before its mask start unmasked, in a
    loop of their own; set where some unit has a whole tile before its mask start (the second
    loop slows the others, e.g. packed leaves masked from their start).

    ``contig``: every work unit of the launch reads one run of consecutive slots, so the kernel
    computes its K/V addresses instead of loading them from ``kv_indices`` (see
    :func:`~treeattn.plan.lower.addressing.contig_launches`, which also sets the tile config of the
    launches that keep gathering: two warps for many 32-row programs, 32-token tiles and a deep
    pipeline for tall ones).

    ``split_tail``: the kernel runs each unmasked unit's whole KV tiles with a select-free
    softmax step and its last, partial tile after the loop (set for tall query tiles, whose
    tiles are bound by those per-entry instructions; see
    :func:`~treeattn.plan.lower.addressing.split_tails`).

    ``tma`` (with ``contig``): the kernel loads the K/V of whole tiles through tensor
    descriptors (Hopper's TMA) where the caches' layout allows; see
    :func:`~treeattn.plan.lower.addressing.tma_launches`.

    ``programs`` (> 0): a persistent launch of at most that many programs, each looping over
    the launch's units x KV heads, so that all of them start at once and the launch after it
    runs beside them (:func:`~treeattn.plan.lower.addressing.persistent_tall`).
    """

    block_m: int
    block_n: int
    work_start: int
    work_end: int
    num_warps: int = 4
    num_stages: int = 2
    masked: bool = True
    heads_inner: bool = False
    mask_split: bool = False
    contig: bool = False
    split_tail: bool = False
    tma: bool = False
    programs: int = 0


@dataclass(frozen=True, eq=False)
class PlanHost:
    """Host copies a plan keeps for its lazy update (:func:`treeattn.plan.lower.update.update_plan`).

    Attributes
    ----------
    kv_slots : int32 [nnz_kv]
        The planned slots (``kv_indices`` on the host).
    tail_pos : int32 [n_tails]
        Every planned entry that is the last token of its node.
    tail_node : intp [n_tails]
        The node of each.
    untailed : intp
        Nodes whose last token no entry holds (appending to them needs a new plan).
    seg_len : int64 [S] or None
        Entries of each segment (a run of one node's tokens) of the KV list, in order.
    seg_rec : int32 [S, 4] or None
        The tree mask by segment, from which updates rebuild it: each segment's node's pre-order
        range, the position in its node of its first entry, 0. Both are None without a mask.
    tail_seg : intp [n_tails] or None
        The segment ending at each tail (plans with a tree mask).
    work_kv_start, work_kv_end : int32 [W]
    start_tails, end_tails : intp [W]
        Tails before each work unit's start and end (``tail_pos < work_kv_start``); fixed for
        the plan's life, as updates only insert entries right after tails.
    tail_cover : int64 [n_tails]
        Work units whose KV range holds each tail (``start_tails <= k < end_tails``).
    work_mask_start : int32 [W]
        Host copy of :attr:`Plan.work_mask_start`.
    mask_tails : intp [W] or None
        Tails before each mask start, like ``start_tails`` (plans with a tree mask; without one
        the mask starts are the ends).
    unit_mask : tuple or None
        :func:`unit_mask_terms` of the plan's launches (plans with a tree mask), from which
        updates count the masked entries.
    saw_all : bool [Q]
        Queries that see the whole of their node.
    gather_launches : tuple of Launch
    profile : DeviceProfile
        The plan's launches before :func:`~treeattn.plan.lower.addressing.contig_launches`, and the
        device profile it used (an update sets ``contig`` again for its new KV list, by the same
        rules and tiles).
    tree : DecodingTree
        The tree the plan was made for.
    """

    kv_slots: np.ndarray
    tail_pos: np.ndarray
    tail_node: np.ndarray
    untailed: np.ndarray
    seg_len: np.ndarray | None
    seg_rec: np.ndarray | None
    tail_seg: np.ndarray | None
    work_kv_start: np.ndarray
    work_kv_end: np.ndarray
    start_tails: np.ndarray
    end_tails: np.ndarray
    tail_cover: np.ndarray
    work_mask_start: np.ndarray
    mask_tails: np.ndarray | None
    unit_mask: tuple | None
    saw_all: np.ndarray
    gather_launches: tuple
    profile: DeviceProfile
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
    work_mask_start : int32 [W]
        First entry of each work unit from which the tree mask applies: entries
        ``[work_kv_start, work_mask_start)`` are visible to every row of the unit, and masked
        launches run the KV tiles wholly before it without the mask. ``work_kv_start`` (mask
        everything) is always correct; ``work_kv_end`` means the unit needs no mask.
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
    merge_rows_max : int
        The most partial rows a merged query has (host copy; 0 without a merge): the merge
        kernel's row tile.
    tree_mask : int32 [nnz_kv, 4] or None
        Tree mask, present when some query of an item sees only part of it: a record a KV entry,
        ``(lo, hi, pos_base, 0)``. Entry ``e`` (a token at offset ``pos = pos_base + e`` of a node
        with pre-order range ``[lo, hi)``) is visible to query ``q`` iff ``lo <= qpos < hi`` and
        (``lo < qpos`` or ``pos < qprefix``), with ``qpos, qprefix = query_pos[q],
        query_prefix[q]``. This is DeFT's bit causal mask in O(1) words per token for any number
        of queries; the entries of a segment of one node share one record (``pos_base`` is the
        node offset minus the entry index), so the lazy update rebuilds the mask by one repeat.
    query_pos, query_prefix : int32 [Q] or None
    launches : tuple of Launch
        In work-unit order, shortest query tile first.
    tall_first : bool
        Run the launches in reverse order: some program of a tall launch is long enough to be
        the critical path (:meth:`CostModel.tall_first`), and the first launch's programs are
        dispatched first.
    merge_launch : int
        The launch (index into ``launches``) that holds exactly one partial row of every query
        that has several, and may merge them (:func:`~treeattn.plan.lower.merge_config.launch_merges`; plans
        of a GQA group below :attr:`CostModel.merge_last_min_group` never do), or -1.
        When it runs last (:attr:`merge_last`) and the launches run in order on one stream, it
        merges each query's rows itself and no merge launch is needed
        (:func:`~treeattn.launchers.partial_attention`'s ``merge_last``).
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
    work_mask_start: torch.Tensor
    work_row_indptr: torch.Tensor
    row_q_indices: torch.Tensor
    merge_indptr: torch.Tensor
    merge_indices: torch.Tensor
    row_direct: torch.Tensor
    merge_q_indices: torch.Tensor
    num_direct: int
    tree_mask: torch.Tensor | None
    query_pos: torch.Tensor | None
    query_prefix: torch.Tensor | None
    launches: tuple
    io: PlanIO
    num_items: int
    reason: str = ""
    host: PlanHost | None = None
    candidates: tuple = ()
    tall_first: bool = False
    merge_rows_max: int = 0
    merge_launch: int = -1

    @property
    def merge_last(self) -> bool:
        """The launch that runs last (the first with ``tall_first``) can merge every query's
        partial rows (:attr:`merge_launch`)."""
        return self.merge_launch == (0 if self.tall_first else len(self.launches) - 1) >= 0

    @property
    def num_rows(self) -> int:
        return int(self.row_q_indices.numel())

    @property
    def num_work(self) -> int:
        return int(self.work_kv_start.numel())

    @property
    def has_mask(self) -> bool:
        return self.tree_mask is not None

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
        """Why this plan: the strategy, its choice (for ``auto``), its launches and its IO."""
        io = self.io
        lines = [f"strategy={self.strategy}: {self.num_items} work items -> {self.num_work} "
                 f"query tiles in {len(self.launches)} launch(es){' (tallest first)' if self.tall_first else ''}, "
                 f"{self.num_rows} rows "
                 f"({self.num_direct} written directly, {self.merge_q_indices.numel()} queries "
                 f"merged{' by the last launch on one stream' if self.merge_last else ''}), "
                 f"mask={'on' if self.has_mask else 'off'}",
                 "launches: " + "; ".join(self._launch_text(ln) for ln in self.launches),
                 f"IO bytes: kv={io.kv:,} (+{io.kv_tile_rereads:,} query-tile re-reads) "
                 f"queries={io.queries:,} partials={io.partial_write + io.partial_read:,} "
                 f"mask={io.mask:,} index={io.index:,} output={io.output:,} total={io.total:,}"]
        if io.mask:
            # both count KV tile-entries of every KV head: the index 4 bytes each, the mask 12
            hkv = self.heads.num_kv_heads
            masked, entries = io.mask // (12 * hkv), io.index // (4 * hkv)
            lines.append(f"tree mask on {masked:,} of {entries:,} KV tile-entries "
                         f"({100 * masked / entries:.1f}%)")
        if self.reason:
            lines.append(self.reason)
        return "\n".join(lines)

    def _launch_text(self, ln: Launch) -> str:
        """One launch as :meth:`explain` lists it: programs, tile, warps, stages, addressing."""
        addressing = "TMA" if ln.tma else "computed addresses" if ln.contig else "gathered slots"
        flags = [name for name, on in (("masked", ln.masked and self.has_mask), ("split tail", ln.split_tail),
                                       ("heads inner", ln.heads_inner)) if on]
        tiles = (ln.work_end - ln.work_start) * self.heads.num_kv_heads
        programs = f"{tiles} programs" if not ln.programs else \
            f"{tiles} tiles in {min(ln.programs, tiles)} persistent programs"
        return (f"{programs} of {ln.block_m}-row x "
                f"{ln.block_n}-token tiles, {ln.num_warps} warps, {ln.num_stages} stages, {addressing}"
                + "".join(f", {f}" for f in flags))


def split_masked_launches(launches, work_kv_start: np.ndarray, work_mask_start: np.ndarray) -> tuple:
    """``launches`` with :attr:`Launch.mask_split` set on the masked ones where some unit has a
    whole KV tile before its mask start."""
    lead = work_mask_start - work_kv_start
    return tuple(dataclasses.replace(ln, mask_split=bool(
        ln.masked and ln.work_end > ln.work_start and lead[ln.work_start: ln.work_end].max() >= ln.block_n))
        for ln in launches)


def masked_entries(work_kv_start: np.ndarray, work_mask_start: np.ndarray, work_kv_end: np.ndarray,
                   launches) -> int:
    """KV entries the kernel applies the tree mask to, over all work units ([W] ranges, one
    integer dtype): in masked launches, from each unit's mask start (rounded down to its
    launch's KV tile; the unit's start unless the launch splits) to its end."""
    sizes = [ln.work_end - ln.work_start for ln in launches]
    block_n = np.repeat(np.array([ln.block_n if ln.masked else 0 for ln in launches], dtype=work_kv_start.dtype),
                        sizes)
    split = np.repeat(np.array([ln.mask_split for ln in launches], dtype=bool), sizes)
    mask_start = np.where(split, work_mask_start, work_kv_start)
    # tiles are powers of two: the start's offset in its tile is a bit mask of its lead
    per_unit = work_kv_end - mask_start + ((mask_start - work_kv_start) & (block_n - 1))
    return int(per_unit[block_n > 0].sum())


def unit_mask_terms(launches, num_work: int) -> tuple:
    """``(masked, align)`` per work unit of these launches, for :func:`masked_entries_by_unit`:
    bool [W] the units of masked launches (None: all of them) and int64 [W] ``-block_n`` for the
    units of launches that split (``~(block_n - 1)``: a mask start's lead rounded down to its KV
    tile), 0 for the others (None: no launch splits)."""
    sizes = [ln.work_end - ln.work_start for ln in launches]
    masked = None
    if sum(sizes) != num_work or not all(ln.masked for ln, n in zip(launches, sizes) if n):
        masked = np.repeat(np.array([ln.masked for ln in launches], dtype=bool), sizes)
    align = None
    if any(ln.masked and ln.mask_split for ln in launches):
        align = np.repeat(np.array([-ln.block_n if ln.masked and ln.mask_split else 0 for ln in launches],
                                   dtype=np.int64), sizes)
    return masked, align


def masked_entries_by_unit(work_kv_start: np.ndarray, work_mask_start: np.ndarray, work_kv_end: np.ndarray,
                           unit_mask: tuple) -> int:
    """:func:`masked_entries` from the launches' :func:`unit_mask_terms`: every entry of a masked
    launch's units but those of whole tiles before a splitting unit's mask start."""
    masked, align = unit_mask
    span = work_kv_end - work_kv_start
    total = int(span.sum() if masked is None else span[masked].sum())
    return total if align is None else total - int(((work_mask_start - work_kv_start) & align).sum())


def _block_m_choices(group: int) -> list:
    return [m for m in BLOCK_M_CHOICES if m >= group] or [1 << (group - 1).bit_length()]


def launch_shapes(heads: HeadConfig, *, profile: DeviceProfile) -> list:
    """Every ``(block_m, block_n, num_warps, num_stages)`` a plan for these heads can launch, at
    the KV tiles of ``profile`` (the cost model's that planned it: its ``tile_short`` and
    :meth:`~treeattn.plan.select.profiles.DeviceProfile.long_tile`)."""
    tiles = sorted({profile.tile_short, profile.long_tile(heads.head_dim)})
    return [(m, *t) for m in _block_m_choices(heads.group) for t in tiles]
