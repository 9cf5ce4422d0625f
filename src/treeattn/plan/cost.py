"""Device cost model shared by planners that balance work and by ``auto``.

The item-shaping constants (``target_programs``, ``min_split_tokens``, ``deft_chunk_tokens``,
``fasttree_*``) decide the plans the planners make. The other constants are only used by
:meth:`CostModel.estimate`, which ``auto`` calls to rate every strategy's work items; they describe
an NVIDIA H200 (132 SMs, ~4.25 TB/s copy bandwidth) and were fitted by
``benchmarks/fit_cost_model.py`` on ``benchmarks/results/h200_kernels.json`` (CUDA-graph latencies of
every strategy on the 96 kernel-suite cases; benchmarks/NOTES.md). They only steer choices, so plans
are identical on every host (tests on CPU plan exactly what the GPU runs).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from treeattn.plan.plan import (
    SHORT_ITEM_TOKENS,
    TILE_LONG,
    TILE_LONG_HEAD256,
    TILE_SHORT,
    HeadConfig,
    _block_m_choices,
)

__all__ = ["CostModel", "LaunchSlots", "launch_features", "launch_slots", "launches_by_group"]


def launch_features(item_len: np.ndarray, item_queries: np.ndarray, heads: HeadConfig) -> np.ndarray:
    """float64 [launches, 5]: ``(block_m, block_n, programs, program_tiles, max_tiles)`` of each
    attention launch the plan builder would make for these items (items without tokens or queries
    left out).

    As in :func:`treeattn.plan.build.build_plan`: an item's query tile is the smallest ``block_m``
    holding its rows (queries x GQA group), split beyond the largest; its KV tile is ``block_n``
    32 or 64 by length; one launch per ``(block_m, block_n)``, one program per (query tile, KV
    head). ``program_tiles`` sums the KV tiles (loop iterations) of all programs of a launch,
    ``max_tiles`` is the longest program's.
    """
    length = np.asarray(item_len, dtype=np.int64)
    nq = np.asarray(item_queries, dtype=np.int64)
    keep = (length > 0) & (nq > 0)
    if not keep.all():
        length, nq = length[keep], nq[keep]
    return np.array(_launches(length, nq, heads), dtype=np.float64).reshape(-1, 7)[:, :5]


@functools.lru_cache(maxsize=64)
def _tile_tables(group: int, head_dim: int) -> tuple:
    """``(block_m, block_n, q_shape, q_last, short_bits, long_bits)``: the query and KV tile of each
    launch shape (a query-tile height by the short and the long KV tile config), the shape (short
    KV tiles) of an item of ``min(queries, q_last + 1)`` queries (int64 [q_last + 2]), the queries
    the tallest query tile holds, and log2 of the short and long KV tile (long None when both
    are one launch config)."""
    heights = np.array(_block_m_choices(group))
    long_cfg = TILE_LONG if head_dim <= 128 else TILE_LONG_HEAD256
    q_last = max(int(heights[-1]) // group, 1)
    # an item's query tile is the smallest height holding its rows (queries x GQA group); the
    # tallest beyond it
    m_idx = np.minimum(np.searchsorted(heights, np.arange(q_last + 2) * group), heights.size - 1)
    short_n, long_n = TILE_SHORT[0], long_cfg[0]
    return (heights.repeat(2), np.tile([short_n, long_n], heights.size), 2 * m_idx, q_last,
            short_n.bit_length() - 1, long_n.bit_length() - 1 if long_cfg != TILE_SHORT else None)


def _launches(length: np.ndarray, nq: np.ndarray, heads: HeadConfig, masked=None) -> list:
    """:func:`launch_features` of items that all have tokens and queries, as a list of tuples,
    each with a sixth entry: whether the launch applies the tree mask (one of its items is
    flagged in per-item ``masked``, as the plan builder decides; False without flags)."""
    return _launches_many([(length, nq, masked)], heads)[0]


def _launches_many(sets: list, heads: HeadConfig) -> list:
    """:func:`_launches` of several ``(length, nq, masked)`` item sets in one pass (``auto`` rates
    every strategy's items: few numpy calls for all of them)."""
    sizes = [s[0].size for s in sets]
    if not sum(sizes):
        return [[] for _ in sets]
    length, nq = (np.concatenate(a) if len(sets) > 1 else a[0] for a in zip(*(s[:2] for s in sets)))
    group = np.arange(len(sets)).repeat(sizes) if len(sets) > 1 else 0
    flagged = None
    if any(s[2] is not None for s in sets):
        flagged = np.concatenate([np.zeros(n, dtype=bool) if s[2] is None else s[2] for n, s in zip(sizes, sets)])
    return launches_by_group(length, nq, group, len(sets), flagged, heads)


def launches_by_group(length: np.ndarray, nq: np.ndarray, group, num_groups: int, flagged: np.ndarray | None,
                      heads: HeadConfig, lead: np.ndarray | None = None) -> list:
    """:func:`_launches` of the items of ``num_groups`` sets at once: ``group`` (int [items] or a
    scalar) is each item's set, ``num_groups`` for items to leave out; ``flagged`` (bool [items]
    or None) the items whose launch applies the mask, ``lead`` (int [items] or None) the tokens
    of each item before its mask starts (the kernel runs the whole KV tiles before it unmasked;
    -1 or None: not known, and then all tiles of the item's launch count as masked). Returns a
    list of launches per set, each with a seventh entry: the masked KV tiles of its flagged
    items' programs."""
    return launch_slots(length, nq, group, num_groups, flagged, heads, lead).launches()


@dataclass(frozen=True)
class LaunchSlots:
    """The launches of several item sets as arrays: one slot per (set, launch shape), a launch
    where it has programs (:func:`launch_slots`). All int64 but ``flags``; per shape ``[S]`` or
    per slot ``[G, S]``.

    Attributes
    ----------
    block_m, block_n : [S]
        Query and KV tile of each shape.
    programs, work, longest, masked_work : [G, S]
        Programs, KV tiles of all programs, KV tiles of the longest program and masked KV tiles
        (counted as :func:`launches_by_group`'s seventh entry).
    flags : bool [G, S]
        The launch applies the mask.
    live : bool [G, S]
        The slot is a launch.
    """

    block_m: np.ndarray
    block_n: np.ndarray
    programs: np.ndarray
    work: np.ndarray
    longest: np.ndarray
    flags: np.ndarray
    masked_work: np.ndarray
    live: np.ndarray

    def launches(self) -> list:
        """Each set's launches as :func:`launches_by_group` lists them (plain numbers)."""
        cols = [np.broadcast_to(a, self.live.shape)[self.live].tolist()
                for a in (self.block_m, self.block_n, self.programs, self.work, self.longest, self.flags,
                          self.masked_work)]
        rows = list(zip(*cols))
        bounds = [0, *itertools.accumulate(self.live.sum(axis=1).tolist())]
        return [rows[a:b] for a, b in zip(bounds, bounds[1:])]


def launch_slots(length: np.ndarray, nq: np.ndarray, group, num_groups: int, flagged: np.ndarray | None,
                 heads: HeadConfig, lead: np.ndarray | None = None) -> LaunchSlots:
    """:func:`launches_by_group`'s launches as :class:`LaunchSlots` (``num_groups`` sets; few numpy
    calls for all of them)."""
    block_m, block_n, q_shape, q_last, short_bits, long_bits = _tile_tables(heads.group, heads.head_dim)
    n_shapes = block_m.size
    shape = q_shape[np.minimum(nq, q_last + 1)]
    # an item whose rows fit a smaller tile has one; the others split into tallest tiles, so
    # ceil(queries / queries of the tallest) is every item's tile count
    if q_last & (q_last - 1) == 0:
        tiles = (nq + (q_last - 1)) >> (q_last.bit_length() - 1)
    else:
        tiles = -(-nq // q_last)
    # one launch per (set, block_m, KV tile config), found without sorting; KV tiles are powers
    # of two
    if long_bits is None:
        kv_bits = short_bits
    else:
        is_long = length > SHORT_ITEM_TOKENS
        kv_bits = np.where(is_long, long_bits, short_bits)
        shape += is_long
    kv_tiles = ((length - 1) >> kv_bits) + 1
    shape += group * n_shapes
    # integer sums (ufunc.at is cheaper than weighted bincount here)
    size = (num_groups + 1) * n_shapes
    programs = np.zeros(size, dtype=np.int64)
    np.add.at(programs, shape, tiles)
    work = np.zeros_like(programs)
    np.add.at(work, shape, tiles * kv_tiles)
    longest = np.zeros_like(programs)
    np.maximum.at(longest, shape, kv_tiles)
    flags = np.zeros(size, dtype=bool)
    masked_work = np.zeros_like(programs)
    if flagged is not None:
        # (a boolean ufunc.at is ~10x slower than counting the flagged items' shapes)
        flags = np.bincount(shape[flagged], minlength=size) > 0
        if lead is None:
            masked_work = work * flags
        else:  # items of a known lead count their tiles from it; a launch with others, all of its tiles
            known = flagged & (lead >= 0)
            counted = tiles * (kv_tiles - (lead >> kv_bits))
            np.add.at(masked_work, shape[known], counted[known])
            whole = np.bincount(shape[flagged & (lead < 0)], minlength=size) > 0
            masked_work[whole] = work[whole]
    hkv = heads.num_kv_heads
    shapes = (num_groups, n_shapes)
    size -= n_shapes
    return LaunchSlots(block_m, block_n, (programs[:size] * hkv).reshape(shapes), (work[:size] * hkv).reshape(shapes),
                       longest[:size].reshape(shapes), flags[:size].reshape(shapes),
                       (masked_work[:size] * hkv).reshape(shapes), programs[:size].reshape(shapes) > 0)


@functools.lru_cache(maxsize=16)
def _dtype_bytes(dtype) -> int:
    # (cached: torch's itemsize property costs more than the lookup in auto's rating loop)
    return dtype.itemsize


def _elem_bytes(heads: HeadConfig) -> int:
    return _dtype_bytes(heads.dtype)


@dataclass(frozen=True)
class CostModel:
    num_sms: int = 132
    #: bytes per second the whole GPU streams from HBM
    bandwidth: float = 4.25e12
    # -- attention kernel. Fitted by benchmarks/fit_cost_model.py on results/h200_kernels.json
    # (every strategy's CUDA-graph latency on the 96 suite cases) and results/h200_probe_paths.json
    # (every ``paths`` variant on the same cases); benchmarks/NOTES.md.
    #: KV bytes per second and tile FLOP/s of one program on its own (its gather loop is
    #: latency-bound; a lone program's 4 warps keep only part of the SM busy)
    program_bandwidth: float = 18.3e9
    program_flops: float = 3.09e12
    #: SM time of one program's fixed work (index, query and output round trips)
    program_overhead_s: float = 0.891e-6
    #: KV bytes per second one SM streams when full of programs (shared KV mostly hits L2)
    sm_bandwidth: float = 84.3e9
    #: tile FLOP/s of one SM (QK^T and PV over the padded block_m x block_n tile), and for query
    #: tiles of fewer than 64 rows (Triton issues Hopper's warpgroup MMA from 64 rows; shorter
    #: tiles take the older MMA: with its own rate the refit picks within 5% on 92/96 suite cases
    #: instead of 84/96, benchmarks/NOTES.md)
    sm_flops: float = 1.97e12
    sm_flops_small: float = 1.545e12
    #: extra cost of a masked KV tile (the tree mask's loads and compares; a masked item's tiles
    #: before its mask starts run unmasked, where the planner knows them: ``WorkItems.mask_lead``)
    mask_cost: float = 0.22
    #: exponent of the soft maximum of a launch's SM time and its longest program
    overlap_exponent: float = 55.8
    #: one kernel launch (CUDA-graph node: ramp-up and tail; the fit puts it at zero, the fixed
    #: and merge terms absorbing it) and one merge step (one partial row on the longest query's
    #: chain, latency-bound)
    launch_overhead_s: float = 0.0
    merge_step_s: float = 0.402e-6
    #: what a direct plan (no merge launch) saves beyond the fitted merge term, which ranks
    #: merging plans among themselves: a merge launch takes 7-14 us under graph replay even for
    #: one query (benchmarks/floor.py). On the kernel suite's timings any value in 6-10 us makes
    #: the same choices (benchmarks/probe_direct.py, NOTES.md); kept below fixed_overhead_s
    direct_saving_s: float = 6e-6
    #: a plan whose longest program takes at least this long on its own runs its launches tallest
    #: query tile first (the builder orders them shortest first, by shape): under graph replay
    #: with side streams the first launch's programs are dispatched first, so a long program of a
    #: tall launch queued last ran alone after the others (benchmarks/probe_order.py: 10 us
    #: separates the suite plans that gain from the few small ones that lose, NOTES.md)
    tall_first_s: float = 10e-6
    #: the lone-program rates that rule times programs with (those the cost model had when it
    #: was measured, session 14; the fitted ``program_*`` rates rank plans)
    tall_first_bandwidth: float = 34.5e9
    tall_first_flops: float = 1.61e12
    #: a plan's launches run side by side (:class:`~treeattn.TreeAttention` side streams under a
    #: CUDA graph); False where they run one after another (no side streams: the engine), where
    #: no plan runs tallest first and launches are rated one after another
    side_streams: bool = True
    #: the device loads tiles through tensor descriptors (Hopper's TMA), which tall launches over
    #: long runs of slots take (:func:`~treeattn.plan.addressing.tma_launches`; rated like
    #: pointer loads). TreeAttention sets it on CUDA devices of compute capability 9.0 or later
    tma: bool = False
    #: the same for every plan (query and output traffic, graph replay); reported, not choosing
    fixed_overhead_s: float = 7.06e-6
    #: ``auto`` takes the plan with the fewest kernels among those estimated within this fraction
    #: of the best (launches that run side by side, tallest first, count as one): closer estimates
    #: are within the model's error (rms log error ~0.15). On the kernel suite's timings
    #: (results/h200_kernels.json at 29a76a5), 0%, 2% and 5% all pick within 5% of the fastest
    #: strategy on 94/96 cases (worst 1.14x); counting those launches one each, 94, 93 and 92 (the
    #: last with a 1.27x miss)
    choice_margin: float = 0.02
    #: let ``node`` and ``greedy`` pack small leaf items (:mod:`treeattn.plan.packing`)
    leaf_packing: bool = True
    # -- item shaping (decide the plans; not fitted)
    #: programs the attention grid should have before long items are split
    target_programs: int = 1056
    min_split_tokens: int = 256
    #: concurrent programs per SM a fair share of the work is measured against (greedy's balance
    #: split): ~1.5 was fastest for Medusa trees over 1K-3K-token contexts
    #: (benchmarks/sweep_tiles.py)
    balance_programs_per_sm: float = 1.5
    #: DeFT's KV chunk / block size
    deft_chunk_tokens: int = 128
    # FastTree's padding and reduction coefficients (alpha, beta, gamma) and tile sizes
    fasttree_alpha: float = 1.0
    fasttree_beta: float = 1.0
    fasttree_gamma: float = 4.0
    fasttree_tile_q: int = 16
    fasttree_tile_kv: int = 64

    @property
    def balance_slots(self) -> int:
        """Concurrent programs of the balance split: ``num_sms * balance_programs_per_sm``."""
        return max(1, round(self.num_sms * self.balance_programs_per_sm))

    def program_s(self, block_m, block_n, kv_tiles, heads: HeadConfig, *, tall_first: bool = False):
        """Seconds of one unmasked program over ``kv_tiles`` KV tiles on its own (at the rates of
        the tall-first rule with ``tall_first``); numbers or int arrays (broadcast, float64)."""
        d = heads.head_dim
        bandwidth, flops = ((self.tall_first_bandwidth, self.tall_first_flops) if tall_first
                            else (self.program_bandwidth, self.program_flops))
        return kv_tiles * (block_n * d * 2 * _elem_bytes(heads) / bandwidth + 4.0 * block_m * block_n * d / flops)

    def tall_first(self, longest_s: list) -> bool:
        """Whether launches whose longest programs take ``longest_s`` seconds (:meth:`program_s`
        with ``tall_first``) run the tallest query tiles first (:attr:`Plan.tall_first`): with some
        program of at least ``tall_first_s``, that program is the critical path and should start
        at once."""
        return self.side_streams and len(longest_s) > 1 and max(longest_s) >= self.tall_first_s

    def estimate(self, item_len: np.ndarray, item_queries: np.ndarray, heads: HeadConfig, *,
                 merge_rows_max: int = 1, num_queries: int | None = None,
                 kv_tokens: int | None = None, masked: bool = False) -> float:
        """Seconds for one run (attention launches + merge) of items with these KV lengths and
        query counts; see :meth:`breakdown`."""
        return self.breakdown(item_len, item_queries, heads, merge_rows_max=merge_rows_max,
                              num_queries=num_queries, kv_tokens=kv_tokens, masked=masked)["total"]

    def breakdown(self, item_len: np.ndarray, item_queries: np.ndarray, heads: HeadConfig, *,
                  merge_rows_max: int = 1, num_queries: int | None = None,
                  kv_tokens: int | None = None, masked: bool | np.ndarray = False) -> dict:
        """Seconds of one run, by part: ``attention``, ``merge``, ``total`` (and ``launches``,
        ``masked``, ``tall_first``).

        Attention, per launch (:func:`launch_features`): a KV tile costs an SM
        ``tile bytes / sm_bandwidth + tile FLOPs / sm_flops`` and a program ``program_overhead_s``
        more; the launch's SM time is spread over ``num_sms`` SMs, softly no less than its longest
        program on its own (``program_bandwidth``, ``program_flops``), plus
        ``launch_overhead_s``. Launches are modelled one after another (under a CUDA graph they
        overlap on side streams; the fitted constants absorb it, and a model that adds their SM
        times fitted worse: benchmarks/NOTES.md), except when the plan runs its tallest launch
        first (:meth:`tall_first`): then their SM times add up, softly no less than the longest
        program. All of them cannot beat HBM
        bandwidth for the unique KV (``kv_tokens``, default: every item token) and the partial
        rows written. The tree mask (``masked``: for the plan, or per item, a launch then being
        masked when one of its items is) makes every KV tile of a masked launch ``1 + mask_cost`` times
        dearer. Merge: the longest chain of merge steps (``merge_rows_max``), no faster than
        reading the partial rows and writing the output, plus a launch; none when every query
        has one row (the kernel writes the output). ``num_queries`` defaults to the rows.
        """
        length = np.asarray(item_len, dtype=np.int64)
        nq = np.asarray(item_queries, dtype=np.int64)
        used = (length > 0) & (nq > 0)
        if isinstance(masked, np.ndarray):
            masked = masked.astype(bool)
        if not used.all():
            length, nq = length[used], nq[used]
            masked = masked[used] if isinstance(masked, np.ndarray) else masked
        return self._breakdown(length, nq, heads, merge_rows_max, num_queries, kv_tokens, masked)

    def _breakdown(self, length: np.ndarray, nq: np.ndarray, heads: HeadConfig, merge_rows_max: int,
                   num_queries: int | None, kv_tokens: int | None, masked: bool) -> dict:
        """:meth:`breakdown` of int64 items that all have tokens and queries."""
        return self._breakdown_many([(length, nq, merge_rows_max, num_queries, kv_tokens, masked)], heads)[0]

    def _breakdown_many(self, sets: list, heads: HeadConfig) -> list:
        """:meth:`_breakdown` of several ``(length, nq, merge_rows_max, num_queries, kv_tokens,
        masked)`` item sets (their launches found in one pass)."""
        all_launches = _launches_many([(s[0], s[1], s[5] if isinstance(s[5], np.ndarray) else None)
                                       for s in sets], heads)
        return [self.total(int(length.sum() if kv_tokens is None else kv_tokens), int(nq.sum()), merge_rows_max,
                           num_queries, bool(masked.any()) if isinstance(masked, np.ndarray) else bool(masked),
                           isinstance(masked, np.ndarray), launches, heads)
                for (length, nq, merge_rows_max, num_queries, kv_tokens, masked), launches in zip(sets, all_launches)]

    def total(self, kv_tokens: int, rows: int, merge_rows_max: int, num_queries: int | None, masked: bool,
              per_item: bool, launches: list, heads: HeadConfig) -> dict:
        """:meth:`breakdown` of items with ``kv_tokens`` unique tokens, ``rows`` (item, query) pairs
        and these launches (:func:`launches_by_group`): every launch is masked when ``masked``, or
        those flagged when ``per_item``."""
        cols = [np.array(c) for c in zip(*launches)] if launches else [np.zeros(0, dtype=np.int64)] * 7
        block_m, block_n, programs, work, longest, flags, masked_work = cols
        slots = LaunchSlots(block_m, block_n, *(a.reshape(1, -1) for a in (programs, work, longest, flags.astype(bool),
                                                                            masked_work)),
                            np.ones((1, len(launches)), dtype=bool))
        return self.totals([(kv_tokens, rows, merge_rows_max, num_queries, masked, per_item)], slots, heads)[0]

    def totals(self, sets: list, slots: LaunchSlots, heads: HeadConfig) -> list:
        """:meth:`total` of several item sets: ``sets`` holds each one's ``(kv_tokens, rows,
        merge_rows_max, num_queries, masked, per_item)`` and ``slots`` their launches, a row per
        set (:func:`launch_slots`). Each launch's SM time and longest program are found for all
        sets at once (the same float operations as one at a time)."""
        hq, hkv, d, eb = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim, _elem_bytes(heads)
        tok_bytes = d * 2 * eb  # K and V of one token of one KV head
        p = self.overlap_exponent
        block_m, block_n, work, longest = slots.block_m, slots.block_n, slots.work, slots.longest
        # a set not rated per item: all its launches masked or none
        per_item = np.array([s[5] for s in sets], dtype=bool)[:, None]
        masked = np.array([s[4] for s in sets], dtype=bool)[:, None]
        launch_masked = np.where(per_item, slots.flags, masked)
        masked_work = np.where(per_item, slots.masked_work, work * masked)
        mask = 1.0 + self.mask_cost * launch_masked
        flops = np.where(block_m >= 64, self.sm_flops, self.sm_flops_small)
        tile_sm_s = block_n * tok_bytes / self.sm_bandwidth + 4.0 * block_m * block_n * d / flops
        work_s = (work + self.mask_cost * masked_work) * tile_sm_s
        live = slots.live
        sm_all = ((slots.programs * self.program_overhead_s + work_s) / self.num_sms)[live].tolist()
        longest_all = (self.program_s(block_m, block_n, longest, heads) * mask)[live].tolist()
        rule_all = self.program_s(block_m, block_n, longest, heads, tall_first=True)[live].tolist()
        bounds = [0, *itertools.accumulate(live.sum(axis=1).tolist())]
        out = []
        for (kv_tokens, rows, merge_rows_max, num_queries, set_masked, _), lo, hi in zip(sets, bounds, bounds[1:]):
            num_queries = rows if num_queries is None else int(num_queries)
            sm_times, longest_times = sm_all[lo:hi], longest_all[lo:hi]
            tall_first = self.tall_first(rule_all[lo:hi])
            if tall_first:
                # the longest programs start first and run beside the other launches' programs
                attn = (sum(sm_times) ** p + max(longest_times) ** p) ** (1.0 / p)
            else:
                attn = sum((a ** p + b ** p) ** (1.0 / p) for a, b in zip(sm_times, longest_times))
            attn += (hi - lo) * self.launch_overhead_s
            # every query with a single row: the attention kernel writes the output, no merge launch
            direct = merge_rows_max <= 1 and rows == num_queries
            partial_bytes = 0 if direct else rows * heads.partial_row_bytes()
            attn = max(attn, (kv_tokens * hkv * tok_bytes + partial_bytes) / self.bandwidth)
            merge = 0.0 if direct else max(merge_rows_max * self.merge_step_s,
                                           (partial_bytes + num_queries * hq * d * eb) / self.bandwidth
                                           ) + self.launch_overhead_s
            out.append({"attention": attn, "merge": merge, "launches": hi - lo, "masked": set_masked,
                        "tall_first": tall_first,
                        "total": attn + merge + self.fixed_overhead_s - self.direct_saving_s * (direct and hi > lo)})
        return out
