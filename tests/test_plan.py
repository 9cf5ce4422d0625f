"""Planner invariants: every plan covers each query's visible tokens exactly once, KV IO matches
each strategy's promise, plans are deterministic and leave their inputs alone."""
import dataclasses

import numpy as np
import pytest
import torch
from helpers import expected_coverage, forests, planned_coverage, random_tree
from hypothesis import given

from treeattn import STRATEGIES, DecodingTree, HeadConfig, make_plan
from treeattn.plan import CostModel
from treeattn.plan.lower.build import _pair_visibility
from treeattn.plan.select.profiles import H200
from treeattn.plan.strategies.greedy import _assign_edges, _padding, plan_greedy
from treeattn.plan.lower.merge_config import MERGE_LAST_MAX_ROWS, launch_merges
from treeattn.plan.strategies.node import node_items
from treeattn.plan.strategies.split import split_long_items
from treeattn.reference import visibility_mask
from treeattn.tree import suite_trees, tree_from_medusa, tree_from_spec

HEADS = HeadConfig(8, 2, 64, torch.float16)
KV_ONCE = ("node", "node_chunk", "flatten")


def kv_bytes(tokens: int, heads: HeadConfig = HEADS) -> int:
    return tokens * heads.num_kv_heads * heads.head_dim * 2 * heads.elem_bytes


#: plans whose last launch may merge whatever their GQA group (the default takes groups of 8 on)
FOLD_ANY = CostModel(profile=dataclasses.replace(H200, merge_last_min_group=1))


def check_plan(tree: DecodingTree, strategy: str, heads: HeadConfig = HEADS):
    plan = make_plan(tree, heads, strategy=strategy, cost=FOLD_ANY)
    got_q, got_t = planned_coverage(tree, plan)
    exp_q, exp_t = expected_coverage(tree)
    assert np.array_equal(got_q, exp_q) and np.array_equal(got_t, exp_t), \
        f"{strategy}: planned tokens differ from each query's visible tokens (or repeat)"
    seen_by_someone = int(visibility_mask(tree).any(0).sum())
    if plan.strategy in KV_ONCE:
        assert plan.io.kv == kv_bytes(seen_by_someone, heads)
    elif plan.strategy == "sequence":
        assert plan.io.kv == kv_bytes(int(tree.visible_tokens.sum()), heads)
    else:  # pack / greedy may re-read a short prefix to save partial results
        assert kv_bytes(seen_by_someone, heads) <= plan.io.kv <= kv_bytes(int(tree.visible_tokens.sum()), heads)
    merge_counts = np.diff(plan.merge_indptr.numpy())
    assert merge_counts.min() >= 1 and merge_counts.sum() == plan.num_rows
    # a query's only row is written by the attention kernel, the others are merged
    direct = merge_counts == 1
    assert np.array_equal(plan.row_direct.numpy(), direct[plan.row_q_indices.numpy()])
    assert np.array_equal(plan.merge_q_indices.numpy(), np.flatnonzero(~direct))
    assert plan.num_direct == int(direct.sum())
    assert plan.work_kv_start.dtype == torch.int32
    bounds = [(l.work_start, l.work_end) for l in plan.launches]
    assert bounds[0][0] == 0 and bounds[-1][1] == plan.num_work
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), "launches must tile the work units"
    # merge_last: the launch that runs last holds one row of every merged query (of few rows)
    last = plan.launches[0] if plan.tall_first else plan.launches[-1]
    rows = plan.work_row_indptr.numpy()[[last.work_start, last.work_end]]
    in_last = np.bincount(plan.row_q_indices.numpy()[rows[0]:rows[1]], minlength=tree.num_queries)
    assert plan.merge_last == bool(len(plan.launches) > 1 and (~direct).any() and launch_merges(last.block_m, last.tma)
                                   and merge_counts.max() <= MERGE_LAST_MAX_ROWS and (in_last[~direct] == 1).all())
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@given(tree=forests(max_nodes=300, max_len=300))
def test_random_forests(strategy, tree):
    check_plan(tree, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("spec", suite_trees("all"))
def test_scaled_kernel_suite(strategy, spec):
    check_plan(tree_from_spec(spec, scale=1 / 16), strategy, HeadConfig(32, 8, 128))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", ["one_node", "one_token", "chain", "star", "forest_of_singletons",
                                  "zero_length_inner", "medusa64", "medusa256_flat"])
def test_degenerate_and_speculative_trees(strategy, case):
    tree = {
        "one_node": lambda: DecodingTree.from_parents([-1], [37]),
        "one_token": lambda: DecodingTree.from_parents([-1], [1]),
        "chain": lambda: DecodingTree.from_parents([-1] + list(range(299)), [3] * 300),
        "star": lambda: DecodingTree.from_parents([-1] + [0] * 200, [50] + [1] * 200),
        "forest_of_singletons": lambda: DecodingTree.from_parents([-1] * 40, list(range(1, 41))),
        "zero_length_inner": lambda: DecodingTree.from_parents([-1, 0, 1, 1, 0], [5, 0, 3, 0, 0],
                                                               query_nodes=[2, 3, 4, 1]),
        "medusa64": lambda: tree_from_medusa(64, context_len=300),
        "medusa256_flat": lambda: tree_from_medusa(256, context_len=70, compress=False),
    }[case]()
    check_plan(tree, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plans_are_deterministic_and_pure(rng, strategy):
    tree = random_tree(rng, 80, 60, roots=2, inner_queries=True)
    before = {k: getattr(tree, k).copy() for k in ("parents", "lengths", "kv_indices", "query_nodes")}
    a = make_plan(tree, HEADS, strategy=strategy)
    b = make_plan(tree, HEADS, strategy=strategy)
    for name in ("kv_indices", "work_kv_start", "work_kv_end", "work_row_indptr", "row_q_indices",
                 "merge_indptr", "merge_indices", "row_direct", "merge_q_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for k, v in before.items():
        assert np.array_equal(getattr(tree, k), v), f"planner mutated tree.{k}"


def test_shared_prefix_is_read_once_vs_per_query():
    tree = tree_from_spec("1,64_1000,10")
    seq = make_plan(tree, HEADS, strategy="sequence")
    for s in KV_ONCE + ("pack", "greedy"):
        plan = make_plan(tree, HEADS, strategy=s)
        assert plan.io.kv == kv_bytes(1000 + 640), s
    assert seq.io.kv == kv_bytes(64 * 1010)


def test_split_long_items_keeps_tokens_and_queries():
    tree = tree_from_spec("1,3_700,50")
    items = node_items(tree)
    split = split_long_items(items, 128)
    assert split.item_len.max() <= 128
    assert split.item_len.sum() == items.item_len.sum()
    assert sorted(split.q_indices[split.q_indptr[0]:split.q_indptr[1]].tolist()) == [0, 1, 2]


def test_auto_explains_its_choice():
    tree = tree_from_spec("1,16,64_1024,256,32")
    plan = make_plan(tree, HEADS, strategy="auto")
    text = plan.explain()
    assert plan.strategy in STRATEGIES[1:]
    assert f"auto chose {plan.strategy}" in text and "estimates" in text
    for s in STRATEGIES[1:]:
        assert s in text
    # one entry a launch: programs (query tiles x KV heads), tile, warps, stages, addressing
    listed = text.split("launches: ")[1].split("\n")[0].split("; ")
    assert len(listed) == len(plan.launches)
    for ln, entry in zip(plan.launches, listed):
        programs = (ln.work_end - ln.work_start) * HEADS.num_kv_heads
        assert entry.startswith(f"{programs} programs of {ln.block_m}-row x {ln.block_n}-token tiles, "
                                f"{ln.num_warps} warps, {ln.num_stages} stages")


def test_pack_merges_short_prefixes_and_splits_long_ones():
    long_prefix = tree_from_spec("1,4_4096,16")  # 4 * 4 < 4096: keep the root on its own
    plan = make_plan(long_prefix, HeadConfig(4, 4, 64), strategy="pack")
    assert plan.io.kv == kv_bytes(4096 + 64, HeadConfig(4, 4, 64))
    # each level-1 child holds 4 queries: 4 * 4 >= 8, so the 8-token root is merged into each
    # of them (read 4 times); level-2 leaves (1 query each) stay on their own
    short_prefix = tree_from_spec("1,4,16_8,512,1")
    plan = make_plan(short_prefix, HeadConfig(4, 4, 64), strategy="pack")
    assert plan.io.kv == kv_bytes(4 * (8 + 512) + 16, HeadConfig(4, 4, 64))
    assert "4 of 20 edges merged" in plan.reason


def test_bad_arguments():
    tree = tree_from_spec("1,2_8,4")
    with pytest.raises(ValueError, match="unknown strategy"):
        make_plan(tree, HEADS, strategy="bogus")
    with pytest.raises(TypeError, match="DecodingTree"):
        make_plan("1,2_8,4", HEADS)
    with pytest.raises(ValueError, match="multiple of"):
        HeadConfig(6, 4, 64)
    with pytest.raises(ValueError, match="head_dim"):
        HeadConfig(4, 4, 0)


def test_cost_model_prefers_sharing_for_wide_trees():
    tree = tree_from_spec("1,256_2048,32")
    cost = CostModel()
    plan = make_plan(tree, HeadConfig(32, 8, 128), strategy="auto", cost=cost)
    assert plan.strategy != "sequence"


def sequential_edge_assignment(tree: DecodingTree, rows: np.ndarray, cost: CostModel) -> np.ndarray:
    """FastTree's Alg. 1 as written: nodes breadth-first, each parent's children in id order."""
    a, b, g = cost.fasttree_alpha, cost.fasttree_beta, cost.fasttree_gamma
    tq, tc = cost.fasttree_tile_q, cost.fasttree_tile_kv
    topo, length = tree.topology, tree.lengths.tolist()
    glued = np.zeros(tree.num_nodes, dtype=bool)

    def pad(n, tile):
        return tile - ((n - 1) % tile + 1)

    for v in np.argsort(topo.depth, kind="stable").tolist():
        nq_cur, len_v = int(rows[v]), length[v]
        for c in topo.child_indices[topo.child_indptr[v]:topo.child_indptr[v + 1]].tolist():
            nq_l, len_l = int(rows[c]), length[c]
            split_kv = (a * pad(nq_cur, tq) * len_v + b * nq_cur * pad(min(len_v, tc), tc)
                        + a * pad(nq_l, tq) * len_l + b * nq_l * pad(min(len_l, tc), tc) + g * nq_l)
            split_q = (a * pad(nq_cur - nq_l, tq) * len_v + b * (nq_cur - nq_l) * pad(min(len_v, tc), tc)
                       + a * pad(nq_l, tq) * (len_v + len_l) + b * nq_l * pad(min(len_v + len_l, tc), tc))
            if split_kv > split_q:
                glued[c], nq_cur, length[c] = True, nq_cur - nq_l, len_v + len_l
    return glued


@pytest.mark.parametrize("cost", [CostModel(), CostModel(fasttree_alpha=0.3, fasttree_beta=2.5,
                                                         fasttree_gamma=0.7, fasttree_tile_q=8),
                                  CostModel(fasttree_alpha=2, fasttree_beta=3, fasttree_gamma=5, fasttree_tile_q=12,
                                            fasttree_tile_kv=48)])
@given(tree=forests(max_nodes=200, max_len=100))
def test_greedy_fixed_point_is_the_sequential_algorithm(cost, tree):
    for group in (1, 4):
        rows = tree.subtree_queries * group
        assert np.array_equal(_assign_edges(tree, rows, cost), sequential_edge_assignment(tree, rows, cost))


def test_greedy_on_chains_and_wide_trees(rng):
    for parents in (np.arange(-1, 199), np.r_[-1, np.zeros(300, np.int64)],
                    np.r_[-1, np.arange(150), np.repeat(np.arange(0, 150, 3), 2)]):
        tree = DecodingTree.from_parents(parents, rng.integers(1, 80, parents.size))
        rows = tree.subtree_queries * 4
        assert np.array_equal(_assign_edges(tree, rows, CostModel()),
                              sequential_edge_assignment(tree, rows, CostModel()))


def test_padding_is_fasttrees_formula():
    n = np.arange(-40, 200)
    for tile in (1, 3, 16, 64):
        assert _padding(n, tile).tolist() == [tile - ((int(x) - 1) % tile + 1) for x in n]


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_planner_visible_tokens_match_the_tree(rng, strategy):
    """Tokens per (item, query) that planners hand the builder equal what the tree says."""
    from treeattn.plan import PLANNERS
    trees = [tree_from_spec("1,4,16_300,40,3"), tree_from_medusa(32, context_len=50),
             *(random_tree(rng, 80, 40, roots=2, inner_queries=bool(k % 2)) for k in range(6))]
    for tree in trees:
        items, _ = PLANNERS[strategy](tree, HEADS, CostModel(min_split_tokens=16, deft_chunk_tokens=24))
        if items.q_tokens is not None:
            q_item = np.repeat(np.arange(items.num_items), items.item_queries)
            assert np.array_equal(items.q_tokens, _pair_visibility(tree, items, q_item))


def test_greedy_balance_split_follows_the_work():
    """A Medusa tree over a long context: 2 tall tiles per KV head hold almost all the work, so
    greedy cuts the context to about work / balance_slots tokens; a 1024-query tree whose tall
    tiles already fill the GPU is left alone."""
    heads = HeadConfig(32, 8, 128, torch.float16)
    cost = CostModel(target_programs=1)
    tree = tree_from_medusa(64, context_len=3000)
    items, note = plan_greedy(tree, heads, cost)
    assert "fair share" in note
    tiles = -(-(items.item_queries * heads.group) // 128)
    work = int(tiles @ items.item_len) * heads.num_kv_heads
    assert items.item_len.max() <= max(cost.min_split_tokens, -(-work // cost.balance_slots)) + 16
    assert items.item_len.max() < 3000
    got_q, got_t = planned_coverage(tree, make_plan(tree, heads, strategy="greedy", cost=cost))
    exp_q, exp_t = expected_coverage(tree)
    assert np.array_equal(got_q, exp_q) and np.array_equal(got_t, exp_t)
    wide, note = plan_greedy(tree_from_spec("1,1024_2048,32"), heads, cost)
    assert "fair share" not in note and wide.item_len.max() == 2048


@pytest.mark.parametrize("strategy", ["node", "greedy", "pack"])
def test_only_launches_with_partly_seen_items_apply_the_mask(strategy):
    """Under a speculative token tree the long context is seen whole by every query: its launch
    skips the tree mask, the draft tokens' launch applies it, and the IO counts the mask's loads
    for masked launches only."""
    heads = HeadConfig(32, 8, 128, torch.float16)
    plan = make_plan(tree_from_medusa(32, context_len=300), heads, strategy=strategy)
    assert plan.has_mask and {ln.masked for ln in plan.launches} == {False, True}
    start, end, mask_start = plan.work_kv_start.numpy(), plan.work_kv_end.numpy(), plan.work_mask_start.numpy()
    tiles = sum(int((end[w] - (start[w] + (mask_start[w] - start[w]) // ln.block_n * ln.block_n)).sum())
                for ln in plan.launches if ln.masked for w in [slice(ln.work_start, ln.work_end)])
    assert 0 < plan.io.mask == tiles * 12 * heads.num_kv_heads
    # a plan without a mask keeps every launch masked: a mask added later applies everywhere
    assert all(ln.masked for ln in make_plan(tree_from_spec("1,4_30,5"), heads, strategy=strategy).launches)


@pytest.mark.parametrize("k", [2, 3, 4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_packed_leaf_items_cover_every_visible_token_once(rng, k, group):
    """Packing leaf items keeps every (query, visible token) pair planned exactly once (the tree
    mask keeps each query to its own leaf); the packed items are flagged masked, as are their
    launches, and the other items' launches are not."""
    from treeattn.plan.lower.build import build_plan
    from treeattn.plan.strategies.items import WorkItems
    from treeattn.plan.strategies.leaf_packing import pack_leaf_items

    tree = tree_from_spec("1,3,24_37,5,3")
    heads = HeadConfig(8 * group, 8, 16, torch.float32)
    base = node_items(tree)
    base = WorkItems(base.seg_indptr, base.seg_node, base.seg_lo, base.seg_hi, base.q_indptr, base.q_indices,
                     base.q_tokens, np.zeros(base.num_items, dtype=bool))
    packed = pack_leaf_items(base, tree, k, group=group)
    if k * group > 16:
        assert packed is base  # a leaf's rows would not fit one query tile k times
        return
    assert packed.num_items == 4 + -(-24 // k) and int(packed.masked.sum()) == -(-24 // k) - (24 % k == 1)
    plan = build_plan(tree, packed, heads, strategy="node")
    got_q, got_t = planned_coverage(tree, plan)
    exp_q, exp_t = expected_coverage(tree)
    assert np.array_equal(got_q, exp_q) and np.array_equal(got_t, exp_t)
    assert plan.has_mask and {ln.masked for ln in plan.launches} == {False, True}


def test_greedy_packs_the_leaves_of_wide_trees():
    """On a 1024-leaf tree at 32/32 heads the cost model packs the 16-token leaves (measured 1.3-1.5x
    faster on an H200); small trees are left alone."""
    wide = tree_from_spec("1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16")
    plan = make_plan(wide, HeadConfig(32, 32, 128, torch.float16), strategy="greedy")
    assert "leaf items packed" in plan.reason and plan.has_mask
    assert plan.num_items < 1024
    small = make_plan(tree_from_spec("1,4,16_40,9,5"), HeadConfig(32, 32, 128, torch.float16), strategy="node")
    assert "packed" not in small.reason


def test_leaf_packing_can_be_turned_off():
    wide = tree_from_spec("1,2,4,8,16,32,64,128,1024_16,16,16,16,16,16,16,16,16")
    heads = HeadConfig(32, 32, 128, torch.float16)
    plan = make_plan(wide, heads, strategy="node", cost=CostModel(leaf_packing=False))
    assert "packed" not in plan.reason and plan.num_items == wide.num_nodes


PRECOMPILE_HEADS = [HeadConfig(32, 8, 128, torch.float16), HeadConfig(64, 8, 128, torch.bfloat16),
                    HeadConfig(32, 32, 128, torch.float16), HeadConfig(8, 2, 64, torch.float32),
                    HeadConfig(16, 4, 256, torch.float16)]


def assert_precompiled(tree: DecodingTree, heads: HeadConfig, strategies) -> None:
    """Every launch of every strategy's plan of ``tree`` (TMA allowed or not), and of its lazy
    update after a decode step whose new slots follow no node's last slot (the grown units gather),
    and every merge config of them, is a variant that ``precompile`` compiles: a serving loop that
    precompiled never waits for Triton's JIT."""
    from treeattn.precompile import launch_configs, persists
    from treeattn.plan.lower.merge_config import merge_config, merge_launches
    from treeattn.plan.lower.update import update_plan

    hq, d = heads.num_qo_heads, heads.head_dim
    merges = {merge_config(n, hq, d, rows) for n, rows in merge_launches(hq, d)}

    counts = np.zeros(tree.num_nodes, dtype=np.int64)
    counts[tree.query_nodes[tree.query_prefix == tree.lengths[tree.query_nodes]]] = 1
    top = int(tree.kv_indices.max()) + 2 if tree.num_tokens else 0
    grown = tree.append(counts, top + 2 * np.arange(counts.sum()))
    for tma in (False, True):  # (a device with TMA, Hopper, runs the launches with PDL)
        cost = CostModel(tma=tma, pdl=tma)
        known = set(launch_configs(heads, profile=cost.profile, tma=tma, pdl=tma))
        for strategy in strategies:
            plan = make_plan(tree, heads, strategy=strategy, cost=cost)
            updated = update_plan(plan, grown)
            for p in (plan, updated) if updated is not None else (plan,):
                for ln in p.launches:
                    cfg = (ln.block_m, ln.block_n, ln.num_warps, ln.num_stages, ln.contig, ln.tma)
                    assert cfg in known, (strategy, heads, ln)
                    assert not ln.programs or persists(heads, cfg, profile=cost.profile, pdl=tma), (strategy, heads, ln)
                last = p.launches[0] if p.tall_first else p.launches[-1]
                assert not p.merge_last or launch_merges(last.block_m, last.tma), (strategy, heads, last)
                n = p.merge_q_indices.numel()
                assert not n or merge_config(n, hq, d, p.merge_rows_max) in merges, (strategy, heads, n)


@pytest.mark.slow
@pytest.mark.parametrize("heads", PRECOMPILE_HEADS, ids=str)
@given(tree=forests(max_nodes=300, max_len=300))
def test_precompile_covers_random_forests(heads, tree):
    assert_precompiled(tree, heads, STRATEGIES)


@pytest.mark.slow
@pytest.mark.parametrize("spec", suite_trees("all"))
def test_precompile_covers_the_kernel_suite(spec):
    """The suite's trees at full size (tall query tiles, long runs that take TMA)."""
    tree = tree_from_spec(spec)
    for heads in PRECOMPILE_HEADS[:3]:
        assert_precompiled(tree, heads, ("auto", "node", "greedy", "paths"))


@pytest.mark.parametrize("hq,hkv,min_group,folds", [(32, 8, 8, False), (64, 8, 8, True), (32, 32, 8, False),
                                                    (32, 8, 4, True), (32, 32, 1, True)])
def test_last_launch_merges_from_the_cost_models_gqa_group(hq, hkv, min_group, folds):
    """The last launch merges (``merge_last``) only in plans whose GQA group is at least
    the profile's ``merge_last_min_group`` (8 on the H200: the H200 timed the fold faster than the merge
    launch at 64/8 only); the rest of the plan is the same either way."""
    tree, heads = tree_from_spec("2,8_300,20"), HeadConfig(hq, hkv, 128, torch.float16)
    cost = CostModel(profile=dataclasses.replace(H200, merge_last_min_group=min_group))
    plan = make_plan(tree, heads, strategy="node", cost=cost)
    other = make_plan(tree, heads, strategy="node",
                      cost=CostModel(profile=dataclasses.replace(H200, merge_last_min_group=64 if folds else 1)))
    assert plan.merge_last == folds == cost.merges_last(heads)
    assert other.merge_last != folds
    assert plan.launches == other.launches and torch.equal(plan.merge_indices, other.merge_indices)
    if min_group == 8:
        assert make_plan(tree, heads, strategy="node").merge_last == folds  # the default
