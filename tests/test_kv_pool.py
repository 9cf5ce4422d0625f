"""Tests of treeattn.paged_kv.KVPool: paged KV cache with forkable, reference-counted branches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from treeattn.paged_kv import KVPool, KVPoolOutOfMemory

HKV, D = 2, 4


def make_pool(num_pages=16, page_size=4, num_layers=2, dtype=torch.float16):
    return KVPool(num_pages, page_size, HKV, D, num_layers=num_layers, dtype=dtype)


def fill(pool, branch, n, gen, high=False):
    """Append n tokens to branch (from the highest free pages with ``high``) and write fresh random
    K/V in every layer.

    Returns the written data, float tensor [n, layers, 2, HKV, D] (in the pool dtype)."""
    slots = pool.append(branch, n, high=high)
    data = torch.randn(n, pool.num_layers, 2, HKV, D, generator=gen).to(pool.dtype)
    data[data == 0] = 1.0  # never zeros: zeros would hide reads of unwritten slots
    for layer in range(pool.num_layers):
        pool.write(slots, layer, data[:, layer, 0].contiguous(), data[:, layer, 1].contiguous())
    return data


def gather(pool, branch):
    """K/V of every token of branch, [length, layers, 2, HKV, D]."""
    idx = torch.from_numpy(pool.slots(branch))
    per_layer = [torch.stack([pool.k_cache(l).reshape(-1, HKV, D)[idx],
                              pool.v_cache(l).reshape(-1, HKV, D)[idx]], dim=1)
                 for l in range(pool.num_layers)]
    return torch.stack(per_layer, dim=1)


def snapshot(pool):
    return (
        {b: (pool.block_table(b).tolist(), pool.length(b), pool.parent(b), pool.children(b))
         for b in pool.branches},
        pool.refcounts.tolist(), pool.free_pages.tolist(), pool.num_free_pages,
        pool._storage.clone(),
    )


def assert_same(a, b):
    assert a[:4] == b[:4]
    assert torch.equal(a[4], b[4])


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def test_layout_and_write_slots_round_trip(gen):
    pool = make_pool()
    assert pool.k_cache(1).shape == (16, 4, HKV, D) and pool.k_cache(1).is_contiguous()
    assert pool.v_cache(0).dtype == torch.float16
    b = pool.new_branch()
    data = fill(pool, b, 7, gen)
    slots = pool.slots(b)
    assert slots.dtype == np.int64 and slots.shape == (7,)
    assert torch.equal(gather(pool, b), data)
    assert pool.length(b) == 7 and pool.block_table(b).tolist() == [0, 1]
    more = fill(pool, b, 3, gen)
    assert torch.equal(gather(pool, b), torch.cat([data, more]))
    # the page-major layout: slot s is token s % page_size of page s // page_size
    s = int(slots[5])
    assert torch.equal(pool.k_cache(1)[s // 4, s % 4], data[5, 1, 0])
    pool.check()


def test_high_appends_take_the_highest_free_pages(gen):
    """Side branches appended with ``high`` take the top pages, so a branch growing beside them
    keeps consecutive slots; the pool stays consistent and the pages come back when pruned."""
    pool = make_pool(num_pages=16, page_size=4)
    seq, side = pool.new_branch(), pool.new_branch()
    fill(pool, seq, 6, gen)
    assert pool.append(side, 9, high=True).tolist() == list(range(52, 61))   # pages 13, 14, 15
    fill(pool, seq, 9, gen)
    assert pool.slots(seq).tolist() == list(range(15))
    assert pool.append(side, 4, high=True).tolist() == [61, 62, 63, 48]      # fills page 15, then 12
    pool.check()
    before = pool.num_free_pages
    with pytest.raises(KVPoolOutOfMemory):
        pool.append(side, 4 * before + 4, high=True)  # (3 slots left in its last page)
    assert pool.num_free_pages == before
    pool.prune(side)
    pool.check()
    assert pool.num_free_pages == 16 - 4
    assert pool.append(pool.new_branch(), 1).tolist() == [16]                # lowest first again


def test_fork_shares_pages(gen):
    pool = make_pool()
    root = pool.new_branch()
    fill(pool, root, 10, gen)  # pages 0, 1 full, page 2 holds 2 tokens
    free0 = pool.num_free_pages
    kids = [pool.fork(root) for _ in range(3)]
    assert pool.num_free_pages == free0
    for k in kids:
        assert pool.block_table(k).tolist() == pool.block_table(root).tolist()
        assert pool.length(k) == 10 and pool.parent(k) == root
        assert np.array_equal(pool.slots(k), pool.slots(root))
    assert pool.refcounts[:3].tolist() == [4, 4, 4]
    assert pool.children(root) == kids
    pool.check()


def test_copy_on_write_copies_only_partial_last_page(gen):
    pool = make_pool()
    root = pool.new_branch()
    data = fill(pool, root, 10, gen)
    child = pool.fork(root)
    free0 = pool.num_free_pages
    before = pool._storage.clone()
    slots = pool.append(child, 1)  # fits in the copied partial page
    assert pool.num_free_pages == free0 - 1
    bt_child, bt_root = pool.block_table(child), pool.block_table(root)
    assert bt_child[:2].tolist() == bt_root[:2].tolist()  # full pages still shared
    assert bt_child[2] != bt_root[2]
    assert pool.refcounts[bt_root].tolist() == [2, 2, 1] and pool.refcounts[bt_child[2]] == 1
    assert slots.tolist() == [int(bt_child[2]) * 4 + 2]
    # the copied slots hold the same K and V as the original, in every layer
    assert torch.equal(gather(pool, child)[:10], data)
    new = int(bt_child[2])
    assert torch.equal(pool._storage[:, :, new, :2], pool._storage[:, :, int(bt_root[2]), :2])
    # nothing but the copied slots changed
    changed = (pool._storage != before).reshape(pool.num_layers, 2, -1, HKV * D).any(-1)
    assert changed.nonzero()[:, 2].unique().tolist() == [new * 4, new * 4 + 1]
    # a full shared last page is never copied
    root2 = pool.new_branch()
    fill(pool, root2, 8, gen)
    c2 = pool.fork(root2)
    free1 = pool.num_free_pages
    pool.append(c2, 1)
    assert pool.num_free_pages == free1 - 1
    assert pool.block_table(c2)[:2].tolist() == pool.block_table(root2).tolist()
    pool.check()


def test_appends_after_fork_keep_parent_data(gen):
    pool = make_pool(page_size=3)
    root = pool.new_branch()
    data = fill(pool, root, 5, gen)
    a, b = pool.fork(root), pool.fork(root)
    da = fill(pool, a, 4, gen)
    db = fill(pool, b, 2, gen)
    dr = fill(pool, root, 1, gen)  # the parent itself now copies its shared partial page too
    assert torch.equal(gather(pool, root), torch.cat([data, dr]))
    assert torch.equal(gather(pool, a), torch.cat([data, da]))
    assert torch.equal(gather(pool, b), torch.cat([data, db]))
    pool.check()


def test_prune_frees_subtree(gen):
    pool = make_pool(num_pages=32)
    start = pool.num_free_pages
    root = pool.new_branch()
    fill(pool, root, 6, gen)
    a = pool.fork(root)
    fill(pool, a, 5, gen)
    a1, a2 = pool.fork(a), pool.fork(a)
    fill(pool, a1, 3, gen)
    fill(pool, a2, 9, gen)
    b = pool.fork(root)
    db = fill(pool, b, 2, gen)
    keep = gather(pool, b)
    with pytest.raises(ValueError, match="children"):
        pool.free(a)
    pool.prune(a)
    assert pool.branches == [root, b]
    for gone in (a, a1, a2):
        with pytest.raises(ValueError):
            pool.length(gone)
    pool.check()
    assert torch.equal(gather(pool, b), keep) and torch.equal(gather(pool, b)[6:], db)
    pool.free(b)
    pool.check()
    pool.prune(root)
    assert pool.branches == [] and pool.num_free_pages == start
    assert not pool.refcounts.any()
    pool.check()


def test_out_of_memory_leaves_pool_unchanged(gen):
    pool = make_pool(num_pages=5, page_size=4)
    root = pool.new_branch()
    fill(pool, root, 10, gen)  # 3 pages, last partial
    child = pool.fork(root)
    before = snapshot(pool)
    # needs 1 copy-on-write page + 2 pages, only 2 free
    with pytest.raises(KVPoolOutOfMemory, match=r"needs 3 free page.*only 2"):
        pool.append(child, 10)
    assert_same(snapshot(pool), before)
    pool.check()
    assert isinstance(KVPoolOutOfMemory("x"), RuntimeError)
    fill(pool, child, 6, gen)  # exactly fits: copy-on-write page + 1
    assert pool.num_free_pages == 0
    with pytest.raises(KVPoolOutOfMemory):
        pool.append(root, 3)  # root's partial page is no longer shared, but 3 > 2 free slots
    pool.check()


def test_bad_arguments_raise_and_leave_pool_unchanged(gen):
    pool = make_pool()
    b = pool.new_branch()
    fill(pool, b, 5, gen)
    before = snapshot(pool)
    for bad in (99, -1):
        for op in (pool.fork, pool.prune, pool.free, pool.length, pool.block_table, pool.slots):
            with pytest.raises(ValueError, match="branch"):
                op(bad)
        with pytest.raises(ValueError, match="branch"):
            pool.append(bad, 1)
    with pytest.raises(TypeError):
        pool.append("0", 1)
    with pytest.raises(ValueError, match="n_tokens"):
        pool.append(b, -1)
    with pytest.raises(TypeError, match="n_tokens"):
        pool.append(b, 1.5)
    slots = pool.slots(b)
    k = torch.randn(5, HKV, D).half()
    with pytest.raises(ValueError, match="shape"):
        pool.write(slots, 0, k[:4], k[:4])
    with pytest.raises(TypeError, match="dtype"):
        pool.write(slots, 0, k.float(), k.float())
    with pytest.raises(ValueError, match="layer"):
        pool.write(slots, 2, k, k)
    with pytest.raises(ValueError, match="out of range"):
        pool.write(np.array([0, 1, 2, 3, 10_000]), 0, k, k)
    with pytest.raises(ValueError, match="no branch holds"):
        pool.write(np.array([0, 1, 2, 3, 60]), 0, k, k)
    with pytest.raises(ValueError, match="distinct"):
        pool.write(np.array([0, 1, 2, 3, 3]), 0, k, k)
    assert_same(snapshot(pool), before)
    pool.prune(b)
    with pytest.raises(ValueError, match="branch"):
        pool.append(b, 1)
    with pytest.raises(ValueError):
        KVPool(0, 4, HKV, D)
    pool.check()


@pytest.mark.parametrize("page_size", [1, 16])
def test_randomized_operations_keep_pool_consistent(page_size):
    rng = np.random.default_rng(page_size)
    gen = torch.Generator().manual_seed(page_size)
    pool = make_pool(num_pages=48 if page_size == 1 else 8, page_size=page_size)
    start = pool.num_free_pages
    shadow: dict[int, torch.Tensor] = {}  # expected K/V of every live branch
    ooms = cows = 0
    for _ in range(200):
        live = pool.branches
        op = rng.choice(["new", "fork", "append", "prune", "free"], p=[.1, .2, .5, .1, .1])
        if op == "new" or not live:
            shadow[pool.new_branch()] = torch.zeros(0, pool.num_layers, 2, HKV, D, dtype=pool.dtype)
            pool.check()
            continue
        b = int(rng.choice(live))
        if op == "fork":
            shadow[pool.fork(b)] = shadow[b].clone()
        elif op == "append":
            n = int(rng.integers(0, max(12, 2 * page_size + 3)))
            before, table = snapshot(pool), pool.block_table(b)
            try:
                shadow[b] = torch.cat([shadow[b], fill(pool, b, n, gen, high=bool(rng.integers(2)))])
                cows += int(not np.array_equal(pool.block_table(b)[:table.size], table))
            except KVPoolOutOfMemory:
                ooms += 1
                assert_same(snapshot(pool), before)
        elif op == "prune":
            pool.prune(b)
        else:
            if pool.children(b):
                before = snapshot(pool)
                with pytest.raises(ValueError):
                    pool.free(b)
                assert_same(snapshot(pool), before)
            else:
                pool.free(b)
        pool.check()
        for gone in set(shadow) - set(pool.branches):
            del shadow[gone]
        for bid in pool.branches:
            assert pool.length(bid) == shadow[bid].shape[0]
            assert torch.equal(gather(pool, bid), shadow[bid])
    assert ooms > 0, 'the sequence should exercise out-of-memory'
    assert cows > 0 or page_size == 1, 'the sequence should exercise copy-on-write'
    for bid in [x for x in pool.branches if pool.parent(x) is None]:
        pool.prune(bid)
    pool.check()
    assert pool.branches == [] and pool.num_free_pages == start


def _query_slots(tree, j):
    """Concatenated root->leaf KV slots seen by query j of a DecodingTree."""
    node = int(tree.query_nodes[j])
    own = tree.kv_indices[tree.kv_indptr[node]:tree.kv_indptr[node] + tree.query_prefix[j]]
    parts = [own]
    node = int(tree.parents[node])
    while node >= 0:
        parts.append(tree.kv_indices[tree.kv_indptr[node]:tree.kv_indptr[node + 1]])
        node = int(tree.parents[node])
    return np.concatenate(parts[::-1])


def test_tree_of_forked_family(gen):
    pytest.importorskip("treeattn.tree.builders")
    pool = make_pool(num_pages=64, page_size=4)
    root = pool.new_branch()
    fill(pool, root, 10, gen)  # 2 full pages + a partial page
    a, b, c = pool.fork(root), pool.fork(root), pool.fork(root)
    fill(pool, a, 6, gen)  # a: 16 tokens, 4 full pages (copy-on-write of page 2)
    fill(pool, b, 3, gen)
    fill(pool, c, 9, gen)
    a1, a2 = pool.fork(a), pool.fork(a)
    fill(pool, a1, 1, gen)
    fill(pool, a2, 5, gen)
    tree = pool.tree()  # leaves b, c, a1, a2 in increasing id order
    leaves = [b, c, a1, a2]
    assert tree.num_queries == 4 and tree.page_size == 4 and tree.num_slots == 64 * 4
    assert tree.visible_tokens.tolist() == [pool.length(x) for x in leaves]
    for j, x in enumerate(leaves):
        assert np.array_equal(_query_slots(tree, j), pool.slots(x))
    # shared: root's 2 full pages (8 tokens) once, a's own 2 full pages (8 tokens) once
    unique = 8 + (pool.length(b) - 8) + (pool.length(c) - 8) + 8 \
        + (pool.length(a1) - 16) + (pool.length(a2) - 16)
    assert tree.num_tokens == unique
    assert tree.num_nodes == 6  # [root pages] -> b, c, [a pages] -> a1, a2 (chains compressed)
    # identical partial pages (same fill) are shared; an explicit list may include inner branches
    d = pool.fork(b)
    t2 = pool.tree([b, d, root])
    assert t2.visible_tokens.tolist() == [pool.length(b), pool.length(d), pool.length(root)]
    for j, x in enumerate([b, d, root]):
        assert np.array_equal(_query_slots(t2, j), pool.slots(x))
    assert t2.num_tokens == pool.length(b) + 2  # b's pages shared with d; root's partial page
    with pytest.raises(ValueError):
        pool.tree([pool.new_branch()])
