"""Attention launches of work items, as the plan builder would make them, for the cost model.

:func:`launch_slots` finds the launches of several item sets at once (``auto`` rates every
strategy's items in one pass): each item's launch shape (query tile by KV tile config) and the
programs, KV tiles and masked tiles it adds to its set's launch of that shape, as
:class:`LaunchSlots`, arrays with one slot per (set, launch shape) that
:meth:`~treeattn.plan.select.cost.CostModel.totals` rates. :func:`launch_features` and
:func:`launches_by_group` list the same launches as plain numbers.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from treeattn.plan.format import HeadConfig, _block_m_choices
from treeattn.plan.select.profiles import DeviceProfile

__all__ = ["LaunchSlots", "launch_features", "launch_slots", "launches_by_group"]


def launch_features(item_len: np.ndarray, item_queries: np.ndarray, heads: HeadConfig, *,
                    profile: DeviceProfile) -> np.ndarray:
    """float64 [launches, 5]: ``(block_m, block_n, programs, program_tiles, max_tiles)`` of each
    attention launch the plan builder would make for these items under ``profile`` (items without
    tokens or queries left out).

    As in :func:`treeattn.plan.lower.build.build_plan`: an item's query tile is the smallest ``block_m``
    holding its rows (queries x GQA group), split beyond the largest; its KV tile is the
    profile's short or long tile by length (``short_item_tokens``); one launch per ``(block_m,
    KV tile)``, one program per (query tile, KV head). ``program_tiles`` sums the KV tiles (loop
    iterations) of all programs of a launch, ``max_tiles`` is the longest program's.
    """
    length = np.asarray(item_len, dtype=np.int64)
    nq = np.asarray(item_queries, dtype=np.int64)
    keep = (length > 0) & (nq > 0)
    if not keep.all():
        length, nq = length[keep], nq[keep]
    return np.array(_launches(length, nq, heads, profile=profile), dtype=np.float64).reshape(-1, 7)[:, :5]


@functools.lru_cache(maxsize=64)
def _tile_tables(group: int, short_cfg: tuple, long_cfg: tuple) -> tuple:
    """``(block_m, block_n, q_shape, q_last, short_bits, long_bits)``: the query and KV tile of each
    launch shape (a query-tile height by the short and the long KV tile config, ``(block_n,
    num_warps, num_stages)``), the shape (short KV tiles) of an item of ``min(queries, q_last +
    1)`` queries (int64 [q_last + 2]), the queries the tallest query tile holds, and log2 of the
    short and long KV tile (long None when both are one launch config)."""
    heights = np.array(_block_m_choices(group))
    q_last = max(int(heights[-1]) // group, 1)
    # an item's query tile is the smallest height holding its rows (queries x GQA group); the
    # tallest beyond it
    m_idx = np.minimum(np.searchsorted(heights, np.arange(q_last + 2) * group), heights.size - 1)
    short_n, long_n = short_cfg[0], long_cfg[0]
    return (heights.repeat(2), np.tile([short_n, long_n], heights.size), 2 * m_idx, q_last,
            short_n.bit_length() - 1, long_n.bit_length() - 1 if long_cfg != short_cfg else None)


def _launches(length: np.ndarray, nq: np.ndarray, heads: HeadConfig, masked=None, *,
              profile: DeviceProfile) -> list:
    """:func:`launch_features` of items that all have tokens and queries, as a list of tuples,
    each with a sixth entry: whether the launch applies the tree mask (one of its items is
    flagged in per-item ``masked``, as the plan builder decides; False without flags)."""
    return _launches_many([(length, nq, masked)], heads, profile=profile)[0]


def _launches_many(sets: list, heads: HeadConfig, *, profile: DeviceProfile) -> list:
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
    return launches_by_group(length, nq, group, len(sets), flagged, heads, profile=profile)


def launches_by_group(length: np.ndarray, nq: np.ndarray, group, num_groups: int, flagged: np.ndarray | None,
                      heads: HeadConfig, lead: np.ndarray | None = None, *, profile: DeviceProfile) -> list:
    """:func:`_launches` of the items of ``num_groups`` sets at once: ``group`` (int [items] or a
    scalar) is each item's set, ``num_groups`` for items to leave out; ``flagged`` (bool [items]
    or None) the items whose launch applies the mask, ``lead`` (int [items] or None) the tokens
    of each item before its mask starts (the kernel runs the whole KV tiles before it unmasked;
    -1 or None: not known, and then all tiles of the item's launch count as masked). Returns a
    list of launches per set, each with a seventh entry: the masked KV tiles of its flagged
    items' programs. ``profile``: the device profile whose KV tiles the plan builder gives."""
    return launch_slots(length, nq, group, num_groups, flagged, heads, lead, profile=profile).launches()


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
    tokens : [G, S] or None
        KV tokens of all its work units (one KV head), where asked for.
    """

    block_m: np.ndarray
    block_n: np.ndarray
    programs: np.ndarray
    work: np.ndarray
    longest: np.ndarray
    flags: np.ndarray
    masked_work: np.ndarray
    live: np.ndarray
    tokens: np.ndarray | None = None

    def launches(self) -> list:
        """Each set's launches as :func:`launches_by_group` lists them (plain numbers)."""
        cols = [np.broadcast_to(a, self.live.shape)[self.live].tolist()
                for a in (self.block_m, self.block_n, self.programs, self.work, self.longest, self.flags,
                          self.masked_work)]
        rows = list(zip(*cols))
        bounds = [0, *itertools.accumulate(self.live.sum(axis=1).tolist())]
        return [rows[a:b] for a, b in zip(bounds, bounds[1:])]


def launch_slots(length: np.ndarray, nq: np.ndarray, group, num_groups: int, flagged: np.ndarray | None,
                 heads: HeadConfig, lead: np.ndarray | None = None, *, profile: DeviceProfile,
                 tokens: bool = False) -> LaunchSlots:
    """:func:`launches_by_group`'s launches as :class:`LaunchSlots` (``num_groups`` sets; few numpy
    calls for all of them) at the KV tiles of ``profile``, with their KV tokens
    (:attr:`LaunchSlots.tokens`) if ``tokens``."""
    block_m, block_n, q_shape, q_last, short_bits, long_bits = _tile_tables(
        heads.group, profile.tile_short, profile.long_tile(heads.head_dim))
    n_shapes = block_m.size
    shape = q_shape.take(nq, mode="clip")  # (q_shape's last entry: every count beyond q_last)
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
        # (as int64: numpy casts bool operands of int64 arithmetic several times slower)
        is_long = (length > profile.short_item_tokens).astype(np.int64)
        kv_bits = is_long * (long_bits - short_bits) + short_bits
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
        # (the flagged items are few: their values are taken first; a boolean ufunc.at is ~10x
        # slower than counting their shapes)
        at = flagged.nonzero()[0]
        flagged_shape = shape[at]
        flags = np.bincount(flagged_shape, minlength=size) > 0
        if lead is None:
            masked_work = work * flags
        else:  # items of a known lead count their tiles from it; a launch with others, all of its tiles
            lead = lead[at]
            known = lead >= 0
            bits = kv_bits if long_bits is None else kv_bits[at]
            counted = tiles[at] * (kv_tiles[at] - (lead >> bits))
            np.add.at(masked_work, flagged_shape[known], counted[known])
            whole = np.bincount(flagged_shape[~known], minlength=size) > 0
            masked_work[whole] = work[whole]
    unit_tokens = None
    if tokens:
        unit_tokens = np.zeros_like(programs)
        np.add.at(unit_tokens, shape, tiles * length)
    hkv = heads.num_kv_heads
    shapes = (num_groups, n_shapes)
    size -= n_shapes
    return LaunchSlots(block_m, block_n, (programs[:size] * hkv).reshape(shapes), (work[:size] * hkv).reshape(shapes),
                       longest[:size].reshape(shapes), flags[:size].reshape(shapes),
                       (masked_work[:size] * hkv).reshape(shapes), programs[:size].reshape(shapes) > 0,
                       None if unit_tokens is None else unit_tokens[:size].reshape(shapes))
