"""The cost model ``auto`` uses: its estimate is positive and grows with the work, its launch
features are what the plan builder launches, and ``auto`` avoids clearly slower strategies."""
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from helpers import random_tree

from treeattn import TreeAttention
from treeattn.plan import PLANNERS, CostModel, HeadConfig, build_plan, make_plan
from treeattn.plan.select.profiles import H200
from treeattn.plan.select.auto import plan_auto
from treeattn.plan.select.estimate import estimate_items
from treeattn.plan.select.launches import launch_features
from treeattn.tree import tree_from_medusa, tree_from_spec

H200_HEADS = HeadConfig(32, 8, 128, torch.float16)


def est(lengths, queries, heads=H200_HEADS, **kw):
    return CostModel().estimate(np.asarray(lengths), np.asarray(queries), heads, **kw)


def test_estimate_positive_and_finite():
    for lengths, queries in [([], []), ([1], [1]), ([0, 5], [3, 0]), ([4096] * 300, [1] * 300)]:
        t = est(lengths, queries)
        assert np.isfinite(t) and t > 0


def test_estimate_grows_with_bytes():
    base = est([512] * 64, [4] * 64)
    assert est([1024] * 64, [4] * 64) > base  # longer items
    assert est([512] * 128, [4] * 128) > base  # more items
    assert est([512] * 64, [4] * 64, heads=HeadConfig(32, 32, 128)) > base  # more KV heads
    assert est([512] * 64, [4] * 64, heads=HeadConfig(32, 8, 256)) > base  # wider heads
    assert est([512] * 64, [4] * 64, heads=HeadConfig(32, 8, 128, torch.float32)) > base
    assert est([512] * 64, [64] * 64, masked=True) > est([512] * 64, [64] * 64)  # (off the HBM floor)
    assert est([512] * 64, [4] * 64, merge_rows_max=64) > base
    assert est([512] * 64, [4] * 64, kv_tokens=10**8) > base  # HBM-bound floor
    lengths = np.array([64, 256, 1024, 4096, 16384, 65536])
    ts = [est([n], [1]) for n in lengths]
    assert all(a < b for a, b in itertools.pairwise(ts))


def test_long_lone_item_is_latency_bound():
    cm = CostModel()
    t = cm.breakdown(np.array([4096]), np.array([1]), HeadConfig(8, 1, 128))
    assert t["attention"] >= 4096 * 512 / cm.profile.program_bandwidth
    # the same tokens cut into 64 items (one program each) run side by side
    split = cm.breakdown(np.full(64, 64), np.ones(64, np.int64), HeadConfig(8, 1, 128))
    assert split["attention"] < t["attention"] / 4


TREES = {
    "suite": lambda: tree_from_spec("1,4,8,256_8,256,256,32"),
    "forest": lambda: tree_from_spec("2,8,16,256_256,256,32,32"),
    "short_leaves": lambda: tree_from_spec("1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16"),
    "long": lambda: tree_from_spec("1,10_4000,400"),
    "medusa": lambda: tree_from_medusa(64, context_len=300),
    "random": lambda: random_tree(np.random.default_rng(7), 60, 200),
    "random_inner_queries": lambda: random_tree(np.random.default_rng(3), 40, 300, roots=2, inner_queries=True),
}


@pytest.mark.parametrize("heads", [HeadConfig(32, 32, 128), H200_HEADS, HeadConfig(64, 8, 128),
                                   HeadConfig(12, 2, 256)], ids=str)
@pytest.mark.parametrize("name", list(TREES))
def test_launch_features_match_build_plan(name, heads):
    tree = TREES[name]()
    cm = CostModel()
    for strategy, planner in PLANNERS.items():
        items, _ = planner(tree, heads, cm)
        plan = build_plan(tree, items, heads, strategy=strategy)
        # the mask test of plan_auto (no pair visibility) agrees with the builder's
        e = estimate_items(tree, items, heads, cm)
        assert e["masked"] == plan.has_mask, strategy
        used = (items.item_len > 0) & (items.item_queries > 0)
        if plan.num_rows != int(items.item_queries[used].sum()):
            # the builder dropped queries that see nothing of a split chunk (queries inside a
            # node); the estimate, which does not compute visibility, keeps them
            continue
        f = launch_features(items.item_len, items.item_queries, heads, profile=cm.profile)
        got = sorted((int(a), int(b), int(p)) for a, b, p in f[:, :3])
        # (the builder's launches before addressing: a tall contig launch may take another KV tile)
        want = sorted((ln.block_m, ln.block_n, (ln.work_end - ln.work_start) * heads.num_kv_heads)
                      for ln in plan.host.gather_launches)
        assert got == want, strategy
        assert e["launches"] == len(plan.launches)
        assert e["tall_first"] == plan.tall_first, strategy  # the launch order the model rated


def test_tall_first_when_a_program_is_long():
    """A long program of a tall launch (a shared prefix read by many queries) starts first; short
    programs keep the builder's order (measured faster that way on an H200)."""
    heads = HeadConfig(64, 8, 128)
    cm = CostModel()
    long_root = make_plan(tree_from_spec("1,2,64_1024,256,256"), heads, strategy="node", cost=cm)
    assert long_root.tall_first and len(long_root.launches) > 1
    assert "(tallest first)" in long_root.explain()
    short = make_plan(tree_from_spec("1,256_256,32"), heads, strategy="pack", cost=cm)
    assert not short.tall_first and len(short.launches) > 1
    one_launch = make_plan(tree_from_spec("1,10_4000,400"), heads, strategy="sequence", cost=cm)
    assert len(one_launch.launches) == 1 and not one_launch.tall_first
    never = make_plan(tree_from_spec("1,2,64_1024,256,256"), heads, strategy="node",
                      cost=CostModel(profile=dataclasses.replace(H200, tall_first_s=float("inf"))))
    assert not never.tall_first and never.launches == long_root.launches
    # launches that run one after another (no side streams: the engine) keep their order, and
    # the model rates them one after another
    serial = CostModel(side_streams=False)
    assert not make_plan(tree_from_spec("1,2,64_1024,256,256"), heads, strategy="node", cost=serial).tall_first
    tree = tree_from_spec("1,2,64_1024,256,256")
    items, _ = PLANNERS["node"](tree, heads, cm)
    together, apart = estimate_items(tree, items, heads, cm), estimate_items(tree, items, heads, serial)
    assert together["tall_first"] and not apart["tall_first"] and apart["total"] > together["total"]
    assert not TreeAttention(streams=0).cost.side_streams and TreeAttention().cost.side_streams


def test_auto_avoids_clearly_slower_strategies():
    # measured on an H200 (every strategy on the kernel suite): one 4000-token root read by 10 queries is
    # latency-bound as one program per KV head (node: 144 us) and ~2.7x faster when split
    tree = tree_from_spec("1,10_4000,400")
    heads = HeadConfig(32, 32, 128)
    name, *_ = plan_auto(tree, heads, CostModel(), PLANNERS)
    assert name != "node"
    items = {s: p(tree, heads, CostModel())[0] for s, p in PLANNERS.items()}
    t = {s: estimate_items(tree, it, heads, CostModel())["total"] for s, it in items.items()}
    assert t["node"] > 2 * t[name]
    # 1024 queries sharing a 2048-token prefix: sequence re-reads it per query (15x slower)
    tree = tree_from_spec("1,1024_2048,32")
    name, *_ = plan_auto(tree, HeadConfig(32, 32, 128), CostModel(), PLANNERS)
    assert name in ("node", "greedy")
    # deep tree with short leaves and 32/8 heads: greedy measured 1.46x faster than flatten, and
    # paths' 64-row tiles 1.19x faster than greedy (H200)
    tree = tree_from_spec("1,8,16,32,64,128,1024_256,128,64,32,32,32,32")
    name, _, reason, _ = plan_auto(tree, H200_HEADS, CostModel(), PLANNERS)
    assert name == "paths" and "tiles of 64 rows" in reason


def test_auto_prefers_fewer_kernels_among_close_estimates():
    """Within ``choice_margin`` of the best estimate, auto takes the plan with the fewest kernels
    (launches plus the merge; launches that run side by side, tallest first, count as one); with
    no margin, the best estimate."""
    for tree, side_streams in ((tree_from_spec("1,16,64_1024,256,32"), False),
                               (tree_from_spec("4,16,256,512_512,32,128,32"), True)):
        cm = CostModel(side_streams=side_streams)
        est = {s: estimate_items(tree, p(tree, H200_HEADS, cm)[0], H200_HEADS, cm) for s, p in PLANNERS.items()}
        kernels = {s: (1 if e["tall_first"] else e["launches"]) + (e["merge"] > 0) for s, e in est.items()}
        exact, *_ = plan_auto(tree, H200_HEADS, CostModel(choice_margin=0.0, side_streams=side_streams), PLANNERS)
        assert est[exact]["total"] == min(e["total"] for e in est.values())
        loose, _, why, _ = plan_auto(tree, H200_HEADS, CostModel(choice_margin=100.0, side_streams=side_streams),
                                     PLANNERS)
        assert kernels[loose] == min(kernels.values())
        assert loose == exact or "fewest kernels within" in why
    assert any(e["tall_first"] and e["launches"] > 1 for e in est.values())  # (the second tree)


def test_auto_rates_the_unsplit_sequence_plan_of_short_paths():
    """``auto`` rates each query's whole path as one item (one launch, no merge) when paths are at
    most 2 x min_split_tokens: on 1,2,64_8,256,32 at 32/8 (296-token paths) it was measured on an
    H200 at 21.2 against 26.1 us for the split plans' best (``paths``
    now takes 20.7 us), and the plan writes every output directly. ``sequence`` itself keeps
    Flash-Decoding's split."""
    from treeattn.plan.strategies.sequence import sequence_variants

    tree = tree_from_spec("1,2,64_8,256,32")
    cost = CostModel()
    (split, _), (whole, note) = sequence_variants(tree, H200_HEADS, cost)
    assert whole.num_items == tree.num_queries and "no KV split" in note
    assert split.num_items > tree.num_queries
    est_split, est_whole = (estimate_items(tree, it, H200_HEADS, cost)["total"] for it in (split, whole))
    assert est_whole < est_split
    assert dict(plan_auto(tree, H200_HEADS, cost, PLANNERS)[3])["sequence"] == est_whole
    plan = build_plan(tree, whole, H200_HEADS, strategy="sequence", cost=cost)
    assert plan.num_direct == tree.num_queries and plan.merge_q_indices.numel() == 0
    assert make_plan(tree, H200_HEADS, strategy="sequence").num_rows == split.item_queries.sum()
    # paths longer than 2 x min_split_tokens keep the split only (slow lone programs)
    assert len(sequence_variants(tree_from_medusa(32, context_len=1000), H200_HEADS, cost)) == 1
    assert len(sequence_variants(tree, H200_HEADS, CostModel(min_split_tokens=128))) == 1


@pytest.mark.parametrize("pdl", [False, True])
def test_direct_saving_applies_to_direct_plans_only(pdl):
    """Plans without a merge launch are credited ``direct_saving_s``, with PDL
    ``direct_saving_pdl_s`` (the merge launch overlaps the attention launches there)."""
    tree = tree_from_spec("1,2,64_8,256,32")
    items = {s: p(tree, H200_HEADS, CostModel())[0] for s, p in PLANNERS.items()}
    whole = PLANNERS["sequence"].variants(tree, H200_HEADS, CostModel())[1][0]
    field = "direct_saving_pdl_s" if pdl else "direct_saving_s"
    saving = getattr(H200, field)
    assert 0 < saving < H200.fixed_overhead_s  # estimates stay positive
    for it in [*items.values(), whole]:
        a, b = (estimate_items(tree, it, H200_HEADS, CostModel(pdl=pdl, profile=dataclasses.replace(H200, **{field: x}))) for x in (0.0, saving))
        assert b["total"] == pytest.approx(a["total"] - saving * (a["merge"] == 0), rel=1e-12)
    assert estimate_items(tree, whole, H200_HEADS, CostModel())["merge"] == 0


@pytest.mark.parametrize("spec,fastest", [("1,4,256_8,256,32", "greedy"), ("1,256_256,32", "node"),
                                          ("1,4,256_32,256,32", "greedy")])
def test_pdl_plans_take_two_launches_over_a_slower_direct_plan(spec, fastest):
    """With PDL (the H200's launch mode) these 32/8 trees' two-launch plans ran 1.19-1.25x faster
    than the merge-free ``paths`` plan, each timed both ways in one process:
    ``auto`` picks them with ``direct_saving_pdl_s``, and picked ``paths`` with 6 us."""
    cost = CostModel(tma=True, pdl=True, side_streams=True)
    tree = tree_from_spec(spec)
    assert make_plan(tree, H200_HEADS, strategy="auto", cost=cost).strategy == fastest
    old = dataclasses.replace(cost, profile=dataclasses.replace(H200, direct_saving_pdl_s=6e-6))
    assert make_plan(tree, H200_HEADS, strategy="auto", cost=old).strategy == "paths"


def test_explain_mentions_choice_and_estimates():
    plan = make_plan(tree_from_spec("1,16,64_1024,256,32"), H200_HEADS, strategy="auto")
    text = plan.explain()
    assert f"auto chose {plan.strategy} (attention" in text
    assert "launch(es) + merge" in text and "cost model estimates:" in text
    for s in PLANNERS:
        assert f"{s} " in text.split("cost model estimates:")[1]


def test_pdl_rates_few_queries_merges_at_the_tile_step():
    """With PDL, a merge of few queries (the row-tile kernel) costs its own critical path:
    ``merge_tile_step_s`` a row on the longest query; many queries' merges (the row loop) and
    plans without PDL keep ``merge_step_s``."""
    heads = HeadConfig(32, 8, 128, torch.float16)
    length, nq = np.full(14, 200), np.full(14, 10)  # 14 chunks, each read by the same 10 queries
    merge = {pdl: CostModel(pdl=pdl).breakdown(length, nq, heads, merge_rows_max=14, num_queries=10)["merge"]
             for pdl in (False, True)}
    assert merge[False] == pytest.approx(14 * H200.merge_step_s)
    assert merge[True] == pytest.approx(14 * H200.merge_tile_step_s)
    many = np.full(14, 1024)  # 1024 queries: the row loop, whatever pdl says
    assert (CostModel(pdl=True).breakdown(length, many, heads, merge_rows_max=14, num_queries=1024)["merge"]
            == CostModel(pdl=False).breakdown(length, many, heads, merge_rows_max=14, num_queries=1024)["merge"])
