"""The merge launch's config: which kernel, heads and warps a program, and rows a block
(:func:`treeattn.launchers.merge_partials` launches it; :class:`~treeattn.plan.select.cost.CostModel` rates it);
and when a plan's last launch merges instead (:func:`merge_launch`)."""
from __future__ import annotations

import functools

import numpy as np

__all__ = ["MERGE_LAST_MAX_BLOCK_M", "MERGE_LAST_MAX_ROWS", "MERGE_ROW_TILES", "MERGE_TILE_VALUES", "launch_merges",
           "merge_config", "merge_launch", "merge_launches", "merge_row_tile", "merge_tiled"]

#: Row tiles of the merge of few queries (powers of two); a tile holds at most MERGE_TILE_VALUES
#: fp32 values a warp
MERGE_ROW_TILES = (2, 4, 8, 16, 32)
MERGE_TILE_VALUES = 4096


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=4096)
def merge_config(num_queries: int, num_heads: int, head_dim: int, max_rows: int = 4) -> tuple[int, int, int]:
    """``(heads per program, warps, row tile)`` of the merge of ``num_queries`` queries of at most
    ``max_rows`` partial rows each; row tile 0: the row loop (``_merge_states_kernel``), else rows
    a block of ``_merge_tile_kernel``. (Cached: every ``run()`` asks.)"""
    # give the grid at least ~1024 programs before packing several heads into one
    block_d = _pow2_ceil(head_dim)
    block_h = max(1, min(_head_cap(num_heads, head_dim),
                         1 << max(0, (num_queries * num_heads // 1024).bit_length() - 1)))
    if block_h >= 16:
        # many queries: 4 heads a program and 2 warps keep more rows' loads in flight than 16-32
        # heads a program; 1.08-1.10x on the suite's merges, up to 1.27x on deep trees (H200)
        return 4, 2, 0
    if block_h >= 8:
        return block_h, 4, 0
    # few queries: their rows in one load of a row tile, one warp a program (on an H100, merges
    # of 5-18 rows a query 1.4x faster or more, median 1.9x; 2 and 4 warps were slower, and so
    # were row tiles in the two regimes above: 1.05-1.29x on the suite's plans of 256-1024 queries)
    return block_h, 1, merge_row_tile(max_rows, block_h, block_d, 1)


def _head_cap(num_heads: int, head_dim: int) -> int:
    """The most heads a merge program takes."""
    return min(_pow2_ceil(num_heads), max(1, 4096 // _pow2_ceil(head_dim)))


def merge_launches(num_heads: int, head_dim: int) -> list:
    """``(queries, max_rows)`` of merges that between them take every config :func:`merge_config`
    gives: the query counts that reach each head block, each with every row tile it can take
    (what :func:`treeattn.precompile.precompile` launches)."""
    out = []
    for k in range(_head_cap(num_heads, head_dim).bit_length()):
        n = -(-(1 << k) * 1024 // num_heads)  # the query count that gives head block 1 << k
        out += [(n, rows) for rows in sorted({merge_config(n, num_heads, head_dim, r)[2] for r in MERGE_ROW_TILES})]
    return out


def merge_row_tile(max_rows: int, block_h: int, block_d: int, num_warps: int) -> int:
    """Rows of ``_merge_tile_kernel``'s tile: enough for ``max_rows`` in one block where the
    ``[rows, block_h, block_d]`` tile fits :data:`MERGE_TILE_VALUES` a warp."""
    fit = [r for r in MERGE_ROW_TILES if r * block_h * block_d <= MERGE_TILE_VALUES * num_warps] or [2]
    return next((r for r in fit if r >= max_rows), fit[-1])


def merge_tiled(num_queries: int, num_heads: int, head_dim: int) -> bool:
    """Whether the merge of ``num_queries`` queries takes the row tile (rows in one load) rather
    than the row loop."""
    return merge_config(num_queries, num_heads, head_dim)[2] > 0


#: The most partial rows a query may have for the plan's last launch to merge them
#: (:attr:`~treeattn.plan.format.Plan.merge_last`): a program folds its queries' other rows one
#: after another, where a merge launch spreads them over a grid. Session 31 measured plans of 2-6
#: rows (H100).
MERGE_LAST_MAX_ROWS = 4
#: The tallest query tile of a launch that merges: the leaf launches of tall-first plans (16
#: rows) gained; the one suite plan whose last launch had 64-row tiles lost 3.7%,
#: and a tall tile's fold would hold another [rows, D] fp32 block in registers.
MERGE_LAST_MAX_BLOCK_M = 32


def launch_merges(block_m: int, tma: bool) -> bool:
    """Whether a launch of this query tile and addressing may be a plan's merging last launch
    (:attr:`~treeattn.plan.format.Plan.merge_last`; what :func:`treeattn.precompile.precompile` compiles so)."""
    return block_m <= MERGE_LAST_MAX_BLOCK_M and not tma


def merge_launch(launches, tall_first: bool, work_row_indptr, row_q, q_rows) -> int:
    """:attr:`~treeattn.plan.format.Plan.merge_launch`: the launch that runs last (``launches[0]``
    with ``tall_first``), if it holds exactly one of the rows (``row_q``, by work unit
    ``work_row_indptr``) of each query with several (``q_rows``), at most
    :data:`MERGE_LAST_MAX_ROWS`, and may merge (:func:`launch_merges`), and some launch runs
    before it; else -1."""
    if len(launches) < 2 or not (q_rows != 1).any() or q_rows.max() > MERGE_LAST_MAX_ROWS:
        return -1
    i = 0 if tall_first else len(launches) - 1
    ln = launches[i]
    if not launch_merges(ln.block_m, ln.tma):
        return -1
    last_rows = row_q[work_row_indptr[ln.work_start]: work_row_indptr[ln.work_end]]
    in_last = np.bincount(last_rows, minlength=q_rows.size)
    return i if (in_last[q_rows != 1] == 1).all() else -1
