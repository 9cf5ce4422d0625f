"""Affine KV addressing (:attr:`~treeattn.plan.format.Launch.contig`): which work units read one run
of consecutive slots, and which launches of a plan compute their K/V addresses (and with which
tile) instead of loading them from the slot list; gathered launches of many 32-row programs run
two warps a program; tall launches over whole tiles take the select-free softmax step
(:attr:`~treeattn.plan.format.Launch.split_tail`), and over long runs tensor-descriptor loads
(:attr:`~treeattn.plan.format.Launch.tma`); a tall launch beside a large leaf launch runs
persistent on part of the SMs (:attr:`~treeattn.plan.format.Launch.programs`). The rules' tiles and
thresholds are the device's: fields of the planning cost model's
:class:`~treeattn.plan.select.profiles.DeviceProfile`."""
from __future__ import annotations

import dataclasses

import numpy as np

from treeattn.plan.select.profiles import DeviceProfile
from treeattn.tree.topology import slot_breaks

__all__ = ["TALL_CONTIG_ROWS", "contig_configs", "beside_configs", "beside_persistent", "contig_launches",
           "gathered_configs", "may_persist", "persistent_tall", "persistent_tile", "runs_between", "split_tails",
           "tall_tile", "tma_launches", "tma_loads", "tma_pays", "unit_runs"]

#: The query tiles a profile's tall tiles (``tile_tall_contig``, ``tile_tall_tma``,
#: ``tile_tall_gathered``) are for: the tallest of :data:`~treeattn.plan.format.BLOCK_M_CHOICES`,
#: with which their stages' shared memory was sized (and the height persistent_tall counts a tall
#: launch's KV for). Not a device choice: it follows the kernel's tiles
TALL_CONTIG_ROWS = 128


def unit_runs(kv_slots: np.ndarray, work_kv_start: np.ndarray, work_kv_end: np.ndarray) -> np.ndarray:
    """bool [W]: work unit ``w`` reads consecutive slots (``kv_slots[s + i] == kv_slots[s] + i``
    over its range ``[s, e)``; empty units count as runs)."""
    return runs_between(slot_breaks(kv_slots), work_kv_start, work_kv_end)


def runs_between(breaks: np.ndarray, work_kv_start: np.ndarray, work_kv_end: np.ndarray) -> np.ndarray:
    """:func:`unit_runs` from the slot list's :func:`~treeattn.tree.topology.slot_breaks` (sorted): a unit is a run when
    none lies in ``(s, e)``."""
    if breaks.size == 0:
        return np.ones(work_kv_start.size, dtype=bool)
    return (np.searchsorted(breaks, work_kv_start, side="right") ==
            np.searchsorted(breaks, work_kv_end, side="left")) | (work_kv_end <= work_kv_start)


def contig_launches(launches, is_run: np.ndarray, num_kv_heads: int, *, profile: DeviceProfile, has_mask: bool,
                    elem_bytes: int, unit_tokens: np.ndarray) -> tuple:
    """``launches`` (of a plan with a tree mask or not: ``has_mask``; caches of ``elem_bytes``
    bytes an element) with :attr:`Launch.contig` set where every work unit is a run of slots
    (``is_run``, bool [W]) and affine addresses pay, and the launch config of each (tile, warps,
    stages) for its addressing, by the rules and tiles of ``profile`` (the device's; the
    measurements below are the H200 profile's). ``unit_tokens`` (int [W]): the KV entries of each
    work unit.

    Addresses affine in the loop counter stream faster than gathered ones: a lone program walking
    4K tokens runs 1.5x faster (addresses computed from registers but not affine are as slow as
    gathered ones, so it is not the slot load). The deeper pipeline takes shared memory, so beyond
    three programs a SM a launch keeps one stage less (unless its units average
    ``deep_pipeline_min_tokens``), and 64-row tiles of long KV tiles keep gathered slots beyond one
    wave (per-launch sweep on an H200; counting the programs of all the plan's launches instead,
    as they share the SMs on streams, was no better over the suite and worse on two trees). The
    tallest tiles over long items (unmasked), up to ``tall_contig_waves`` waves, take
    ``tile_tall_contig`` instead: 32-token KV tiles keep three stages in flight in the shared
    memory that two 64-token ones fill, 1.04-1.29x faster on 45 of the suite's 47 such launches at
    64-768 programs.

    Launches that keep gathering with 32-row tiles (``gathered_narrow_rows``) over long items and
    many waves of programs (``gathered_narrow_waves``) run two warps a program
    (``gathered_narrow_warps``): 1.03-1.12x faster on all twelve such launches of the suite's GQA
    plans (deep trees, 1024-2048 programs), 0.87-0.91x at 256 programs.
    Launches of the tallest tiles over long items that keep gathering (units that are no runs: a
    root glued to a node, the deep trees' paths; or runs beyond the waves above) take
    ``tile_tall_gathered`` with 16-bit caches: at 64-token tiles, 4 warps and 3 stages the
    kernel spills (255 registers a thread, Triton 3.6), at 32-token tiles and 7 stages it does not,
    and each K/V tile's slot load leaves a deeper pipeline more to hide. On an H100 the suite's ten
    such plans (128-512 programs) ran 0.99-1.20x as fast, geomean 1.043x; 5 stages 1.038x, 3
    stages 0.985x. Seven stages of 16-bit 32-token tiles and a
    128-row query tile take ~147 KB of shared memory: one program a SM.
    """
    num_sms = profile.num_sms
    out = []
    for ln in launches:
        programs = (ln.work_end - ln.work_start) * num_kv_heads
        if not programs:
            out.append(ln)
        elif not is_run[ln.work_start: ln.work_end].all():
            narrow = (_gathered_narrow(ln.block_m, ln.block_n, profile)
                      and programs >= profile.gathered_narrow_waves * num_sms)
            out.append(dataclasses.replace(ln, num_warps=profile.gathered_narrow_warps) if narrow
                       else _gathered_tile(ln, elem_bytes, profile))
        elif tall_tile(ln.block_m, ln.block_n, programs, profile=profile) and not (has_mask and ln.masked):
            block_n, num_warps, num_stages = profile.tile_tall_contig
            out.append(dataclasses.replace(ln, contig=True, block_n=block_n, num_warps=num_warps,
                                           num_stages=num_stages))
        elif ln.block_m >= 64 and ln.block_n >= 64 and programs > num_sms:
            out.append(_gathered_tile(ln, elem_bytes, profile))
        else:
            shallow = (ln.num_stages >= 3 and programs > 3 * num_sms
                       and unit_tokens[ln.work_start: ln.work_end].mean() < profile.deep_pipeline_min_tokens)
            stages = ln.num_stages - 1 if shallow else ln.num_stages
            out.append(dataclasses.replace(ln, contig=True, num_stages=stages))
    return tuple(out)


def tall_tile(block_m, block_n, programs, *, profile: DeviceProfile):
    """Whether a contig launch of this shape and ``programs`` programs, unmasked, takes the
    ``profile``'s ``tile_tall_contig`` (:func:`contig_launches`); numbers or arrays (element-wise)."""
    return (block_m >= TALL_CONTIG_ROWS) & (block_n >= 64) & (programs <= profile.tall_contig_waves * profile.num_sms)


def contig_configs(block_m: int, block_n: int, num_warps: int, num_stages: int, *, profile: DeviceProfile) -> list:
    """The ``(block_n, num_warps, num_stages)`` that :func:`contig_launches` may give a contig
    launch planned with this shape under ``profile`` (what :func:`treeattn.precompile.precompile`
    compiles)."""
    out = [(block_n, num_warps, num_stages)] + [(block_n, num_warps, num_stages - 1)] * (num_stages >= 3)
    if block_m >= TALL_CONTIG_ROWS and block_n >= 64:
        out.append(profile.tile_tall_contig)
    return out


def tma_loads(heads, cost) -> bool:
    """Plans for ``heads`` may take :func:`tma_launches`: the cost model's device has TMA
    (``cost.tma``), the caches are 16-bit and ``head_dim`` is a power of two up to 128 (three
    stages of 128-token K/V tiles and a 128-row query tile fill 224 KB of shared memory at 128)."""
    return bool(cost.tma) and heads.elem_bytes == 2 and heads.head_dim in (16, 32, 64, 128)


def tma_pays(programs, mean_tokens, *, profile: DeviceProfile):
    """Whether a tall contig launch (the ``profile``'s ``tile_tall_contig``) of ``programs``
    programs over units of ``mean_tokens`` tokens on average takes TMA wide tiles (its
    ``tma_min_tokens``); numbers or arrays (element-wise)."""
    out = False
    for waves, tokens in profile.tma_min_tokens:
        out = out | ((programs <= waves * profile.num_sms) & (mean_tokens >= tokens))
    return out


def tma_launches(launches, work_kv_start: np.ndarray, work_kv_end: np.ndarray, num_kv_heads: int, *,
                 profile: DeviceProfile) -> tuple:
    """``launches`` (after :func:`contig_launches`) with the tall contig ones (the ``profile``'s
    ``tile_tall_contig``) where :func:`tma_pays` turned to :attr:`Launch.tma` at its
    ``tile_tall_tma`` (and
    :attr:`Launch.split_tail`, as the kernel loads only whole tiles through descriptors: past a
    unit's end lie other slots).

    With no address arithmetic in the threads, K/V land in shared memory where the MMAs read
    them, and 128-token KV tiles with 8 warps pay: standalone tall tiles 1.12-1.14x faster than
    with pointer loads at that config and 1.22-1.49x faster than at ``tile_tall_contig``
    (measured on an H200). In the suite's plans that holds
    on long units (``1,1024_2048,32``'s 2048-token root: 1.07 / 1.12 / 1.18x at 32/32, 32/8,
    64/8), but over shorter units the wide tile's longer pipeline start costs up to 1.2x
    (0.82-1.04x, below 1.0 on 10 of 14 plans), and descriptor loads at the launches' own configs
    gain nothing (0.93-1.03x). Beside a large leaf launch the gain shrinks: 8 such roots over 512
    leaves of 256 tokens, 0.98x / 1.05x at 32/8 / 64/8.

    Launches of fewer programs than SMs pay from shorter units on (the wide tile's three stages
    fill an SM's shared memory: one program a SM, beside the plan's other launches). On the
    context chunks of Medusa trees (measured on an H100):
    1.04-1.33x faster at 32-96 programs over 400-1250 tokens; at 128 programs 1.08x over
    1250 tokens but 0.99-1.00x over 625-750 and 0.83-0.89x over 375-400; at 192-384 programs
    0.90-1.06x over 417-833 tokens.
    """
    out = []
    for ln in launches:
        if ln.contig and ln.block_m >= TALL_CONTIG_ROWS and (ln.block_n, ln.num_warps,
                                                             ln.num_stages) == profile.tile_tall_contig:
            length = work_kv_end[ln.work_start: ln.work_end] - work_kv_start[ln.work_start: ln.work_end]
            if tma_pays((ln.work_end - ln.work_start) * num_kv_heads, length.mean(), profile=profile):
                block_n, num_warps, num_stages = profile.tile_tall_tma
                ln = dataclasses.replace(ln, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                         split_tail=True, tma=True)
        out.append(ln)
    return tuple(out)


def gathered_configs(block_m: int, block_n: int, num_warps: int, num_stages: int, *, elem_bytes: int,
                     profile: DeviceProfile) -> list:
    """The ``(block_n, num_warps, num_stages)`` that :func:`contig_launches` may give a launch
    planned with this shape that keeps gathering under ``profile`` (what
    :func:`treeattn.precompile.precompile` compiles)."""
    if _gathered_tall(block_m, block_n, elem_bytes):
        return [profile.tile_tall_gathered]
    narrow = (block_n, profile.gathered_narrow_warps, num_stages)
    return [(block_n, num_warps, num_stages)] + [narrow] * _gathered_narrow(block_m, block_n, profile)


def _gathered_tile(ln, elem_bytes: int, profile: DeviceProfile):
    """``ln``, a launch that gathers its slots, at the profile's ``tile_tall_gathered`` where it
    takes it."""
    if not _gathered_tall(ln.block_m, ln.block_n, elem_bytes):
        return ln
    block_n, num_warps, num_stages = profile.tile_tall_gathered
    return dataclasses.replace(ln, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def _gathered_tall(block_m: int, block_n: int, elem_bytes: int) -> bool:
    """A gathered launch of this shape takes the profile's ``tile_tall_gathered``."""
    return block_m >= TALL_CONTIG_ROWS and block_n >= 64 and elem_bytes == 2


def _gathered_narrow(block_m: int, block_n: int, profile: DeviceProfile) -> bool:
    """A gathered launch of this shape runs the profile's ``gathered_narrow_warps`` warps given
    enough waves."""
    return block_m == profile.gathered_narrow_rows and block_n >= 64


def split_tails(launches, work_kv_start: np.ndarray, work_kv_end: np.ndarray, *, has_mask: bool,
                profile: DeviceProfile) -> tuple:
    """``launches`` with :attr:`Launch.split_tail` set where the select-free step over whole KV
    tiles pays: unmasked launches of tall query tiles (the ``profile``'s ``split_tail_rows`` or
    more) whose units hold whole tiles only, or long units (``split_tail_tiles`` KV tiles or more
    on average).

    The step issues ~14% fewer instructions a tile (a 128 x 32 tile's loop body, PTX for sm_90 from
    Triton 3.9: 636 -> 545 a thread), which bound tall tiles over long items, but a unit's partial
    last tile then runs after the software-pipelined loop, one more memory round trip a program.
    Per plan on an H200 (every suite plan with the step on all tall unmasked launches):
    geomean 1.013x (0.98-1.13x, 193 plans) where no unit has a partial tile, 1.033x (1.00-1.10x,
    4 plans) on units of 32 tiles or more, 0.980x (0.85-1.02x, 83 plans) otherwise, e.g. the
    short round-up items of ``pack``.
    """
    out = []
    for ln in launches:
        if ln.tma:  # (set by tma_launches)
            out.append(ln)
            continue
        tall = ln.block_m >= profile.split_tail_rows and not (has_mask and ln.masked) and ln.work_end > ln.work_start
        if tall:
            length = work_kv_end[ln.work_start: ln.work_end] - work_kv_start[ln.work_start: ln.work_end]
            tall = bool(not (length % ln.block_n).any() or length.mean() >= profile.split_tail_tiles * ln.block_n)
        out.append(dataclasses.replace(ln, split_tail=tall) if tall != ln.split_tail else ln)
    return tuple(out)


def may_persist(block_m: int, *, contig: bool, tma: bool, group: int, profile: DeviceProfile) -> bool:
    """A launch of this query tile and addressing, in a plan of this GQA ``group``, is one that
    :func:`persistent_tall` may make persistent under ``profile`` (what
    :func:`treeattn.precompile.precompile` compiles so, at its :func:`persistent_tile`)."""
    return group >= profile.persist_min_group and block_m >= profile.persist_rows and contig == tma


def persistent_tile(block_n: int, num_warps: int, num_stages: int, *, elem_bytes: int, tma: bool = False,
                    profile: DeviceProfile) -> tuple:
    """The ``(block_n, num_warps, num_stages)`` of a launch planned at this one that
    :func:`persistent_tall` makes persistent: a TMA launch keeps its tile; a gathered one takes
    the ``profile``'s ``tile_tall_gathered`` where a 128-row launch of it would (16-bit caches,
    64-token tiles planned), at any query tile. One program a SM, the deepest pipeline pays: the deep ``paths``
    trees' 64-row launch at 32/8 (64-token tiles, 3 stages planned) ran 1.048 / 1.050x faster on
    an H200."""
    if not tma and _gathered_tall(TALL_CONTIG_ROWS, block_n, elem_bytes):
        return profile.tile_tall_gathered
    return block_n, num_warps, num_stages


def beside_configs(block_m: int, block_n: int, *, profile: DeviceProfile) -> list:
    """The ``(block_n, num_warps, num_stages)`` that :func:`beside_persistent` may give a contig
    launch planned with this shape under ``profile`` (what :func:`treeattn.precompile.precompile`
    compiles)."""
    return [profile.tile_beside] if block_m < profile.persist_rows and block_n >= 64 else []


def beside_persistent(launches, *, group: int, profile: DeviceProfile) -> tuple:
    """``launches`` with those of shorter tiles than the ``profile``'s ``persist_rows`` that compute
    their addresses over 64-token (or wider) KV tiles at its ``tile_beside`` where a gathered
    launch is persistent and the GQA ``group`` is its ``beside_min_group`` or more.

    Beside a persistent tall program (~147 KB of shared memory and half an SM's registers) an
    SM holds one leaf program; 32-token tiles in three stages keep more KV in flight a program
    than 64-token tiles in two. On an H200 (three alternating
    rounds): every such plan of the suite at 64/8
    (16-row leaf launches) 1.004-1.026x; at 32/8 the two such plans (the deep trees) 0.985x, and
    32-token tiles in two stages, 16-token tiles, two warps or 64-token tiles in three stages
    lost at both. A persistent TMA program fills its SM, so the leaves run on the others, where
    this tile lost (``1,8,512_32,2048,256``: 0.98x at 64/8 and at 32/8)."""
    if group < profile.beside_min_group or not any(ln.programs and not ln.tma for ln in launches):
        return tuple(launches)
    block_n, num_warps, num_stages = profile.tile_beside
    return tuple(dataclasses.replace(ln, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                 if ln.contig and not ln.tma and not ln.programs and beside_configs(ln.block_m, ln.block_n,
                                                                                   profile=profile)
                 else ln for ln in launches)


def persistent_tall(launches, work_kv_start: np.ndarray, work_kv_end: np.ndarray, num_kv_heads: int, *,
                    group: int, elem_bytes: int, profile: DeviceProfile) -> tuple:
    """``launches`` (run tallest first, in order on one stream with PDL) with their largest
    launch of tall query tiles (the ``profile``'s ``persist_rows`` or more), gathered or through
    TMA, persistent (:attr:`Launch.programs`) where the launches of shorter tiles read
    ``persist_min_leaf_ratio`` times its KV entries (scaled to 128-row tiles) and
    ``persist_min_leaf_entries`` KV entries x KV heads or more (256 MB at head_dim 128 in 16 bits,
    60 us of HBM time on an H200), and the GQA ``group`` is ``persist_min_group`` or more (where
    tall tiles are compute-bound; without GQA these plans run at their HBM roofline, and the rule
    was not measured there).

    A TMA launch, or a gathered one whose leaves read ``persist_partition_ratio`` times its
    KV or more, keeps to part of the SMs: its ``W`` programs (units x KV heads) become
    ``ceil(W / R)`` persistent ones, each running ``R`` units or one fewer,
    ``R = ceil(W / (share x num_sms))``: ``persist_share_gathered`` for a gathered launch and
    ``persist_share_tma`` for a TMA one; none where ``W`` fits in one round. Other gathered
    launches run over one program a SM where ``W`` is ``persist_min_waves`` x ``num_sms`` or more.

    A launch's programs start only once every program of the launch before it has: a tall
    launch of two waves keeps the leaf programs out until its last wave, and the plan costs
    about the sum of a compute-bound and a memory-bound launch. Persistent, it starts whole, and
    the leaf launch gets the rest of the GPU from the start: the SMs it leaves alone and, beside
    a gathered program (~147 KB of shared memory), one leaf program an SM. On an H200 with the
    merge launch (the fold would make every leaf program wait for the tall launch):
    - one program a SM: the gathered launches at 64/8 of ``1,8,512_512,512,256``,
      ``1,8,512_32,512,256`` and the deep ``paths`` tree 1.02-1.06x, the deep tree's 64-row
      one at 32/8 1.03x; tall-heavy plans lose (``1,4,16,512_1024,256,128,32`` at 64/8, leaves
      0.36 of the tall launch's KV: 0.89x), and so do TMA launches (0.89-0.96x: they fill every
      SM) and launches within one wave (0.95-0.99x);
    - over part of the SMs, against the plans with one program a SM: the TMA launch of
      ``1,8,512_32,2048,256`` at 64/8 (256 programs) 1.084-1.091x over 64 programs (1.03x over
      56 or 96), at 32/8 (128) 1.02-1.03x over 56-64; the gathered ones of
      ``1,8,512_512,512,256`` at 64/8 (256) 1.058-1.062x over 96 (0.90x over 80: a fourth
      round), at 32/8 (128) 1.025x over 56-80; the deep trees at 64/8 (512) 1.04-1.05x over
      80-96, at 32/8 1.01x. A gathered program leaves room for a leaf program beside it, so its
      launch takes more SMs. Plans of smaller leaf launches lost: ``4,16,256,512_512,32,128,32``
      at 32/8 (leaves 0.39M entries x heads) 0.988x, ToT docmerge at 64/8 (0.17M) 0.938x,
      ``1,50_4000,200`` at 32/8 (0.11M) 0.867x: in a short plan
      the tall launch's added rounds are its critical path. On trees outside the suite,
      gathered launches whose leaves read 3.56-3.88x
      their KV gained 1.049-1.061x over one program a SM, those at 2.67x and 3.2x lost 0.904x
      and 0.985x: a launch with more of the plan's work needs more of the SMs. Checked on 39
      further gathered plans at 32/8 and 64/8:
      over the 33 whose leaves read under 3.5x, this rule is within 1.7% of the faster of the two
      on average (worst 6.7%), the partition everywhere 4.2% (worst 25%), and no feature tried
      (unit length, rounds) told the two apart better; over the six above it the partition gains
      1.029x.

    The persistent launch takes its :func:`persistent_tile` and the launches beside a gathered
    one :func:`beside_persistent`'s tile; tall launches of a smaller footprint
    (contig 32-token tiles in 2-3 stages, gathered ones in 3-4, TMA tiles made contig) lost
    0.53-0.99x."""
    tall = [i for i, ln in enumerate(launches) if ln.block_m >= profile.persist_rows]
    if not tall or len(launches) < 2:
        return tuple(launches)

    def entries(x) -> int:
        return int((work_kv_end[x.work_start: x.work_end] - work_kv_start[x.work_start: x.work_end]).sum())

    i = max(tall, key=lambda j: entries(launches[j]))
    ln = launches[i]
    if not may_persist(ln.block_m, contig=ln.contig, tma=ln.tma, group=group, profile=profile):
        return tuple(launches)
    leaf = sum(entries(x) for x in launches if x.block_m < profile.persist_rows)
    tall_entries = entries(ln) * ln.block_m / TALL_CONTIG_ROWS
    if leaf < profile.persist_min_leaf_ratio * tall_entries or leaf * num_kv_heads < profile.persist_min_leaf_entries:
        return tuple(launches)
    num_sms = profile.num_sms
    work = (ln.work_end - ln.work_start) * num_kv_heads
    if ln.tma or leaf >= profile.persist_partition_ratio * tall_entries:
        share = profile.persist_share_tma if ln.tma else profile.persist_share_gathered
        rounds = -(-work // max(1, int(share * num_sms)))
        if rounds < 2:
            return tuple(launches)
        programs = -(-work // rounds)
    elif work >= profile.persist_min_waves * num_sms:
        programs = num_sms
    else:
        return tuple(launches)
    block_n, num_warps, num_stages = persistent_tile(ln.block_n, ln.num_warps, ln.num_stages, elem_bytes=elem_bytes,
                                                     tma=ln.tma, profile=profile)
    ln = dataclasses.replace(ln, programs=programs, block_n=block_n, num_warps=num_warps,
                             num_stages=num_stages)
    return beside_persistent(tuple(launches[:i]) + (ln,) + tuple(launches[i + 1:]), group=group, profile=profile)
