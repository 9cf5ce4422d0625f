"""Device cost model shared by planners that balance work and by ``auto``.

The item-shaping constants (``target_programs``, ``min_split_tokens``, ``deft_chunk_tokens``,
``fasttree_*``) decide the plans the planners make. The device's facts and fitted constants come
from its :class:`~treeattn.plan.select.profiles.DeviceProfile`, which
:meth:`CostModel.estimate` (``auto``'s rating of every strategy's work items) and the lowering
rules read. They only steer choices; without a GPU the profile is the H200's, so tests on a CPU
plan exactly what an H200 runs.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np

from treeattn.plan.lower.addressing import tall_tile, tma_pays
from treeattn.plan.select.launches import LaunchSlots, _launches_many
from treeattn.plan.lower.merge_config import merge_tiled
from treeattn.plan.format import HeadConfig
from treeattn.plan.select.profiles import DeviceProfile, profile_for

__all__ = ["CostModel"]


@functools.lru_cache(maxsize=16)
def _dtype_bytes(dtype) -> int:
    # (cached: torch's itemsize property costs more than the lookup in auto's rating loop)
    return dtype.itemsize


def _elem_bytes(heads: HeadConfig) -> int:
    return _dtype_bytes(heads.dtype)


@dataclass(frozen=True)
class CostModel:
    """Rates a plan's work on a device and shapes the planners' work items.

    ``profile`` holds the device's facts and fitted constants (default: :func:`profile_for` the
    CUDA device in use; :data:`~treeattn.plan.select.profiles.H200` without one); the other fields
    say how plans run and how the planners shape their items.
    """

    profile: DeviceProfile = field(default_factory=profile_for)
    #: a plan's launches run side by side (:class:`~treeattn.TreeAttention` side streams under a
    #: CUDA graph); False where they run one after another (no side streams: the engine), where
    #: no plan runs tallest first and launches are rated one after another
    side_streams: bool = True
    #: the device loads tiles through tensor descriptors (Hopper's TMA), which tall launches over
    #: long runs of slots take (:func:`~treeattn.plan.lower.addressing.tma_launches`). TreeAttention
    #: sets it on CUDA devices of compute capability 9.0 or later
    tma: bool = False
    #: plans run as programmatic dependent launches (``TreeAttention(pdl=True)``, as the engine
    #: runs them): the merge's launch and wait overlap the attention launches, so what a merge of
    #: few queries costs is its own critical path (``merge_tile_step_s``)
    pdl: bool = False
    #: ``auto`` takes the plan with the fewest kernels among those estimated within this fraction
    #: of the best (launches that run side by side, tallest first, count as one): closer estimates
    #: are within the model's error (rms log error ~0.15). On the kernel suite's timings (measured
    #: on an H200), 0%, 2% and 5% all pick within 5% of the fastest strategy on 94/96 cases (worst
    #: 1.14x); counting those launches one each, 94, 93 and 92 (the last with a 1.27x miss)
    choice_margin: float = 0.02
    #: let ``node`` and ``greedy`` pack small leaf items (:mod:`treeattn.plan.strategies.leaf_packing`)
    leaf_packing: bool = True
    # -- item shaping (decide the plans; not fitted)
    #: programs the attention grid should have before long items are split
    target_programs: int = 1056
    min_split_tokens: int = 256
    #: concurrent programs per SM a fair share of the work is measured against (greedy's balance
    #: split): ~1.5 was fastest for Medusa trees over 1K-3K-token contexts (H200)
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
        return max(1, round(self.profile.num_sms * self.balance_programs_per_sm))

    def program_s(self, block_m, block_n, kv_tiles, heads: HeadConfig, *, tall_first: bool = False):
        """Seconds of one unmasked program over ``kv_tiles`` KV tiles on its own (at the rates of
        the tall-first rule with ``tall_first``); numbers or int arrays (broadcast, float64)."""
        d = heads.head_dim
        bandwidth, flops = ((self.profile.tall_first_bandwidth, self.profile.tall_first_flops) if tall_first
                            else (self.profile.program_bandwidth, self.profile.program_flops))
        return kv_tiles * (block_n * d * 2 * _elem_bytes(heads) / bandwidth + 4.0 * block_m * block_n * d / flops)

    def merges_last(self, heads: HeadConfig) -> bool:
        """Whether plans for ``heads`` may let their last launch merge
        (the profile's ``merge_last_min_group``)."""
        return heads.group >= self.profile.merge_last_min_group

    def tall_first(self, longest_s: list) -> bool:
        """Whether launches whose longest programs take ``longest_s`` seconds (:meth:`program_s`
        with ``tall_first``) run the tallest query tiles first (:attr:`Plan.tall_first`): with some
        program of at least ``tall_first_s``, that program is the critical path and should start
        at once."""
        return self.side_streams and len(longest_s) > 1 and max(longest_s) >= self.profile.tall_first_s

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

        The rates and overheads named here are the :attr:`profile`'s. Attention, per launch
        (:func:`~treeattn.plan.select.launches.launch_features`): a KV tile costs an SM ``tile bytes / sm_bandwidth + tile FLOPs / sm_flops`` and a program
        ``program_overhead_s`` more; the launch's SM time is spread over ``num_sms`` SMs, softly
        no less than its longest program on its own (``program_bandwidth``, ``program_flops``),
        plus ``launch_overhead_s``. Launches are modelled one after another (under a CUDA graph they
        overlap on side streams; the fitted constants absorb it, and a model that adds their SM
        times fitted worse), except when the plan runs its tallest launch
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
                                       for s in sets], heads, profile=self.profile)
        return [self.total(int(length.sum() if kv_tokens is None else kv_tokens), int(nq.sum()), merge_rows_max,
                           num_queries, bool(masked.any()) if isinstance(masked, np.ndarray) else bool(masked),
                           isinstance(masked, np.ndarray), launches, heads)
                for (length, nq, merge_rows_max, num_queries, kv_tokens, masked), launches in zip(sets, all_launches)]

    def total(self, kv_tokens: int, rows: int, merge_rows_max: int, num_queries: int | None, masked: bool,
              per_item: bool, launches: list, heads: HeadConfig) -> dict:
        """:meth:`breakdown` of items with ``kv_tokens`` unique tokens, ``rows`` (item, query) pairs
        and these launches (:func:`~treeattn.plan.select.launches.launches_by_group`): every launch is
        masked when ``masked``, or those flagged when ``per_item``."""
        cols = [np.array(c) for c in zip(*launches)] if launches else [np.zeros(0, dtype=np.int64)] * 7
        block_m, block_n, programs, work, longest, flags, masked_work = cols
        slots = LaunchSlots(block_m, block_n, *(a.reshape(1, -1) for a in (programs, work, longest, flags.astype(bool),
                                                                            masked_work)),
                            np.ones((1, len(launches)), dtype=bool))
        return self.totals([(kv_tokens, rows, merge_rows_max, num_queries, masked, per_item)], slots, heads)[0]

    def totals(self, sets: list, slots: LaunchSlots, heads: HeadConfig, *, runs: list | None = None) -> list:
        """:meth:`total` of several item sets: ``sets`` holds each one's ``(kv_tokens, rows,
        merge_rows_max, num_queries, masked, per_item)`` and ``slots`` their launches, a row per
        set (:func:`~treeattn.plan.select.launches.launch_slots`). Each launch's SM time and longest
        program are found for all sets at once (the same float operations as one at a time).
        ``runs`` (bool per set, with ``slots.tokens``): the set's unmasked items read runs of
        slots, so its launches that the builder gives TMA wide tiles move their bytes and do their
        programs' fixed work ``tma_speedup`` times faster."""
        hq, hkv, d, eb = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim, _elem_bytes(heads)
        tok_bytes = d * 2 * eb  # K and V of one token of one KV head
        p = self.profile.overlap_exponent
        inv_p = 1.0 / p
        work, longest, live = slots.work, slots.longest, slots.live
        tile_sm_s, tile_s, rule_tile_s, mem_sm_s, mem_s = self._tile_rates(slots.block_m, slots.block_n, heads)
        # a set not rated per item: all its launches masked or none
        masked, per_item = np.array([s[4] for s in sets] + [s[5] for s in sets], dtype=bool).reshape(2, -1, 1)
        launch_masked = np.where(per_item, slots.flags, masked)
        masked_work = np.where(per_item, slots.masked_work, work * masked)
        work_s = (work + self.profile.mask_cost * masked_work) * tile_sm_s
        sm = (slots.programs * self.profile.program_overhead_s + work_s) / self.profile.num_sms
        longest_s = longest * tile_s * (1.0 + self.profile.mask_cost * launch_masked)
        if runs is not None:
            tma = self._tma(np.array(runs, dtype=bool)[:, None] & ~launch_masked, slots, hkv)
            cut = 1.0 - 1.0 / self.profile.tma_speedup
            sm = np.where(tma, sm - cut * (slots.programs * self.profile.program_overhead_s + work * mem_sm_s) / self.profile.num_sms, sm)
            longest_s = np.where(tma, longest_s - cut * longest * mem_s, longest_s)
        sm_all, longest_all = sm[live].tolist(), longest_s[live].tolist()
        rule_all = (longest * rule_tile_s)[live].tolist()
        bounds = [0, *itertools.accumulate(live.sum(axis=1).tolist())]
        # each launch's soft maximum of its SM time and longest program (Python floats: numpy's
        # power may differ in the last bit)
        soft = [(a ** p + b ** p) ** inv_p for a, b in zip(sm_all, longest_all)]
        row_bytes, out_bytes = heads.partial_row_bytes(), hq * d * eb
        saving = self.profile.direct_saving_pdl_s if self.pdl else self.profile.direct_saving_s
        out = []
        for (kv_tokens, rows, merge_rows_max, num_queries, set_masked, _), lo, hi in zip(sets, bounds, bounds[1:]):
            num_queries = rows if num_queries is None else int(num_queries)
            tall_first = self.tall_first(rule_all[lo:hi])
            if tall_first:
                # the longest programs start first and run beside the other launches' programs
                attn = (sum(sm_all[lo:hi]) ** p + max(longest_all[lo:hi]) ** p) ** inv_p
            else:
                attn = sum(soft[lo:hi])
            attn += (hi - lo) * self.profile.launch_overhead_s
            # every query with a single row: the attention kernel writes the output, no merge launch
            direct = merge_rows_max <= 1 and rows == num_queries
            partial_bytes = 0 if direct else rows * row_bytes
            attn = max(attn, (kv_tokens * hkv * tok_bytes + partial_bytes) / self.profile.bandwidth)
            step = self.profile.merge_tile_step_s if self.pdl and merge_tiled(num_queries, hq, d) else self.profile.merge_step_s
            merge = 0.0 if direct else max(merge_rows_max * step,
                                           (partial_bytes + num_queries * out_bytes) / self.profile.bandwidth
                                           ) + self.profile.launch_overhead_s
            out.append({"attention": attn, "merge": merge, "launches": hi - lo, "masked": set_masked,
                        "tall_first": tall_first,
                        "total": attn + merge + self.profile.fixed_overhead_s - saving * (direct and hi > lo)})
        return out

    def _tile_rates(self, block_m: np.ndarray, block_n: np.ndarray, heads: HeadConfig) -> tuple:
        """float64 [S] five times, for launch shapes of query tile ``block_m`` by KV tile
        ``block_n``: a KV tile's SM time and one program's seconds per KV tile at the fitted rates
        and at the tall-first rule's (:meth:`program_s`), then the memory part of the first two
        (the tile's bytes alone, which TMA speeds up). Kept per shape table on this instance
        (``auto`` rates the same table every plan)."""
        d = heads.head_dim
        key = (d, _elem_bytes(heads), block_m.tobytes(), block_n.tobytes())
        rates = self.__dict__.setdefault("_tile_rates_of", {})  # (frozen dataclass: not a field)
        got = rates.get(key)
        if got is None:
            flops = np.where(block_m >= 64, self.profile.sm_flops, self.profile.sm_flops_small)
            tile_bytes = block_n * (d * 2 * key[1])
            mem_sm_s = tile_bytes / self.profile.sm_bandwidth
            got = rates[key] = (mem_sm_s + 4.0 * block_m * block_n * d / flops,
                                self.program_s(block_m, block_n, 1, heads),
                                self.program_s(block_m, block_n, 1, heads, tall_first=True),
                                mem_sm_s, tile_bytes / self.profile.program_bandwidth)
        return got

    def _tma(self, runs: np.ndarray, slots: LaunchSlots, hkv: int) -> np.ndarray:
        """bool [G, S]: the launches the builder gives TMA wide tiles, of those unmasked over runs
        of slots (``runs``): contig tall tiles (:func:`~treeattn.plan.lower.addressing.contig_launches`)
        where :func:`~treeattn.plan.lower.addressing.tma_pays`."""
        programs = slots.programs
        return runs & tall_tile(slots.block_m, slots.block_n, programs, profile=self.profile) & \
            tma_pays(programs, slots.tokens * hkv / np.maximum(programs, 1), profile=self.profile)
