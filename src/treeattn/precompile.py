"""Compile every kernel variant a plan can launch before it is needed: Triton compiles a
variant the first time it is launched, which stalls a decoding loop for seconds. A serving
process calls :func:`precompile` at start-up, in worker processes where it is given several:
:meth:`treeattn.TreeAttention.precompile` with the wrapper's launch mode,
:meth:`treeattn.engine.TreeEngine.precompile_kernels` with the engine's.

:func:`main` is the worker (a new interpreter): it launches the variants it takes from a work
queue shared with the other workers, so that Triton writes them to its on-disk cache, which the
process that started it then reads.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import logging
import os
import subprocess
import sys
import time

import torch

from treeattn.launchers import (TOPK_CANDIDATES, attention_constexprs, gumbel_argmax, merge_partials, partial_attention,
                                row_topk_candidates)
from treeattn.plan.lower.addressing import (
    TALL_CONTIG_ROWS,
    beside_configs,
    contig_configs,
    gathered_configs,
    may_persist,
    persistent_tile,
)
from treeattn.plan.lower.merge_config import launch_merges, merge_launches
from treeattn.plan.format import HeadConfig, Launch, launch_shapes
from treeattn.plan.select.profiles import DeviceProfile, profile_for

__all__ = ["launch_configs", "persists", "precompile"]

log = logging.getLogger(__name__)


def launch_configs(heads: HeadConfig, *, profile: DeviceProfile, tma: bool = False, pdl: bool = False) -> list:
    """Every ``(block_m, block_n, num_warps, num_stages, contig, tma)`` an attention launch of a
    plan for ``heads`` can have, lowered by the rules and tiles of ``profile`` (the cost model's
    that planned it; ``tma``: plans may take
    :func:`~treeattn.plan.lower.addressing.tma_launches`; ``pdl``: plans run with PDL, whose tall
    launches may run persistent): each planned shape gathering its slots or computing them, as
    :mod:`treeattn.plan.lower.addressing` configures each (contig launches may run one pipeline stage
    less, tall ones another tile, through tensor descriptors with ``tma``; gathered 32-row ones
    two warps, gathered tall ones their own tile; with ``pdl``, persistent launches their
    :func:`~treeattn.plan.lower.addressing.persistent_tile` and the contig ones beside them
    :func:`~treeattn.plan.lower.addressing.beside_persistent`'s)."""
    eb, group = heads.elem_bytes, heads.group
    out = []
    for m, n, warps, stages in launch_shapes(heads, profile=profile):
        gathered = gathered_configs(m, n, warps, stages, elem_bytes=eb, profile=profile)
        out += [(m, *c, False, False) for c in gathered]
        out += [(m, *c, True, False) for c in contig_configs(m, n, warps, stages, profile=profile)]
        out += [(m, *profile.tile_tall_tma, True, True)] * (tma and m >= TALL_CONTIG_ROWS and n >= 64)
        if pdl and may_persist(m, contig=False, tma=False, group=group, profile=profile):
            out += [(m, *persistent_tile(*c, elem_bytes=eb, profile=profile), False, False) for c in gathered]
        if pdl and group >= profile.beside_min_group:
            out += [(m, *c, True, False) for c in beside_configs(m, n, profile=profile)]
    return list(dict.fromkeys(out))


def persists(heads: HeadConfig, cfg: tuple, *, profile: DeviceProfile, pdl: bool) -> bool:
    """Whether a launch of ``cfg`` (a :func:`launch_configs` entry under ``profile``) may run
    persistent (:func:`~treeattn.plan.lower.addressing.persistent_tall`, plans run with ``pdl``, at
    the launch's :func:`~treeattn.plan.lower.addressing.persistent_tile`)."""
    m, n, warps, stages, contig, tma = cfg
    return (pdl and may_persist(m, contig=contig, tma=tma, group=heads.group, profile=profile)
            and (n, warps, stages) == persistent_tile(n, warps, stages, elem_bytes=heads.elem_bytes, tma=tma,
                                                      profile=profile))


def precompile(heads: HeadConfig, *, page_size: int, device, pdl: bool = False,
               tma: bool = False, merge_last: bool = True, workers: int = 0, vocab: int | None = None,
               profile: DeviceProfile | None = None) -> int:
    """Launch every partial-attention variant a plan for ``heads`` can use (each of
    :func:`launch_configs` x tree mask x rows to the merge, direct or merged in the launch x grid
    order x mask split x split tail; x persistent where :func:`persists`)
    and every merge variant once, on dummy data, so that Triton compiles them now rather than in
    the middle of serving (a first-seen shape stalls decoding for seconds).
    ``pdl``: the variants :func:`~treeattn.launchers.partial_attention` and
    :func:`~treeattn.launchers.merge_partials` launch with ``pdl``.
    ``tma``: the plans may take :func:`~treeattn.plan.lower.addressing.tma_launches`
    (:func:`~treeattn.plan.lower.addressing.tma_loads`).
    ``merge_last``: the plans' last launch may merge (:attr:`~treeattn.plan.format.Plan.merge_last`;
    :attr:`~treeattn.plan.select.profiles.DeviceProfile.merge_last_min_group`); without it, no merging variant.
    ``workers``: on a CUDA device, first compile in this many worker processes (each launches
    the next variant no other has taken, on the same device, so Triton writes it to its on-disk cache;
    this process then loads them from there). Each holds a CUDA context while it runs.
    0 or 1: compile in this process.
    ``vocab``: also every variant of the fused sampling kernel
    (:func:`~treeattn.launchers.gumbel_argmax`) over float32 logits of this many entries.
    ``profile``: the device profile of the cost model that plans (its lowering rules' tiles and
    thresholds decide the variants); None: :func:`~treeattn.plan.select.profiles.profile_for`
    ``device``, the default cost model's.

    Returns the number of launches made in this process.
    """
    device = torch.device(device)
    if profile is None:
        profile = profile_for(device)
    if workers > 1 and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    variants = list(_variants(heads, page_size, device, pdl, tma, profile=profile, merge_last=merge_last, vocab=vocab))
    if workers > 1 and device.type == "cuda":
        _compile_in_workers(heads, page_size, device, pdl, tma, workers, merge_last, vocab, profile, len(variants))
    for launch in variants:
        launch()
    return len(variants)


def _variants(heads: HeadConfig, page_size: int, device: torch.device, pdl: bool, tma: bool, *,
              profile: DeviceProfile, merge_last: bool = True, vocab: int | None = None):
    """Yield one callable per variant, which launches it (on dummy data, shared between them).
    Each binds what it launches with as its defaults: a worker calls them after the generator has
    moved on and rebound its loop variables."""
    if vocab is not None:
        # sampling: with or without noise, the counter and the temperature for the step or per
        # row (the server's), with or without the log-softmax normaliser
        x = torch.zeros(2, vocab, device=device)
        row_ids, scales = torch.zeros(2, dtype=torch.int64, device=device), torch.ones(2, device=device)
        for noise, row_counter, row_scale, stats in itertools.product((False, True), repeat=4):
            yield lambda streams=row_ids if noise else None, counter=row_ids if row_counter else 0, \
                scale=scales if row_scale else 1.0, stats=stats: gumbel_argmax(
                    x, streams=streams, counter=counter, scale=scale, stats=stats)
        # beam search's candidates
        for k in TOPK_CANDIDATES:
            yield lambda k=k: row_topk_candidates(x, k)
    from treeattn.plan import make_plan
    from treeattn.tree import DecodingTree

    hq, hkv, d, dt = heads.num_qo_heads, heads.num_kv_heads, heads.head_dim, heads.dtype
    pages = -(-2 // page_size)  # the dummy node's two tokens
    kc = torch.randn(pages, page_size, hkv, d, device=device).to(dt)
    q = torch.randn(2, hq, d, device=device).to(dt)
    for prefix in (2, 1):  # both queries see the node whole; then one sees a part: the tree mask
        tree = DecodingTree.from_parents([-1], [2], query_nodes=[0, 0], query_prefix=[2, prefix],
                                         page_size=page_size, num_slots=pages * page_size)
        plan = make_plan(tree, heads, strategy="node", device=device)
        o_part = torch.empty(plan.num_rows, hq, d, device=device, dtype=heads.partial_dtype)
        lse_part = torch.empty(plan.num_rows, hq, device=device)
        out = torch.empty_like(q)
        # rows: to the merge, direct where final, or merging (a plan's last launch)
        seen = set()
        for cfg, rows, inner, split, tail, persist in itertools.product(
                launch_configs(heads, profile=profile, tma=tma, pdl=pdl), ("part", "direct", "merge"),
                (False, True), (False, True), (False, True), (False, True)):
            m, n, warps, stages, contig, tma_ = cfg
            # (launches the builder never makes)
            if (tail and m < profile.split_tail_rows) \
                    or (rows == "merge" and not (merge_last and launch_merges(m, tma_))) \
                    or (persist and (rows == "merge" or not persists(heads, cfg, profile=profile, pdl=pdl))):
                continue
            launch = Launch(m, n, 0, plan.num_work, warps, stages, heads_inner=inner, mask_split=split,
                            contig=contig, split_tail=tail, tma=tma_, programs=int(persist))
            shaped = dataclasses.replace(plan, launches=(launch,), num_direct=plan.num_direct if rows == "direct" else 0,
                                         merge_launch=0 if rows == "merge" else -1)
            # the launcher's own flags tell apart what compiles to different code: a flag the
            # kernel would not read adds no variant; TMA launches always run the split tail
            flags = attention_constexprs(shaped, launch, dtype=dt, device=device, direct=shaped.num_direct > 0,
                                         merges=rows == "merge", write_lse=False, tma=tma_, wide=False)
            key = tuple(flags.items())
            if key in seen or (flags["TMA"] and not flags["SPLIT_TAIL"]):
                continue
            seen.add(key)
            yield lambda shaped=shaped, rows=rows, o_part=o_part, lse_part=lse_part, out=out: partial_attention(
                q, kc, kc, shaped, o_part, lse_part, sm_scale=d ** -0.5, out=out, pdl=pdl, merge_last=rows == "merge")
    for n, rows in merge_launches(hq, d):
        o_part = torch.zeros(n, hq, d, device=device, dtype=heads.partial_dtype)
        lse_part = torch.zeros(n, hq, device=device)
        idx = torch.arange(n + 1, dtype=torch.int32, device=device)
        out = torch.empty(n, hq, d, device=device, dtype=dt)
        for lse in (None, torch.empty(n, hq, device=device)):
            yield lambda o_part=o_part, lse_part=lse_part, idx=idx, out=out, lse=lse, rows=rows: merge_partials(
                o_part, lse_part, idx[:-1], idx, idx[:-1], out, lse, max_rows=rows, pdl=pdl)


def _launch_variants(heads: HeadConfig, page_size: int, device: torch.device, pdl: bool, tma: bool, *,
                     profile: DeviceProfile, merge_last: bool = True, vocab: int | None = None, indices) -> int:
    """Launch the variants of :func:`_variants` numbered ``indices`` (an iterable of ints, each
    taken as it is needed); returns how many."""
    variants = list(_variants(heads, page_size, device, pdl, tma, profile=profile, merge_last=merge_last, vocab=vocab))
    launches = 0
    for i in indices:
        variants[i]()
        launches += 1
    return launches


#: bytes of a work queue's record (one variant's number)
_RECORD = 4


def _taken(fd: int):
    """Yield the variant numbers this process takes from the work queue read from ``fd``, until the
    queue is empty (its writer has closed it). Every record was written by one ``write`` of
    ``_RECORD`` bytes and is read by one ``read`` of as many, so each goes to exactly one reader."""
    while record := os.read(fd, _RECORD):
        yield int.from_bytes(record, "little")


@functools.cache
def _compile_in_workers(heads: HeadConfig, page_size: int, device: torch.device, pdl: bool, tma: bool,
                        workers: int, merge_last: bool, vocab: int | None, profile: DeviceProfile,
                        count: int) -> None:
    """Run ``workers`` processes of :func:`main` on ``device`` (``cuda:N``), which take the
    ``count`` variants from one work queue (a pipe) until it is empty; raise RuntimeError naming the first
    that failed. Variants take 0.2-3.6 s each to compile: given every ``workers``-th one, the
    16 workers of an H200 host finished 38-49 s after they started (8B heads, 444 variants); taking
    the next one whenever it is free, within a second or two of each other. Once a process for
    each set of arguments (cached): a later call finds the variants in this process's JIT cache,
    where starting the workers again made it take 8.6-11.9 s instead of 0.1 s (measured on an
    H100, 16 workers)."""
    t0 = time.perf_counter()
    common = [f"--heads={heads.num_qo_heads},{heads.num_kv_heads},{heads.head_dim}",
              f"--dtype={str(heads.dtype).removeprefix('torch.')}", f"--page-size={page_size}",
              f"--device={device}"] + ["--pdl"] * pdl + ["--tma"] * tma \
        + ["--no-merge-last"] * (not merge_last) + [f"--vocab={vocab}"] * (vocab is not None) \
        + [f"--profile={profile.to_json()}"]
    # (a new interpreter, not a fork: CUDA cannot be used in a forked child; and not
    # multiprocessing's spawn, which would re-run a caller's script without a main guard; nor
    # ``-m treeattn.precompile``, which the package's import would load a second time)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    queue, feed = os.pipe()
    try:
        procs = [subprocess.Popen([sys.executable, "-c", "from treeattn.precompile import main; main()", *common,
                                   f"--queue-fd={queue}"], env=env, pass_fds=(queue,),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for _ in range(workers)]
    finally:
        os.close(queue)
    try:
        # (written after the workers started, so a queue longer than the pipe's buffer cannot block)
        for i in range(count):
            os.write(feed, i.to_bytes(_RECORD, "little"))
    except BrokenPipeError:
        pass  # every worker has exited: their errors are raised below
    finally:
        os.close(feed)
    errors = [(i, p.communicate()[1]) for i, p in enumerate(procs)]
    failed = [(i, err) for (i, err), p in zip(errors, procs) if p.returncode]
    if failed:
        i, err = failed[0]
        raise RuntimeError(f"precompile worker {i} of {workers} failed:\n{err[-2000:]}")
    log.info("compiled %d kernel variants in %d worker processes in %.1f s", count, workers, time.perf_counter() - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="precompile's worker: launch the kernel variants taken from a work queue")
    ap.add_argument("--heads", required=True, help="query heads, KV heads, head dim")
    ap.add_argument("--dtype", required=True, choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--page-size", type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--pdl", action="store_true")
    ap.add_argument("--tma", action="store_true")
    ap.add_argument("--no-merge-last", action="store_true")
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--profile", required=True, help="the DeviceProfile as JSON")
    ap.add_argument("--queue-fd", type=int, required=True, help="the work queue's read end (variant numbers)")
    args = ap.parse_args(argv)
    hq, hkv, d = map(int, args.heads.split(","))
    device = torch.device(args.device)
    torch.cuda.set_device(device)  # (Triton compiles for the current device)
    _launch_variants(HeadConfig(hq, hkv, d, getattr(torch, args.dtype)), args.page_size, device, args.pdl, args.tma,
                     profile=DeviceProfile.from_json(args.profile, source="--profile"),
                     merge_last=not args.no_merge_last, vocab=args.vocab, indices=_taken(args.queue_fd))
    torch.cuda.synchronize()

