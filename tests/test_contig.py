"""Affine KV addressing (``Launch.contig``): set only on launches whose work units each read one
run of consecutive slots, kept honest by the lazy update, and the kernel's computed addresses
give the reference output."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import TOL, random_tree, rel_l2

from treeattn import DecodingTree, HeadConfig, TreeAttention
from treeattn.plan import make_plan
from treeattn.plan.lower.addressing import (
    contig_configs,
    contig_launches,
    gathered_configs,
    split_tails,
    unit_runs,
)
from treeattn.plan.format import Launch
from treeattn.plan.select.profiles import H200
from treeattn.reference import reference_attention
from treeattn.tree import tree_from_spec

HEADS = HeadConfig(8, 2, 32, torch.float32)
SHORT = np.full(16, 64)  # work units of 64 tokens
TILE_TALL_CONTIG, TILE_TALL_GATHERED = H200.tile_tall_contig, H200.tile_tall_gathered


def sms(num_sms: int):
    """The H200 profile with ``num_sms`` SMs (the lowering rules count waves of programs)."""
    return dataclasses.replace(H200, num_sms=num_sms)


def runs_brute(slots, start, end):
    return np.array([np.array_equal(slots[s:e], slots[s] + np.arange(e - s)) if e > s else True
                     for s, e in zip(start, end)])


def test_unit_runs_matches_brute_force(rng):
    for n in (0, 1, 2, 50, 400):
        slots = np.cumsum(rng.choice([1, 1, 1, 2, -3], n)).astype(np.int32) + 10
        bounds = np.sort(rng.integers(0, n + 1, (30, 2)), axis=1)
        assert np.array_equal(unit_runs(slots, bounds[:, 0], bounds[:, 1]),
                              runs_brute(slots, bounds[:, 0], bounds[:, 1]))


def test_contig_launch_rule():
    """Runs only; 64-row tiles of long KV tiles keep gathering beyond one wave; more than three
    programs per SM take one pipeline stage less (each launch's own programs)."""
    is_run = np.array([True] * 6 + [False] * 2)
    launches = (Launch(16, 64, 0, 2, 4, 3), Launch(64, 64, 2, 4, 4, 3), Launch(16, 32, 4, 6, 4, 2),
                Launch(16, 64, 6, 8, 4, 3))
    out = contig_launches(launches, is_run, num_kv_heads=8, profile=sms(4), has_mask=True, elem_bytes=2, unit_tokens=SHORT)  # 16 programs a launch
    assert [ln.contig for ln in out] == [True, False, True, False]
    assert [ln.num_stages for ln in out] == [2, 3, 2, 3]
    out = contig_launches(launches, is_run, num_kv_heads=8, profile=sms(16), has_mask=True, elem_bytes=2, unit_tokens=SHORT)  # one wave each
    assert [ln.contig for ln in out] == [True, True, True, False]
    assert [ln.num_stages for ln in out] == [3, 3, 2, 3]
    # units of deep_pipeline_min_tokens on average keep their stages beyond three waves
    long_first = np.array([H200.deep_pipeline_min_tokens + 1, H200.deep_pipeline_min_tokens - 1] + [64] * 6)
    out = contig_launches(launches, is_run, num_kv_heads=8, profile=sms(4), has_mask=True, elem_bytes=2, unit_tokens=long_first)
    assert [ln.num_stages for ln in out] == [3, 3, 2, 3]


def test_tall_contig_launches_take_the_tall_tile():
    """128-row tiles of long KV tiles over runs take TILE_TALL_CONTIG up to six waves, unless
    masked (their mask split was planned for their own KV tile) or of short KV tiles; those that
    keep gathering take TILE_TALL_GATHERED."""
    is_run = np.ones(10, dtype=bool)
    tall = Launch(128, 64, 0, 2, 4, 3, masked=False)
    launches = (tall, Launch(128, 64, 2, 4, 4, 3, masked=True), Launch(128, 32, 4, 6, 4, 2, masked=False),
                Launch(64, 64, 6, 8, 4, 3, masked=False), Launch(128, 64, 8, 10, 4, 3, masked=False, heads_inner=True))
    out = contig_launches(launches, is_run, num_kv_heads=8, profile=sms(4), has_mask=True, elem_bytes=2, unit_tokens=SHORT)  # 16 programs: four waves
    assert out[0] == dataclasses.replace(tall, contig=True, block_n=TILE_TALL_CONTIG[0],
                                         num_warps=TILE_TALL_CONTIG[1], num_stages=TILE_TALL_CONTIG[2])
    gathered = dict(zip(("block_n", "num_warps", "num_stages"), TILE_TALL_GATHERED))
    assert out[1] == dataclasses.replace(launches[1], **gathered)  # masked: gathered beyond one wave
    assert contig_launches(launches[1:2], is_run, num_kv_heads=8, profile=sms(4), has_mask=False, elem_bytes=2, unit_tokens=SHORT)[0].block_n == 32
    assert out[2] == dataclasses.replace(launches[2], contig=True)
    assert out[3] == launches[3]
    assert out[4].heads_inner and out[4].block_n == TILE_TALL_CONTIG[0]
    out = contig_launches(launches, is_run, num_kv_heads=8, profile=sms(2), has_mask=True, elem_bytes=2, unit_tokens=SHORT)  # eight waves: too many
    assert out[0] == dataclasses.replace(tall, **gathered)
    assert contig_launches(launches, is_run, num_kv_heads=8, profile=sms(2), has_mask=True, elem_bytes=4, unit_tokens=SHORT)[0] == tall
    for shape in [(128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 2)]:
        assert (TILE_TALL_CONTIG in contig_configs(*shape, profile=H200)) == (shape[:2] == (128, 64))


def test_gathered_32_row_launches_of_many_waves_take_two_warps():
    """Only gathered launches of 32-row tiles over long KV tiles with >= 6 waves of programs."""
    is_run = np.array([False] * 8 + [True] * 2)
    launches = (Launch(32, 64, 0, 2, 4, 3), Launch(32, 32, 2, 4, 4, 2), Launch(64, 64, 4, 6, 4, 3),
                Launch(16, 64, 6, 8, 4, 3), Launch(32, 64, 8, 10, 4, 3))
    out = contig_launches(launches, is_run, num_kv_heads=12, profile=sms(4), has_mask=False, elem_bytes=2, unit_tokens=SHORT)  # 24 programs: 6 waves
    assert out[0] == dataclasses.replace(launches[0], num_warps=H200.gathered_narrow_warps)
    assert out[1:4] == launches[1:4]
    assert out[4].contig and out[4].num_warps == 4  # a run: computed addresses, four warps
    out = contig_launches(launches, is_run, num_kv_heads=11, profile=sms(4), has_mask=False, elem_bytes=2, unit_tokens=SHORT)  # 22 programs
    assert out[0] == launches[0]
    for shape in [(32, 64, 4, 3), (32, 32, 4, 2), (16, 64, 4, 3), (64, 64, 4, 3)]:
        assert ((64, H200.gathered_narrow_warps, 3) in gathered_configs(*shape, elem_bytes=2, profile=H200)) == (shape[:2] == (32, 64))
        assert gathered_configs(*shape, elem_bytes=2, profile=H200)[0] == shape[1:]


def test_split_tail_on_tall_unmasked_launches_of_whole_tiles_or_long_units():
    """Tall (>= ``split_tail_rows`` rows) unmasked launches whose units hold whole KV tiles only, or
    average >= ``split_tail_tiles`` tiles; not short units with a partial tile, small tiles or masked
    launches."""
    starts = np.array([0, 64, 128, 200, 300, 400, 500, 600, 700, 2800])
    ends = np.array([64, 128, 192, 300, 364, 464, 564, 700, 2800, 4900])
    launches = tuple(Launch(m, n, a, b, 4, 3, masked=masked) for m, n, a, b, masked in [
        (128, 32, 0, 2, False), (64, 64, 2, 4, False), (128, 64, 4, 5, True), (32, 64, 5, 7, False),
        (128, 64, 7, 8, False), (64, 64, 8, 10, False)])
    out = split_tails(launches, starts, ends, has_mask=True, profile=H200)
    # whole tiles; a 100-token unit; masked; small tiles; a partial 100-token unit; 2100-token units
    assert H200.split_tail_rows == 64 and H200.split_tail_tiles * 64 <= 2100
    assert [ln.split_tail for ln in out] == [True, False, False, False, False, True]
    assert all(type(ln.split_tail) is bool for ln in out)  # a constexpr: Triton 3.6 rejects numpy bools
    assert out[3] is launches[3]
    assert split_tails(launches, starts, ends, has_mask=False, profile=H200)[2].split_tail  # unmasked plan: 64 whole tokens


def test_tall_contig_kernel_matches_reference(device):
    """A root of 100 tokens read by 20 queries x GQA 4 (one 128-row tile, 64-token KV tiles
    planned) runs with the tall contig tile and gives the reference output."""
    tree = tree_from_spec("1,20_100,5")
    attn = TreeAttention(device=device, backend="triton")
    plan = attn.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, strategy="node")
    tall = [ln for ln in plan.launches if ln.block_m == 128]
    assert tall and all(ln.contig and (ln.block_n, ln.num_warps, ln.num_stages) == TILE_TALL_CONTIG for ln in tall)
    q = torch.randn(tree.num_queries, 8, 32, dtype=torch.float64)
    k = torch.randn(tree.num_tokens, 1, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    ref = reference_attention(q, k, v, tree)[0]
    assert rel_l2(attn.run(*[t.float().to(device) for t in (q, k, v)], plan), ref) <= TOL[torch.float32]


def test_gathered_tall_launches_take_the_tall_gathered_tile():
    """Gathered launches of 128-row tiles over long KV tiles take TILE_TALL_GATHERED with 16-bit
    caches, masked or not; not with fp32 caches (its seven stages would not fit shared memory),
    64-row tiles, short KV tiles or runs."""
    is_run = np.array([False] * 8 + [True] * 2)
    launches = (Launch(128, 64, 0, 2, 4, 3), Launch(128, 64, 2, 4, 4, 3, masked=True, mask_split=True),
                Launch(64, 64, 4, 6, 4, 3), Launch(128, 32, 6, 8, 4, 2), Launch(128, 64, 8, 10, 4, 3, masked=False))
    out = contig_launches(launches, is_run, num_kv_heads=8, profile=sms(4), has_mask=True, elem_bytes=2, unit_tokens=SHORT)
    block_n, num_warps, num_stages = TILE_TALL_GATHERED
    for i in (0, 1):
        assert out[i] == dataclasses.replace(launches[i], block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    assert out[2:4] == launches[2:4]
    assert out[4].contig and out[4].block_n == TILE_TALL_CONTIG[0]
    assert contig_launches(launches, is_run, num_kv_heads=8, profile=sms(4), has_mask=True, elem_bytes=4, unit_tokens=SHORT)[:4] == launches[:4]
    assert gathered_configs(128, 64, 4, 3, elem_bytes=2, profile=H200) == [TILE_TALL_GATHERED]
    assert gathered_configs(128, 64, 4, 3, elem_bytes=4, profile=H200) == [(64, 4, 3)]
    assert gathered_configs(64, 64, 4, 3, elem_bytes=2, profile=H200) == [(64, 4, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("inside", [0, 12])
def test_tall_gathered_kernel_matches_reference(rng, device, inside):
    """The root of ``1,20_100,5`` (one 128-row tile, 64-token KV tiles planned) with its slots
    scattered over the pool, and with ``inside`` more queries inside the root (the tree mask):
    fp16 plans gather with the tall gathered tile and give the reference output."""
    tree = tree_from_spec("1,20_100,5")
    tree = shuffled_pages(tree.with_queries(np.concatenate([tree.query_nodes, np.zeros(inside, dtype=np.int64)]),
                                            np.concatenate([tree.query_prefix, rng.integers(1, 100, inside)])), rng)
    attn = TreeAttention(device=device, backend="triton")
    plan = attn.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float16, strategy="node")
    tall = [ln for ln in plan.launches if ln.block_m == 128]
    assert tall and all(not ln.contig and (ln.block_n, ln.num_warps, ln.num_stages) == TILE_TALL_GATHERED
                        for ln in tall)
    assert plan.has_mask == bool(inside) and all(ln.masked for ln in tall) >= bool(inside)
    q = torch.randn(tree.num_queries, 8, 32, dtype=torch.float64)
    k = torch.randn(int(tree.kv_indices.max()) + 1, 1, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    ref = reference_attention(q, k, v, tree)[0]
    assert rel_l2(attn.run(*[t.half().to(device) for t in (q, k, v)], plan), ref) <= TOL[torch.float16]


def shuffled_pages(tree: DecodingTree, rng) -> DecodingTree:
    """``tree`` with its pages in random pool order (slots inside a page stay consecutive)."""
    ps = tree.page_size
    pages = -(-int(tree.kv_indices.max() + 1) // ps)
    perm = rng.permutation(pages)
    kv = perm[tree.kv_indices // ps] * ps + tree.kv_indices % ps
    return DecodingTree.from_parents(tree.parents, tree.lengths, query_nodes=tree.query_nodes,
                                     query_prefix=tree.query_prefix, kv_indices=kv, page_size=ps)


@pytest.mark.parametrize("strategy", ["node", "node_chunk", "sequence", "greedy", "pack", "flatten", "auto"])
def test_contig_launches_read_runs_only(rng, strategy):
    for tree in (tree_from_spec("1,4,16_300,40,9"), shuffled_pages(random_tree(rng, 30, 80), rng),
                 random_tree(rng, 40, 70, roots=2, inner_queries=True)):
        plan = make_plan(tree, HEADS, strategy=strategy)
        slots = plan.kv_indices.numpy()
        start, end = plan.work_kv_start.numpy(), plan.work_kv_end.numpy()
        runs = runs_brute(slots, start, end)
        for ln, base in zip(plan.launches, plan.host.gather_launches):
            assert not ln.contig or runs[ln.work_start:ln.work_end].all()
            # Computed addresses and the select-free step change the tile config and those flags only.
            assert dataclasses.replace(ln, contig=False, block_n=base.block_n, num_warps=base.num_warps,
                                       num_stages=base.num_stages, split_tail=base.split_tail) == base


def test_node_plan_of_a_fresh_pool_computes_its_addresses():
    plan = make_plan(tree_from_spec("1,4,16_300,40,9"), HEADS, strategy="node")
    assert all(ln.contig for ln in plan.launches)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("strategy", ["node", "sequence", "greedy"])
def test_contig_kernel_matches_reference(rng, device, strategy, page_size):
    """Contiguous node slots (one page-aligned run each), with a tree mask (queries inside
    nodes): contig and gathered addresses give the reference output."""
    tree = random_tree(rng, 12, 90, inner_queries=True)
    tree = DecodingTree.from_parents(tree.parents, tree.lengths, query_nodes=tree.query_nodes,
                                     query_prefix=tree.query_prefix, page_size=page_size)
    attn = TreeAttention(device=device, backend="triton")
    plan = attn.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, strategy=strategy)
    assert strategy != "node" or any(ln.contig for ln in plan.launches)
    gather = dataclasses.replace(plan, launches=plan.host.gather_launches)
    q = torch.randn(tree.num_queries, 8, 32, dtype=torch.float64)
    k = torch.randn(-(-tree.num_tokens // page_size), page_size, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    ref = reference_attention(q, k, v, tree)[0]
    args = [t.float().to(device) for t in (q, k, v)]
    assert rel_l2(attn.run(*args, plan), ref) <= TOL[torch.float32]
    assert rel_l2(attn.run(*args, gather), ref) <= TOL[torch.float32]


def grow(tree: DecodingTree, new_slots: np.ndarray) -> DecodingTree:
    """``tree`` after one decode step: every query's node gains one token in ``new_slots``."""
    grown = np.zeros(tree.num_nodes, dtype=np.int64)
    grown[tree.query_nodes] = 1
    lengths = tree.lengths + grown
    indptr = np.concatenate(([0], np.cumsum(lengths)))
    kv = np.empty(indptr[-1], dtype=np.int64)
    old = np.ones(indptr[-1], dtype=bool)
    old[indptr[1:][grown > 0] - 1] = False
    kv[old], kv[~old] = tree.kv_indices, new_slots
    return DecodingTree.from_parents(tree.parents, lengths, query_nodes=tree.query_nodes, kv_indices=kv,
                                     page_size=tree.page_size)


def test_update_keeps_contig_only_where_the_new_slots_follow(device):
    """Leaves with a free slot after their last token keep computed addresses after an update;
    new slots elsewhere in the pool turn the leaves' launches back to gathered slots."""
    # root 50 tokens, 4 leaves of 20: each leaf's slots are followed by 12 free ones
    lengths = [50, 20, 20, 20, 20]
    starts = [0, 64, 96, 128, 160]
    kv = np.concatenate([s + np.arange(n) for s, n in zip(starts, lengths)])
    tree = DecodingTree.from_parents([-1, 0, 0, 0, 0], lengths, query_nodes=[1, 2, 3, 4], kv_indices=kv,
                                     page_size=1, num_slots=256)
    attn = TreeAttention(device=device, backend="triton")
    plan = attn.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, strategy="node")
    assert all(ln.contig for ln in plan.launches)
    q = torch.randn(4, 8, 32, dtype=torch.float64)
    k = torch.randn(256, 1, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    args = [t.float().to(device) for t in (q, k, v)]
    for new, contig in ((np.array([84, 116, 148, 180]), True), (np.array([200, 201, 202, 203]), False)):
        grown = grow(tree, new)
        updated = attn.update(plan, grown)
        assert updated.strategy == plan.strategy and updated.num_work == plan.num_work  # patched
        leaf_launches = [ln for ln in updated.launches if ln.block_n == 32]  # (the root: 64)
        assert leaf_launches and all(ln.contig == contig for ln in leaf_launches)
        ref = reference_attention(q, k, v, grown)[0]
        assert rel_l2(attn.run(*args, updated), ref) <= TOL[torch.float32]
