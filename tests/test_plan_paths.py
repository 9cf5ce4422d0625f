"""``paths`` (plan/paths.py, plan/leads.py): query tiles reading the union of their queries' paths.
Every variant covers each query's visible tokens exactly once, the sizes the cost model reads
without making the segments equal the made ones, the mask lead is the builder's mask start, and the
kernels (the interpreter on CPU) match a float64 reference for whole, split and apart variants."""
import dataclasses
import re

import numpy as np
import pytest
import torch

from helpers import expected_coverage, paged_case, planned_coverage, random_tree, rel_l2, scratch_medusa
from treeattn import DecodingTree, TreeAttention
from treeattn.plan import CostModel, HeadConfig, build_plan
from treeattn.plan.lower.addressing import unit_runs
from treeattn.plan.select.estimate import estimate_items
from treeattn.plan.strategies.leads import cut_at_leads, on_runs, run_leads, run_tokens, trunk_tokens
from treeattn.plan.strategies.paths import (
    OWN_ITEM_TOKENS,
    _pair_path_tiles,
    _whole_path_tiles,
    deferred_path_tiles,
    path_tiles,
    paths_variants,
)
from treeattn.reference import reference_attention
from treeattn.tree import tree_from_medusa, tree_from_spec


def one_per_kind(variants) -> list:
    """``paths`` variants ``(items, note)``, one of each kind (the note without its numbers and tile
    rows), the tile sizes taken in turn: every kind and (where there are as many kinds) every tile
    size runs in the interpreter once, instead of every pair (minutes of CI)."""
    kinds: dict = {}
    for items, note in variants:
        rows = int(re.search(r"tiles of (\d+) rows", note).group(1))
        kind = re.sub(r"\d+", "#", re.sub(r"tiles of \d+ rows", "", note))
        kinds.setdefault(kind, {})[rows] = (items, note)
    picks = []
    for i, by_rows in enumerate(kinds.values()):
        sizes = sorted(by_rows)
        picks.append(by_rows[sizes[i % len(sizes)]])
    return picks

HEADS = (HeadConfig(8, 8, 64, torch.float16), HeadConfig(8, 2, 64, torch.float16), HeadConfig(16, 2, 64, torch.float16))


def trees(rng):
    return [tree_from_spec("1,2,4,8,32_40,16,8,8,4"), tree_from_spec("2,8,16_24,12,5"),
            tree_from_spec("1,4,16_300,9,70"), tree_from_medusa(32, context_len=45),
            random_tree(rng, 40, 30, roots=2), random_tree(rng, 30, 20, roots=1, inner_queries=True),
            scratch_medusa(64, 300, 512)]  # (trunk leads ending off their run of slots: run_leads)


def _apart(tree, heads, rows):
    return (tree.subtree_queries * heads.group < rows) & (tree.node_extent > OWN_ITEM_TOKENS)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h.num_qo_heads}/{h.num_kv_heads}")
def test_every_variant_covers_each_visible_token_once(rng, heads):
    for tree in trees(rng):
        want = expected_coverage(tree)
        for items, note in paths_variants(tree, heads, CostModel()):
            got = planned_coverage(tree, build_plan(tree, items, heads, strategy="paths"))
            assert all(np.array_equal(a, b) for a, b in zip(got, want)), note


@pytest.mark.parametrize("rows", [16, 32, 64, 128])
def test_deferred_sizes_equal_the_made_tiles(rng, rows):
    """What the cost model reads (lengths, queries, mask flags and leads, merge rows, per-query
    weights) is the same without the segments, and after cutting the tiles at their leads (or
    their runs of slots, :func:`run_leads`)."""
    heads = HeadConfig(16, 2, 64)
    for tree in trees(rng):
        for own in (None, _apart(tree, heads, rows)):
            made = path_tiles(tree, heads, rows, own)
            cut = cut_at_leads(made, run_leads(tree, made))[0]
            for fast, exact in ((deferred_path_tiles(tree, heads, rows, own), made), (cut, cut.made)):
                for field in ("item_len", "item_queries"):
                    assert np.array_equal(getattr(fast, field), getattr(exact, field)), field
                used = np.ones(fast.num_items, dtype=bool)
                assert fast.merge_rows_max(used) == exact.merge_rows_max(used)
                weights = np.arange(fast.num_items, dtype=np.float64)
                assert np.array_equal(fast.query_weights(weights), exact.query_weights(weights))
            fast = deferred_path_tiles(tree, heads, rows, own)
            assert np.array_equal(fast.masked, made.masked) and np.array_equal(fast.mask_lead, made.mask_lead)


@pytest.mark.parametrize("rows", [16, 32, 64, 128])
def test_tiles_from_node_ranges_equal_those_from_pairs(rng, rows):
    """Where every query sees its path whole, the tiles made from each node's range of queries are
    those made from the (query, node) pairs, field for field."""
    heads = HeadConfig(16, 2, 64)
    cases = trees(rng)[:5] + [random_tree(rng, int(rng.integers(2, 60)), int(rng.integers(1, 25)),
                                          roots=int(rng.integers(1, 4))) for _ in range(20)]
    for tree in cases:
        eff_node, eff_prefix = tree.effective_queries
        if not np.array_equal(eff_prefix, tree.lengths[eff_node]):
            continue
        for own in (None, _apart(tree, heads, rows), rng.random(tree.num_nodes) < 0.3):
            a, b = _whole_path_tiles(tree, heads, rows, own), _pair_path_tiles(tree, heads, rows, own)
            for field in ("seg_indptr", "seg_node", "seg_lo", "seg_hi", "q_indptr", "q_indices", "q_tokens",
                          "masked", "mask_lead", "item_len"):
                assert np.array_equal(getattr(a, field), getattr(b, field)), field


def test_mask_lead_is_the_builders_mask_start():
    heads = HeadConfig(16, 2, 64)
    tree = tree_from_spec("1,2,4,8,32_40,16,8,8,4")
    for rows in (32, 64, 128):
        items = path_tiles(tree, heads, rows)
        host = build_plan(tree, items, heads, strategy="paths").host
        lead = np.minimum(host.work_mask_start, host.work_kv_end) - host.work_kv_start
        assert np.array_equal(np.sort(lead), np.sort(items.mask_lead))


def test_the_cost_model_runs_a_masked_items_lead_unmasked():
    """Masked tiles are counted from an item's mask lead: the estimate falls as the lead grows,
    and an unknown lead (-1) counts every tile of the item masked, as before."""
    heads = HeadConfig(64, 8, 128)
    tree = tree_from_spec("1,8,16,32,64,256,1024_256,128,64,16,16,16,16")
    items = path_tiles(tree, heads, 64)
    assert items.masked.any() and (items.mask_lead > 0).any()
    est = [estimate_items(tree, dataclasses.replace(items, mask_lead=lead), heads, CostModel())["total"]
           for lead in (np.zeros_like(items.mask_lead), items.mask_lead, np.full_like(items.mask_lead, -1))]
    assert est[1] < est[0] == est[2]


def test_deep_gqa_trees_read_each_query_once():
    """A deep 1024-leaf tree at 64/8: one row per query, written directly (no merge), and the query
    and partial traffic of ``node``'s plan gone."""
    tree = tree_from_spec("1,8,16,32,64,256,1024_256,128,64,16,16,16,16")
    heads = HeadConfig(64, 8, 128)
    whole = [items for items, note in paths_variants(tree, heads, CostModel()) if note == "paths: tiles of 64 rows"]
    plan = build_plan(tree, whole[0], heads, strategy="paths")
    assert plan.num_direct == tree.num_queries and plan.merge_q_indices.numel() == 0
    assert plan.io.partial_write == plan.io.partial_read == 0
    assert plan.io.queries == tree.num_queries * heads.num_qo_heads * heads.head_dim * 2


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_variants_match_float64_reference(rng, device, hq, hkv):
    """Whole tiles, tiles with long nodes apart and tiles whose leads are split into KV chunks run
    in the Triton kernels and match a float64 reference."""
    d = 16
    q, paged, kc, vc, o_ref = paged_case(tree_from_spec("1,4,16_300,9,70"), hq, hkv, d, rng)
    heads = HeadConfig(hq, hkv, d, torch.float32)
    notes = set()
    for items, note in one_per_kind(paths_variants(paged, heads, CostModel())):
        plan = build_plan(paged, items, heads, strategy="paths", device=device)
        w = TreeAttention(torch.empty(plan.workspace_bytes() // 4 + 1, device=device), device=device, backend="triton")
        assert rel_l2(w.run(*(t.to(device) for t in (q, kc, vc)), plan), o_ref) <= 1e-4, note
        notes.add(("apart" in note, "split" in note))
    assert {(False, False), (True, False), (False, True)} <= notes


def test_trunk_tokens():
    assert trunk_tokens(tree_from_spec("1,4,16_300,9,70")) == 300
    assert trunk_tokens(tree_from_medusa(32, context_len=45)) == 45
    assert trunk_tokens(tree_from_spec("2,8,16_24,12,5")) == 0  # a forest
    # queries inside the root see part of it only
    assert trunk_tokens(DecodingTree.from_parents([-1, 0], [50, 7], query_nodes=[0, 1], query_prefix=[20, 7])) == 20


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
def test_trunk_leads_cut_into_chunks_match_float64_reference(rng, device, hq, hkv):
    """A token tree over one context: its tiles' leads (the context) are also cut into a few
    chunks of the longest lead, and those plans run and match a float64 reference; where the leads
    go beyond the trunk (tiles under different branches) no such variant is made."""
    d = 16
    q, paged, kc, vc, o_ref = paged_case(tree_from_medusa(32, context_len=300), hq, hkv, d, rng)
    heads = HeadConfig(hq, hkv, d, torch.float32)
    chunked = [(items, note) for items, note in paths_variants(paged, heads, CostModel()) if "leads cut" in note]
    assert chunked
    for items, note in one_per_kind(chunked):
        plan = build_plan(paged, items, heads, strategy="paths", device=device)
        w = TreeAttention(torch.empty(plan.workspace_bytes() // 4 + 1, device=device), device=device, backend="triton")
        assert rel_l2(w.run(*(t.to(device) for t in (q, kc, vc)), plan), o_ref) <= 1e-4, note
    notes = [note for _, note in paths_variants(tree_from_spec("1,2,64_300,100,30"), heads, CostModel())]
    assert any("leads split" in note for note in notes)  # split leads, but not the trunk's
    assert not any("leads cut" in note for note in notes)


def test_run_tokens():
    """Tokens of each node's root path in one run of slots from its first, in whole nodes."""
    # root 10..13, its child 1 continues at 14..15 and 1's child 3 at 16; child 2 starts
    # elsewhere; child 4 of 1 has a break inside
    tree = DecodingTree.from_parents([-1, 0, 0, 1, 1], [4, 2, 3, 1, 3], query_nodes=[2, 3, 4],
                                     kv_indices=[10, 11, 12, 13, 14, 15, 30, 31, 32, 16, 17, 18, 40])
    assert run_tokens(tree).tolist() == [4, 6, 4, 7, 6]
    # a forest: each root path's run from its own first slot
    forest = DecodingTree.from_parents([-1, -1, 1], [2, 2, 2], query_nodes=[0, 2], kv_indices=[5, 6, 0, 1, 2, 3])
    assert run_tokens(forest).tolist() == [2, 2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv", [(8, 2)])   # (16/4, the same GQA group, took 4 CI-minutes in the interpreter)
def test_trunk_leads_keep_to_runs_of_slots_and_match_float64_reference(device, hq, hkv):
    """A token tree whose shared first drafts lie in scratch slots after a context of consecutive
    slots: the split variants cut the tiles' leads at the context (the drafts go to the masked
    rest), so every lead reads one run of slots and their launch takes affine addresses; the plans
    match a float64 reference."""
    d, ctx = 16, 300
    tree = scratch_medusa(64, ctx, 512)
    heads = HeadConfig(hq, hkv, d, torch.float32)
    tiles = deferred_path_tiles(tree, heads, 8 * heads.group)
    beyond = tiles.mask_lead > ctx  # tiles whose queries share their first drafts
    assert beyond.any() and (run_leads(tree, tiles) == np.where(beyond, ctx, tiles.mask_lead)).all()
    # with the drafts right after the context, the leads are runs already
    plain = tree_from_medusa(64, context_len=ctx)
    assert run_leads(plain, deferred_path_tiles(plain, heads, 8 * heads.group)) is None
    q = torch.randn(tree.num_queries, hq, d)
    kc, vc = torch.randn(512 + tree.num_tokens, 1, hkv, d), torch.randn(512 + tree.num_tokens, 1, hkv, d)
    o_ref, _ = reference_attention(q.double(), kc.double(), vc.double(), tree)
    split = [(items, note) for items, note in paths_variants(tree, heads, CostModel()) if "leads" in note]
    assert split
    for items, note in split:
        plan = build_plan(tree, items, heads, strategy="paths", device=device)
        h = plan.host
        runs = unit_runs(h.kv_slots, h.work_kv_start, h.work_kv_end)
        unmasked = [ln for ln in plan.launches if not ln.masked]
        assert unmasked and all(runs[ln.work_start: ln.work_end].all() for ln in unmasked), note
    for items, note in one_per_kind(split):
        plan = build_plan(tree, items, heads, strategy="paths", device=device)
        w = TreeAttention(torch.empty(plan.workspace_bytes() // 4 + 1, device=device), device=device, backend="triton")
        assert rel_l2(w.run(*(t.to(device) for t in (q, kc, vc)), plan), o_ref) <= 1e-4, note


def test_lead_chunks_are_known_runs_only_where_they_are():
    """``paths`` marks its split variants of a token tree over one context as reading runs
    (:attr:`WorkItems.unmasked_runs`) when the context lies in consecutive slots, and every
    unmasked unit of those plans is a run; with the context's slots out of order, none is marked."""
    heads = HeadConfig(8, 2, 32, torch.float16)
    tree = scratch_medusa(64, 600, 1024)
    variants = paths_variants(tree, heads, CostModel())
    marked = [items for items, note in variants if items.unmasked_runs]
    assert marked and all("leads" in note for items, note in variants if items.unmasked_runs)
    for items in marked:
        plan = build_plan(tree, items, heads, strategy="paths")
        h = plan.host
        runs = unit_runs(h.kv_slots, h.work_kv_start, h.work_kv_end)
        assert all(runs[ln.work_start: ln.work_end].all() for ln in plan.launches if not ln.masked)
    kv = tree.kv_indices.copy()
    kv[[100, 200]] = kv[[200, 100]]  # two context slots swapped: no lead is one run
    shuffled = DecodingTree.from_parents(tree.parents, tree.lengths, kv_indices=kv, query_nodes=tree.query_nodes,
                                         query_prefix=tree.query_prefix)
    tiles = deferred_path_tiles(shuffled, heads, 128)
    assert not on_runs(shuffled, tiles, run_leads(shuffled, tiles))
    assert not any(items.unmasked_runs for items, _ in paths_variants(shuffled, heads, CostModel()))
