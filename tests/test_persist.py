"""Persistent launches (``Launch.programs``): fewer programs than units x KV heads, each looping
over them in the grid's order, give the reference output for every planner, with and without a
tree mask, the heads-inner grid and the last launch's merge; and the rule that plans them
(:func:`~treeattn.plan.lower.addressing.persistent_tall`)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import TOL, random_tree, rel_l2

from treeattn import HeadConfig, TreeAttention
from treeattn.plan import make_plan
from treeattn.plan.lower.addressing import persistent_tall
from treeattn.plan.select.cost import CostModel
from treeattn.plan.select.profiles import H200
from treeattn.plan.format import Launch
from treeattn.reference import reference_attention
from treeattn.tree import DecodingTree
from treeattn.tree import tree_from_spec


def persistent(plan, programs: int):
    """``plan`` with every launch persistent over at most ``programs`` programs."""
    return dataclasses.replace(plan, launches=tuple(dataclasses.replace(ln, programs=programs)
                                                    for ln in plan.launches))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["node", "paths", "greedy", "flatten"])
@pytest.mark.parametrize("inner", [False, True])
def test_persistent_launches_match_reference(rng, device, strategy, inner):
    tree = random_tree(rng, 14, 70, inner_queries=inner)
    attn = TreeAttention(device=device, backend="triton")
    plan = attn.plan(tree, num_qo_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.float32, strategy=strategy)
    q = torch.randn(tree.num_queries, 6, 32, dtype=torch.float64)
    k = torch.randn(int(tree.kv_indices.max()) + 1, 1, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    ref = reference_attention(q, k, v, tree)[0]
    args = [t.float().to(device) for t in (q, k, v)]
    for programs in (1, 3):
        assert rel_l2(attn.run(*args, persistent(plan, programs)), ref) <= TOL[torch.float32]
    # heads-inner grids loop in their own order
    inner_plan = dataclasses.replace(plan, launches=tuple(dataclasses.replace(ln, heads_inner=True, programs=5)
                                                          for ln in plan.launches))
    assert rel_l2(attn.run(*args, inner_plan), ref) <= TOL[torch.float32]


def test_persistent_last_launch_merges(rng, device):
    """A persistent last launch folds its queries' other rows (``merge_last``) unit by unit."""
    tree = tree_from_spec("1,3_600,5")
    attn = TreeAttention(device=device, backend="triton", streams=0,
                         cost=CostModel(side_streams=True,
                                        profile=dataclasses.replace(H200, tall_first_s=0.0, merge_last_min_group=1)))
    plan = attn.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, strategy="node")
    assert plan.merge_last and len(plan.launches) > 1
    q = torch.randn(tree.num_queries, 8, 32, dtype=torch.float64)
    k = torch.randn(tree.num_tokens, 1, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    ref = reference_attention(q, k, v, tree)[0]
    out = attn.run(*[t.float().to(device) for t in (q, k, v)], persistent(plan, 2))
    assert rel_l2(out, ref) <= TOL[torch.float32]


TILE_BESIDE, TILE_TALL_GATHERED = H200.tile_beside, H200.tile_tall_gathered
# leaf units 0-3 (1600 entries), tall 4-5 (200)
START, END = np.zeros(6, dtype=np.int64), np.array([400, 400, 400, 400, 100, 100])


def rule(launches, *, group: int, num_sms: int = 8, elem_bytes: int = 2, work_kv_end=END, min_leaf_entries=0):
    """:func:`persistent_tall` over 8 KV heads under the H200 profile with ``num_sms`` SMs, shares
    of 0.5 (gathered) and 0.25 (TMA) and ``min_leaf_entries``."""
    profile = dataclasses.replace(H200, num_sms=num_sms, persist_share_gathered=0.5, persist_share_tma=0.25,
                                  persist_min_leaf_entries=min_leaf_entries)
    return persistent_tall(launches, START, work_kv_end, 8, group=group, elem_bytes=elem_bytes, profile=profile)


def test_persistent_tall_rule():
    """The largest launch of tall tiles, gathered or through TMA, beside leaf launches that read at
    least ``persist_min_leaf_ratio`` times its KV (for 128-row tiles) and ``min_leaf_entries`` KV
    entries x KV heads, at a GQA group of ``persist_min_group`` or more, runs persistent over
    ``ceil(W / R)`` programs, ``R = ceil(W / (share x SMs))`` rounds of its ``W`` (a gathered
    one beside leaves of under ``persist_partition_ratio`` times its KV: one program a SM from
    ``persist_min_waves`` waves); nothing else does."""
    end = END
    leaf, tall = Launch(16, 64, 0, 4), Launch(128, 32, 4, 6, 4, 7)
    # 16 programs over a share of 0.5 x 8 SMs: 4 rounds of 4 programs; of 0.5 x 10: 4 rounds of 4
    assert rule((leaf, tall), num_sms=8, group=8) == (leaf, dataclasses.replace(tall, programs=4))
    assert rule((leaf, tall), num_sms=10, group=8)[1].programs == 4
    assert rule((leaf, tall), num_sms=12, group=8)[1].programs == 6  # 3 rounds of 6 (the last of 4)
    assert rule((leaf, tall), num_sms=32, group=8) == (leaf, tall)  # one round: nothing to share
    assert rule((leaf, tall), num_sms=8, group=H200.persist_min_group - 1) == (leaf, tall)
    assert rule((leaf, tall), num_sms=8, group=8, min_leaf_entries=1600 * 8 + 1) == (leaf, tall)
    # a TMA launch keeps its tile and takes its own share; a contig one that computes its
    # addresses without TMA is not made persistent
    tma = dataclasses.replace(tall, block_n=128, num_warps=8, num_stages=3, contig=True, tma=True)
    assert rule((leaf, tma), num_sms=8, group=8) == (leaf, dataclasses.replace(tma, programs=2))
    contig = dataclasses.replace(tall, contig=True)
    assert rule((leaf, contig), num_sms=8, group=8) == (leaf, contig)
    # of two tall launches, the one of most KV entries
    two = (leaf, Launch(64, 64, 4, 5), Launch(128, 32, 5, 6, 4, 7))
    out = rule(two, work_kv_end=np.array([400, 400, 400, 400, 40, 100]), num_sms=2, group=8)
    assert out[:2] == two[:2] and out[2].programs == 1
    # the leaves must read persist_min_leaf_ratio times the tall launch's entries (64-row tiles count half)
    short = end.copy()
    short[:4] = H200.persist_min_leaf_ratio * 200 / 4 - 1
    assert rule((leaf, tall), work_kv_end=short, num_sms=8, group=8) == (leaf, tall)
    half = dataclasses.replace(tall, block_m=64)
    assert rule((leaf, half), work_kv_end=short, num_sms=8, group=8)[1].programs == 4
    # under persist_partition_ratio times its entries, a gathered launch runs over one program a SM
    # where it has persist_min_waves waves of programs (16 here), a TMA one over its share
    fewer = end.copy()
    fewer[:4] = H200.persist_partition_ratio * 200 / 4 - 1
    assert rule((leaf, tall), work_kv_end=fewer, num_sms=10, group=8)[1].programs == 10
    assert rule((leaf, tall), work_kv_end=fewer, num_sms=11, group=8) == (leaf, tall)
    assert rule((leaf, tma), work_kv_end=fewer, num_sms=8, group=8)[1].programs == 2


def test_builder_shares_the_sms_by_cost_model():
    """The builder takes the shares and the leaf minimum from the CostModel: on an H200 the TMA tall
    launch of ``1,8,512_32,2048,256`` at 64/8 (256 programs) runs over 64 (4 rounds over half the
    SMs) and the gathered one of ``1,8,512_512,512,256`` over 86 (3 rounds over 0.72 of them);
    ``4,16,256,512_512,32,128,32``'s leaves at 32/8 (0.39M KV entries x heads) are too few;
    ``1,32,512_512,1024,256``'s
    gathered launch (leaves 2.67x its KV) runs over one program a SM."""
    heads = HeadConfig(64, 8, 128, torch.float16)
    cost = CostModel(tma=True, pdl=True)
    for spec, programs in (("1,8,512_32,2048,256", [0, 0, 64]), ("1,8,512_512,512,256", [0, 86]),
                           ("1,32,512_512,1024,256", [0, cost.profile.num_sms])):
        plan = make_plan(tree_from_spec(spec), heads, cost=cost)
        assert [ln.programs for ln in plan.launches] == programs, spec
    forest, heads = tree_from_spec("4,16,256,512_512,32,128,32"), HeadConfig(32, 8, 128, torch.float16)
    assert not any(ln.programs for ln in make_plan(forest, heads, cost=cost).launches)
    low = dataclasses.replace(cost, profile=dataclasses.replace(cost.profile, persist_min_leaf_entries=0))
    assert any(ln.programs for ln in make_plan(forest, heads, cost=low).launches)


def tile(ln) -> tuple:
    return ln.block_n, ln.num_warps, ln.num_stages


def test_persistent_tile_and_the_launches_beside_it():
    """The persistent launch takes ``tile_tall_gathered`` wherever a 128-row one would (16-bit
    caches, 64-token tiles planned), any query tile; beside it, at GQA groups of
    ``beside_min_group`` or more, the shorter tiles' launches that compute their addresses over
    64-token tiles take ``tile_beside``; beside a TMA one (which fills its SM) they keep their tile."""
    tall = Launch(64, 64, 4, 6, 4, 3)
    leaf = Launch(16, 64, 0, 2, 4, 2, contig=True)
    gathered, short = Launch(16, 64, 2, 3, 4, 2), Launch(32, 32, 3, 4, 4, 2, contig=True)
    out = rule((leaf, gathered, short, tall), group=H200.beside_min_group, elem_bytes=2)
    assert out[3].programs == 4 and tile(out[3]) == TILE_TALL_GATHERED
    assert tile(out[0]) == TILE_BESIDE and out[1:3] == (gathered, short)
    out = rule((leaf, tall), group=H200.beside_min_group - 1, elem_bytes=2)
    assert out[1].programs == 4 and out[0] == leaf
    out = rule((leaf, tall), group=H200.beside_min_group, elem_bytes=4)  # fp32: seven stages would not fit
    assert out[1] == dataclasses.replace(tall, programs=4) and tile(out[0]) == TILE_BESIDE
    tma = Launch(128, 128, 4, 6, 8, 3, contig=True, tma=True)
    out = rule((leaf, tma), group=H200.beside_min_group, elem_bytes=2)
    assert out == (leaf, dataclasses.replace(tma, programs=2))
    # no persistent launch, no change beside
    assert rule((leaf, tall), group=H200.beside_min_group, elem_bytes=2, num_sms=64) == (leaf, tall)  # 16 programs


def gapped_tree() -> DecodingTree:
    """A root of 40 tokens, two nodes of 60 under it and eight leaves of 100 under each; every
    leaf's slots are followed by 8 free ones."""
    parents = [-1, 0, 0] + [1] * 8 + [2] * 8
    lengths = [40, 60, 60] + [100] * 16
    starts = np.cumsum([0] + [n + 8 * (i >= 3) for i, n in enumerate(lengths)])
    kv = np.concatenate([s + np.arange(n) for s, n in zip(starts, lengths)])
    return DecodingTree.from_parents(parents, lengths, query_nodes=list(range(3, 19)), kv_indices=kv,
                                     page_size=1, num_slots=int(starts[-1]) + 64)


@pytest.mark.slow
@pytest.mark.parametrize("follow", [True, False])
def test_plan_beside_a_persistent_launch_matches_reference_and_updates(rng, device, follow):
    """A plan with a persistent 64-row launch at its persistent tile and 16-row leaves beside it at
    TILE_BESIDE gives the reference output; its lazy update after a step keeps both tiles where a
    fresh plan of the grown tree has them (new slots that follow the leaves' keep them contig)."""
    tree = gapped_tree()
    cost = CostModel(tma=False, pdl=True, profile=dataclasses.replace(
        H200, num_sms=2, tall_first_s=0.0, persist_min_leaf_entries=0, persist_share_gathered=1.0))
    attn = TreeAttention(device=device, backend="triton", streams=0, cost=cost)
    plan = attn.plan(tree, num_qo_heads=16, num_kv_heads=2, head_dim=32, dtype=torch.float16, strategy="greedy")
    assert [(ln.block_m, tile(ln), ln.programs) for ln in plan.launches] == [
        (16, TILE_BESIDE, 0), (64, TILE_TALL_GATHERED, 2)]
    last = tree.kv_indices[tree.kv_indptr[tree.query_nodes + 1] - 1]
    new = last + 1 if follow else int(tree.kv_indices.max()) + 1 + rng.permutation(tree.num_queries)
    counts = np.zeros(tree.num_nodes, dtype=np.int64)
    counts[tree.query_nodes] = 1
    grown = tree.append(counts, new)
    updated = attn.update(plan, grown)
    fresh = attn.plan(grown, num_qo_heads=16, num_kv_heads=2, head_dim=32, dtype=torch.float16, strategy="greedy")
    assert updated is not None and updated.launches == fresh.launches
    assert updated.launches[0].contig == follow and (tile(updated.launches[0]) == TILE_BESIDE) == follow
    num_slots = int(grown.kv_indices.max()) + 1
    q = torch.randn(tree.num_queries, 16, 32, dtype=torch.float64)
    k = torch.randn(num_slots, 1, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    args = [t.half().to(device) for t in (q, k, v)]
    for t, p in ((tree, plan), (grown, updated)):
        ref = reference_attention(q, k, v, t)[0]
        assert rel_l2(attn.run(*args, p), ref) <= TOL[torch.float16]


def test_lazy_update_keeps_a_persistent_tma_launch():
    """A TMA tall launch over part of the SMs stays so through a lazy update that re-checks every
    launch's runs (new slots that follow the leaves'), as in a fresh plan of the grown tree."""
    n, lengths = 16, [40, 1024, 1024] + [200] * 32
    parents = [-1, 0, 0] + [1] * n + [2] * n
    starts = np.cumsum([0] + [length + 8 * (i >= 3) for i, length in enumerate(lengths)])
    kv = np.concatenate([s + np.arange(length) for s, length in zip(starts, lengths)])
    tree = DecodingTree.from_parents(parents, lengths, query_nodes=list(range(3, 35)), kv_indices=kv,
                                     page_size=1, num_slots=int(starts[-1]) + 64)
    attn = TreeAttention(streams=0, cost=CostModel(tma=True, pdl=True, profile=dataclasses.replace(
        H200, num_sms=4, tall_first_s=0.0, persist_min_leaf_entries=0)))
    kw = dict(num_qo_heads=16, num_kv_heads=2, head_dim=128, dtype=torch.float16, strategy="node")
    plan = attn.plan(tree, **kw)
    assert [(ln.tma, ln.programs) for ln in plan.launches if ln.block_m == 128 and ln.tma] == [(True, 2)]
    counts = np.zeros(tree.num_nodes, dtype=np.int64)
    counts[tree.query_nodes] = 1
    grown = tree.append(counts, tree.kv_indices[tree.kv_indptr[tree.query_nodes + 1] - 1] + 1)
    updated = attn.update(plan, grown)
    assert updated.launches == attn.plan(grown, **kw).launches


def test_plans_run_their_tall_launch_persistent_only_with_pdl():
    """The builder applies the rule to tall-first plans run with PDL, and their last launch then
    does not fold (its programs would wait for the tall launch)."""
    tree = tree_from_spec("1,8,512_512,512,256")
    heads = HeadConfig(64, 8, 128, torch.float16)
    plan = make_plan(tree, heads, strategy="greedy", cost=CostModel(tma=True, pdl=True))
    assert plan.tall_first and [ln.programs for ln in plan.launches] == [0, 86]
    assert plan.merge_launch == -1 and "persistent programs" in plan.explain()
    side = make_plan(tree, heads, strategy="greedy", cost=CostModel(tma=True))
    assert not any(ln.programs for ln in side.launches)


@pytest.mark.parametrize("spec, strategy", [("1,8,512_512,512,256", "greedy"), ("1,8,512_32,2048,256", "node")])
def test_lazy_update_keeps_the_persistent_launch(rng, spec, strategy):
    """The lazy update of a plan with a persistent tall launch, gathered or TMA, keeps it
    persistent (grown leaves only add to the leaf launch), as a fresh plan of the grown tree
    would, and still does not fold."""
    from treeattn.plan.lower.update import update_plan

    tree = tree_from_spec(spec)
    heads = HeadConfig(64, 8, 128, torch.float16)
    cost = CostModel(tma=True, pdl=True)
    plan = make_plan(tree, heads, strategy=strategy, cost=cost)
    assert any(ln.programs for ln in plan.launches)
    counts = np.zeros(tree.num_nodes, dtype=np.int64)
    counts[tree.query_nodes] = 1
    grown = tree.append(counts, int(tree.kv_indices.max()) + 1 + rng.permutation(tree.num_queries))
    updated = update_plan(plan, grown)
    fresh = make_plan(grown, heads, strategy=strategy, cost=cost)
    assert updated is not None and updated.merge_launch == fresh.merge_launch == -1
    assert [ln.programs for ln in updated.launches] == [ln.programs for ln in fresh.launches] == \
        [ln.programs for ln in plan.launches]
    assert updated.launches == fresh.launches
