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

from treeattn.plan.lower.addressing import tall_tile, tma_pays
from treeattn.plan.select.launches import LaunchSlots, _launches_many
from treeattn.plan.lower.merge_config import merge_tiled
from treeattn.plan.format import HeadConfig

__all__ = ["CostModel"]


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
    #: the merge step of few queries' merges, which load a query's rows as one tile
    #: (:func:`~treeattn.plan.lower.merge_config.merge_tiled`), with ``pdl``: merge_step_s less what the tile
    #: saved a row against the row loop in one-call graph replay on an H100 (median 0.11 us,
    #: 0.07-0.36, over 28 plans of 6-18 rows a query; h100_probe_merge_rows.json). It saved 2-3x
    #: that where 32 calls ran back to back with PDL; there, the plans this rate chooses were
    #: 0.80-0.97x the time of those the row loop's rate chose, and without PDL 0.84-1.09x
    #: (benchmarks/probe_merge_rows.py, probe_merge_cost.py; NOTES.md, session 29)
    merge_tile_step_s: float = 0.29e-6
    #: what a direct plan (no merge launch) saves beyond the fitted merge term, which ranks
    #: merging plans among themselves: a merge launch takes 7-14 us under graph replay even for
    #: one query (benchmarks/floor.py). On the kernel suite's timings any value in 6-10 us makes
    #: the same choices (benchmarks/probe_direct.py, NOTES.md); kept below fixed_overhead_s
    direct_saving_s: float = 6e-6
    #: the same with ``pdl``: the merge launch and its wait overlap the attention launches, and
    #: since only a launch's last program waits at its exit (session 35) a merging plan's launches
    #: overlap more. On every strategy's timings of the suite at 05868dd (H200, one run,
    #: h200_kernels_all_*_05868dd.json) 6 us chose ``paths`` (direct) over two-launch ``greedy`` /
    #: ``node`` plans up to 1.25x slower (``1,4,256_32,256,32`` at 32/8): 86/96 within 5% of
    #: the fastest, worst 1.255x; any value in 1-3 us: 90/96, worst 1.117x (benchmarks/eval_choices.py).
    #: Of 210 suite, Medusa-, few-shot- and ToT-shaped plans five change, each 1.056-1.252x faster
    #: in one process (benchmarks/probe_direct_saving.py, h200_probe_direct_saving_0a431f6.json)
    direct_saving_pdl_s: float = 2e-6
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
    #: long runs of slots take (:func:`~treeattn.plan.lower.addressing.tma_launches`). TreeAttention
    #: sets it on CUDA devices of compute capability 9.0 or later
    tma: bool = False
    #: how much faster than the fitted rates above such a launch moves its tiles' bytes and does
    #: its programs' fixed work, in its SM time and its longest program (its MMAs run at the fitted
    #: rates), where the planner knows its items read runs (:attr:`WorkItems.unmasked_runs`; other
    #: TMA launches are rated like pointer loads). Sessions 28-33 sped up the whole program 2.0x
    #: (fitted on Medusa context chunks on an H100), which rated a 64-program TMA launch of
    #: 128-row tiles over 1024 tokens at 33 us where it took 45 (the suite's worst choice, 1.15x).
    #: The memory part 3.0x faster makes that case 1.15x faster, ``1,1024_2048,32`` at 32/8 1.01x
    #: and Medusa-128 over 800 tokens 1.06x, and changes no other suite or Medusa choice (H200,
    #: benchmarks/probe_cost_ab.py; NOTES.md, session 34)
    tma_speedup: float = 3.0
    #: plans run as programmatic dependent launches (``TreeAttention(pdl=True)``, as the engine
    #: runs them): the merge's launch and wait overlap the attention launches, so what a merge of
    #: few queries costs is its own critical path (``merge_tile_step_s``)
    pdl: bool = False
    #: the same for every plan (query and output traffic, graph replay); reported, not choosing
    fixed_overhead_s: float = 7.06e-6
    #: ``auto`` takes the plan with the fewest kernels among those estimated within this fraction
    #: of the best (launches that run side by side, tallest first, count as one): closer estimates
    #: are within the model's error (rms log error ~0.15). On the kernel suite's timings
    #: (results/h200_kernels.json at 29a76a5), 0%, 2% and 5% all pick within 5% of the fastest
    #: strategy on 94/96 cases (worst 1.14x); counting those launches one each, 94, 93 and 92 (the
    #: last with a 1.27x miss)
    choice_margin: float = 0.02
    #: let ``node`` and ``greedy`` pack small leaf items (:mod:`treeattn.plan.strategies.leaf_packing`)
    leaf_packing: bool = True
    #: the smallest GQA group (query heads a KV head) whose plans let their last launch merge
    #: (:attr:`~treeattn.plan.format.Plan.merge_last`) rather than launch the merge. Timed both ways
    #: in one process on an H200 (benchmarks/probe_fold.py, results/h200_probe_fold*.json), the
    #: fold was faster on 15 of the 20 suite plans of group 8 (64/8, 16/2) and slower on 29 of the
    #: 36 of groups 1 and 4 (32/32, 64/64, 32/8; up to 15-19 us, 12%): the group decides, not the
    #: head count. (On an H100, group 1 gained up to 2%.)
    merge_last_min_group: int = 8
    #: a plan's persistent tall launch (:func:`~treeattn.plan.lower.addressing.persistent_tall`) runs
    #: over at most this share of the SMs, gathered or through TMA (a TMA program fills its SM,
    #: a gathered one leaves room for a leaf program), where the leaf launches read this many KV
    #: entries x KV heads or more (256 MB at head_dim 128 in 16 bits). Set on an H200
    #: (benchmarks/probe_tall_footprint.py, probe_persist.py; NOTES.md, session 37)
    persist_share_gathered: float = 0.72
    persist_share_tma: float = 0.5
    persist_min_leaf_entries: int = 1 << 19
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

    def merges_last(self, heads: HeadConfig) -> bool:
        """Whether plans for ``heads`` may let their last launch merge
        (:attr:`merge_last_min_group`)."""
        return heads.group >= self.merge_last_min_group

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

        Attention, per launch (:func:`~treeattn.plan.select.launches.launch_features`): a KV tile costs
        an SM ``tile bytes / sm_bandwidth + tile FLOPs / sm_flops`` and a program
        ``program_overhead_s`` more; the launch's SM time is spread over ``num_sms`` SMs, softly
        no less than its longest program on its own (``program_bandwidth``, ``program_flops``),
        plus ``launch_overhead_s``. Launches are modelled one after another (under a CUDA graph they
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
        p = self.overlap_exponent
        inv_p = 1.0 / p
        work, longest, live = slots.work, slots.longest, slots.live
        tile_sm_s, tile_s, rule_tile_s, mem_sm_s, mem_s = self._tile_rates(slots.block_m, slots.block_n, heads)
        # a set not rated per item: all its launches masked or none
        masked, per_item = np.array([s[4] for s in sets] + [s[5] for s in sets], dtype=bool).reshape(2, -1, 1)
        launch_masked = np.where(per_item, slots.flags, masked)
        masked_work = np.where(per_item, slots.masked_work, work * masked)
        work_s = (work + self.mask_cost * masked_work) * tile_sm_s
        sm = (slots.programs * self.program_overhead_s + work_s) / self.num_sms
        longest_s = longest * tile_s * (1.0 + self.mask_cost * launch_masked)
        if runs is not None:
            tma = self._tma(np.array(runs, dtype=bool)[:, None] & ~launch_masked, slots, hkv)
            cut = 1.0 - 1.0 / self.tma_speedup
            sm = np.where(tma, sm - cut * (slots.programs * self.program_overhead_s + work * mem_sm_s) / self.num_sms, sm)
            longest_s = np.where(tma, longest_s - cut * longest * mem_s, longest_s)
        sm_all, longest_all = sm[live].tolist(), longest_s[live].tolist()
        rule_all = (longest * rule_tile_s)[live].tolist()
        bounds = [0, *itertools.accumulate(live.sum(axis=1).tolist())]
        # each launch's soft maximum of its SM time and longest program (Python floats: numpy's
        # power may differ in the last bit)
        soft = [(a ** p + b ** p) ** inv_p for a, b in zip(sm_all, longest_all)]
        row_bytes, out_bytes = heads.partial_row_bytes(), hq * d * eb
        saving = self.direct_saving_pdl_s if self.pdl else self.direct_saving_s
        out = []
        for (kv_tokens, rows, merge_rows_max, num_queries, set_masked, _), lo, hi in zip(sets, bounds, bounds[1:]):
            num_queries = rows if num_queries is None else int(num_queries)
            tall_first = self.tall_first(rule_all[lo:hi])
            if tall_first:
                # the longest programs start first and run beside the other launches' programs
                attn = (sum(sm_all[lo:hi]) ** p + max(longest_all[lo:hi]) ** p) ** inv_p
            else:
                attn = sum(soft[lo:hi])
            attn += (hi - lo) * self.launch_overhead_s
            # every query with a single row: the attention kernel writes the output, no merge launch
            direct = merge_rows_max <= 1 and rows == num_queries
            partial_bytes = 0 if direct else rows * row_bytes
            attn = max(attn, (kv_tokens * hkv * tok_bytes + partial_bytes) / self.bandwidth)
            step = self.merge_tile_step_s if self.pdl and merge_tiled(num_queries, hq, d) else self.merge_step_s
            merge = 0.0 if direct else max(merge_rows_max * step,
                                           (partial_bytes + num_queries * out_bytes) / self.bandwidth
                                           ) + self.launch_overhead_s
            out.append({"attention": attn, "merge": merge, "launches": hi - lo, "masked": set_masked,
                        "tall_first": tall_first,
                        "total": attn + merge + self.fixed_overhead_s - saving * (direct and hi > lo)})
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
            flops = np.where(block_m >= 64, self.sm_flops, self.sm_flops_small)
            tile_bytes = block_n * (d * 2 * key[1])
            mem_sm_s = tile_bytes / self.sm_bandwidth
            got = rates[key] = (mem_sm_s + 4.0 * block_m * block_n * d / flops,
                                self.program_s(block_m, block_n, 1, heads),
                                self.program_s(block_m, block_n, 1, heads, tall_first=True),
                                mem_sm_s, tile_bytes / self.program_bandwidth)
        return got

    def _tma(self, runs: np.ndarray, slots: LaunchSlots, hkv: int) -> np.ndarray:
        """bool [G, S]: the launches the builder gives TMA wide tiles, of those unmasked over runs
        of slots (``runs``): contig tall tiles (:func:`~treeattn.plan.lower.addressing.contig_launches`)
        where :func:`~treeattn.plan.lower.addressing.tma_pays`."""
        programs = slots.programs
        return runs & tall_tile(slots.block_m, slots.block_n, programs, self.num_sms) & \
            tma_pays(programs, slots.tokens * hkv / np.maximum(programs, 1), self.num_sms)
