"""Lazy plan update: a patched plan reads exactly what each query must see after leaves grow."""
import numpy as np
import pytest
import torch

from helpers import expected_coverage, planned_coverage, random_tree, rel_l2
from treeattn import STRATEGIES, DecodingTree, KVPool, TreeAttention, reference_attention
from treeattn.plan.update import update_plan
from treeattn.workloads import tree_from_medusa, tree_from_spec

HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def grow_leaves(tree: DecodingTree, rng, steps: int = 1) -> DecodingTree:
    """``tree`` after ``steps`` decode steps: every query's node that it sees whole gains tokens
    in fresh slots (past the end of the old ones)."""
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
    return DecodingTree.from_parents(tree.parents, lengths, query_nodes=qn, query_prefix=prefix,
                                     kv_indices=np.concatenate(parts), page_size=tree.page_size)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", ["suite", "random", "medusa", "forest"])
def test_update_matches_the_visible_tokens(rng, strategy, case):
    tree = {"suite": lambda: tree_from_spec("1,4,16_300,40,3"),
            "random": lambda: random_tree(rng, 60, 30, roots=1, inner_queries=True),
            "medusa": lambda: tree_from_medusa(32, context_len=50),
            "forest": lambda: random_tree(rng, 40, 20, roots=3)}[case]()
    w = TreeAttention(backend="torch")
    plan = w.plan(tree, strategy=strategy, **HEADS)
    for step in range(3):
        tree = grow_leaves(tree, rng, steps=step + 1)
        patched = update_plan(plan, tree)
        assert patched is not None, "a leaf-append step must be patchable"
        got, exp = planned_coverage(tree, patched), expected_coverage(tree)
        assert all(np.array_equal(a, b) for a, b in zip(got, exp))
        assert patched.num_work == plan.num_work and patched.launches == plan.launches
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


def test_update_through_the_pool(rng):
    pool = KVPool(num_pages=64, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    root = pool.new_branch()
    pool.append(root, 37)
    leaves = [pool.fork(root) for _ in range(3)]
    for b in leaves:
        pool.append(b, 5)
    w = TreeAttention(backend="triton")
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
    q = torch.randn(3, 4, 16)
    assert rel_l2(w.run(q, kc, vc, plan), reference_attention(q, kc, vc, tree)[0]) <= 1e-4
