"""Lazy plan update: a patched plan reads exactly what each query must see after leaves grow."""
import numpy as np
import pytest
import torch

from helpers import expected_coverage, planned_coverage, random_tree, rel_l2
from treeattn import STRATEGIES, DecodingTree, KVPool, TreeAttention, reference_attention
from treeattn.plan.lower.update import update_plan
from treeattn.tree import tree_from_medusa, tree_from_spec

HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def grow_leaves(tree: DecodingTree, rng, steps: int = 1, appended: bool = False) -> DecodingTree:
    """``tree`` after ``steps`` decode steps: every query's node that it sees whole gains tokens
    in fresh slots (past the end of the old ones). Built afresh, or by ``tree.append`` when
    ``appended`` (the same tree, which the update need not check)."""
    qn = tree.query_nodes
    grows = np.zeros(tree.num_nodes, dtype=np.int64)
    whole = tree.query_prefix == tree.lengths[qn]
    grows[qn[whole & (tree.lengths[qn] > 0)]] = steps
    lengths = tree.lengths + grows
    next_slot = int(tree.kv_indices.max()) + 1
    new = rng.permutation(int(grows.sum())) + next_slot
    parts, k = [], 0
    for n in range(tree.num_nodes):
        parts.append(tree.kv_indices[tree.kv_indptr[n]:tree.kv_indptr[n + 1]])
        parts.append(new[k:k + grows[n]])
        k += grows[n]
    prefix = np.where(whole & (grows[qn] > 0), lengths[qn], tree.query_prefix)
    if appended:
        return tree.append(grows, new)
    return DecodingTree.from_parents(tree.parents, lengths, query_nodes=qn, query_prefix=prefix,
                                     kv_indices=np.concatenate(parts), page_size=tree.page_size)


@pytest.mark.parametrize("appended", [False, True], ids=["rebuilt", "appended"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", ["suite", "random", "medusa", "forest"])
def test_update_matches_the_visible_tokens(rng, strategy, case, appended):
    tree = {"suite": lambda: tree_from_spec("1,4,16_300,40,3"),
            "random": lambda: random_tree(rng, 60, 30, roots=1, inner_queries=True),
            "medusa": lambda: tree_from_medusa(32, context_len=50),
            "forest": lambda: random_tree(rng, 40, 20, roots=3)}[case]()
    w = TreeAttention(backend="torch")
    plan = w.plan(tree, strategy=strategy, **HEADS)
    for step in range(3):
        tree = grow_leaves(tree, rng, steps=step + 1, appended=appended)
        patched = update_plan(plan, tree)
        assert patched is not None, "a leaf-append step must be patchable"
        got, exp = planned_coverage(tree, patched), expected_coverage(tree)
        assert all(np.array_equal(a, b) for a, b in zip(got, exp))
        # same launches (only contig may go: the new slots need not follow the old ones)
        assert patched.num_work == plan.num_work
        assert patched.host.gather_launches == plan.host.gather_launches
        assert all(a.contig <= b.contig for a, b in zip(patched.launches, plan.launches))
        plan = patched
    q = torch.randn(tree.num_queries, 4, 16)
    k = torch.randn(int(tree.kv_indices.max()) + 1, 1, 2, 16)
    v = torch.randn_like(k)
    assert rel_l2(w.run(q, k, v, plan), reference_attention(q, k, v, tree)[0]) <= 1e-5


def test_update_falls_back_when_the_tree_changes():
    tree = tree_from_spec("1,3_20,4")
    w = TreeAttention(backend="torch")
    plan = w.plan(tree, strategy="auto", **HEADS)
    other = tree_from_spec("1,4_20,4")  # a new branch: structure changed
    assert update_plan(plan, other) is None
    replanned = w.update(plan, other)
    assert replanned.num_queries == 4 and replanned.requested_strategy == "auto"
    shrunk = DecodingTree.from_parents(tree.parents, [20, 4, 4, 3])
    assert update_plan(plan, shrunk) is None


def test_update_through_the_pool(rng, device):
    pool = KVPool(num_pages=64, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device=device)
    root = pool.new_branch()
    pool.append(root, 37)
    leaves = [pool.fork(root) for _ in range(3)]
    for b in leaves:
        pool.append(b, 5)
    w = TreeAttention(device=device, backend="triton")
    tree = pool.tree()
    plan = w.plan(tree, strategy="greedy", **HEADS)
    for _ in range(4):  # decode steps: one token per leaf, pages allocated as needed
        for b in leaves:
            pool.append(b, 1)
        tree = pool.tree()
        plan = w.update(plan, tree)
    kc, vc = pool.k_cache(0), pool.v_cache(0)
    kc.normal_()
    vc.normal_()
    q = torch.randn(3, 4, 16, device=device)
    assert rel_l2(w.run(q, kc, vc, plan), reference_attention(q, kc, vc, tree)[0]) <= 1e-4


def rebuilt(tree: DecodingTree, **change) -> DecodingTree:
    """``tree`` with some of its arrays replaced."""
    a = dict(parents=tree.parents, lengths=tree.lengths, query_nodes=tree.query_nodes,
             query_prefix=tree.query_prefix, kv_indices=tree.kv_indices)
    a.update(change)
    return DecodingTree.from_parents(a.pop("parents"), a.pop("lengths"), page_size=tree.page_size, **a)


def append(tree: DecodingTree, node: int, slots, see: bool = True) -> DecodingTree:
    """``tree`` with ``slots`` appended to ``node``; queries that saw it whole see it whole when
    ``see``."""
    lengths = tree.lengths.copy()
    lengths[node] += len(slots)
    kv = np.insert(tree.kv_indices, tree.kv_indptr[node + 1], slots)
    prefix = tree.query_prefix.copy()
    if see:
        prefix[(tree.query_nodes == node) & (prefix == tree.lengths[node])] += len(slots)
    return rebuilt(tree, lengths=lengths, kv_indices=kv, query_prefix=prefix)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_update_rejects_anything_but_an_append(strategy):
    tree = tree_from_spec("1,3,6_30,7,5")
    plan = TreeAttention(backend="torch").plan(tree, strategy=strategy, **HEADS)
    leaf, fresh = int(tree.query_nodes[0]), int(tree.kv_indices.max()) + 1
    grown = append(tree, leaf, [fresh])
    assert update_plan(plan, grown) is not None
    kv = grown.kv_indices
    moved = kv.copy()
    moved[3] = fresh + 1  # an old token in a new slot
    swapped = kv.copy()
    swapped[[5, 40]] = swapped[[40, 5]]  # two old tokens trade slots
    at_head = np.insert(tree.kv_indices, tree.kv_indptr[leaf], fresh)  # not at the tail
    parents = tree.parents.copy()
    parents[[4, 9]] = parents[[9, 4]]  # same sizes, other parents
    assert not np.array_equal(parents, tree.parents)
    lengths = grown.lengths.copy()
    lengths[0] -= 1  # the root loses a token: as many tokens as with one appended
    qn = grown.query_nodes[::-1].copy()
    for bad in (rebuilt(grown, kv_indices=moved), rebuilt(grown, kv_indices=swapped),
                rebuilt(grown, kv_indices=at_head), rebuilt(grown, parents=parents),
                rebuilt(grown, query_prefix=tree.query_prefix),  # the leaf's query misses it
                rebuilt(grown, query_nodes=qn, query_prefix=grown.lengths[qn]),
                rebuilt(grown, lengths=lengths, kv_indices=kv[1:]),
                rebuilt(tree, kv_indices=tree.kv_indices + 1)):  # no growth, other slots
        assert update_plan(plan, bad) is None
    assert update_plan(plan, rebuilt(tree)) is plan  # no growth, same slots


def test_update_rejects_an_append_nobody_reads():
    # a speculative-style query sees 3 of its node's 5 tokens: the node's tail is never planned
    tree = DecodingTree.from_parents([-1, 0, 0], [6, 5, 4], query_nodes=[1, 2], query_prefix=[3, 4])
    w = TreeAttention(backend="torch")
    for strategy in STRATEGIES:
        plan = w.plan(tree, strategy=strategy, **HEADS)
        assert update_plan(plan, append(tree, 1, [15], see=False)) is None
        assert update_plan(plan, append(tree, 2, [15])) is not None
        assert update_plan(plan, tree.append([0, 1, 0], [15])) is None
        assert update_plan(plan, tree.append([0, 0, 1], [15])) is not None
        # a tree appended to another one is checked like any other: two steps at once patch
        twice = update_plan(plan, tree.append([0, 0, 1], [15]).append([0, 0, 1], [16]))
        assert twice is not None and twice.kv_indices.numel() == plan.kv_indices.numel() + 2
        assert update_plan(plan, tree.append([0, 0, 1], [15]).append([0, 1, 0], [16])) is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_update_of_an_appended_tree_equals_that_of_the_rebuilt_one(rng, strategy):
    tree = random_tree(rng, 50, 25, roots=2, inner_queries=True)
    plan = TreeAttention(backend="torch").plan(tree, strategy=strategy, **HEADS)
    for step in range(3):
        appended = grow_leaves(tree, np.random.default_rng(step), step + 1, appended=True)
        rebuilt_tree = grow_leaves(tree, np.random.default_rng(step), step + 1)
        for name in ("parents", "lengths", "kv_indptr", "kv_indices", "query_nodes", "query_prefix"):
            assert np.array_equal(getattr(appended, name), getattr(rebuilt_tree, name)), name
        a, b = update_plan(plan, appended), update_plan(plan, rebuilt_tree)
        for name, value in vars(a).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, getattr(b, name)), name
        assert a.launches == b.launches and a.io == b.io and a.min_slots == b.min_slots
        tree, plan = appended, a


@pytest.mark.parametrize("appended", [False, True], ids=["rebuilt", "appended"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_update_keeps_host_invariants_and_io(rng, strategy, appended):
    tree = random_tree(rng, 50, 25, roots=2, inner_queries=True)
    plan = TreeAttention(backend="torch").plan(tree, strategy=strategy, **HEADS)
    for step in range(3):
        tree = grow_leaves(tree, rng, steps=step + 1, appended=appended)
        plan = update_plan(plan, tree)
        h = plan.host
        start, end = plan.work_kv_start.numpy(), plan.work_kv_end.numpy()
        assert np.array_equal(h.kv_slots, plan.kv_indices.numpy())
        assert np.array_equal(h.work_kv_start, start) and np.array_equal(h.work_kv_end, end)
        assert np.all(h.kv_slots[h.tail_pos] == tree.kv_indices[tree.kv_indptr[h.tail_node + 1] - 1])
        assert np.array_equal(h.start_tails, np.searchsorted(h.tail_pos, start))
        assert np.array_equal(h.end_tails, np.searchsorted(h.tail_pos, end))
        cover = [np.count_nonzero((start <= p) & (p < end)) for p in h.tail_pos]
        assert np.array_equal(h.tail_cover, cover)
        assert np.array_equal(h.saw_all, tree.query_prefix == tree.lengths[tree.query_nodes])
        assert np.array_equal(h.untailed, np.setdiff1d(np.arange(tree.num_nodes), h.tail_node))
        heads = plan.heads
        per_token = heads.num_kv_heads * heads.head_dim * 2 * heads.elem_bytes
        tiles = int((end - start).sum())
        io = plan.io
        assert io.kv == plan.kv_indices.numel() * per_token
        assert io.kv + io.kv_tile_rereads == tiles * per_token
        assert io.index == tiles * 4 * heads.num_kv_heads
        mask_start = plan.work_mask_start.numpy()
        assert np.array_equal(h.work_mask_start, mask_start)
        assert np.all((start <= mask_start) & (mask_start <= end))
        if plan.has_mask:
            assert np.array_equal(h.mask_tails, np.searchsorted(h.tail_pos, mask_start))
        else:
            assert np.array_equal(mask_start, end)
        # a launch without a mask split masks its units whole
        masked = sum(int((end[w] - (start[w] + (mask_start[w] - start[w]) // ln.block_n * ln.block_n
                                    * ln.mask_split)).sum())
                     for ln in plan.launches if ln.masked for w in [slice(ln.work_start, ln.work_end)])
        assert io.mask == (masked * 12 * heads.num_kv_heads if plan.has_mask else 0)
        assert plan.min_slots == int(plan.kv_indices.max()) + 1


@pytest.mark.parametrize("strategy", ["node", "greedy"])
def test_update_of_packed_leaf_items_keeps_each_query_to_its_leaf(rng, strategy):
    """Leaf items packed into shared work items (many short leaves, 32 KV heads) stay packed
    through lazy updates: the new tokens join their leaf inside the packed item, with its tree
    mask range, so every query still sees exactly its own path."""
    tree = tree_from_spec("1,200_40,6")
    heads = dict(num_qo_heads=32, num_kv_heads=32, head_dim=16, dtype=torch.float32)
    plan = TreeAttention(backend="torch").plan(tree, strategy=strategy, **heads)
    assert "packed" in plan.reason and plan.has_mask
    for steps in (1, 2):
        tree = grow_leaves(tree, rng, steps)
        updated = update_plan(plan, tree)
        assert updated is not None and updated.num_work == plan.num_work
        got_q, got_t = planned_coverage(tree, updated)
        exp_q, exp_t = expected_coverage(tree)
        assert np.array_equal(got_q, exp_q) and np.array_equal(got_t, exp_t)
        plan = updated
