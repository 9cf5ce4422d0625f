import numpy as np
import pytest

from helpers import random_parents, random_tree
from treeattn import DecodingTree


def naive_preorder(parents):
    n = len(parents)
    kids = {i: [] for i in range(n)}
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    order = []
    stack = [r for r in range(n) if parents[r] < 0][::-1]
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(sorted(kids[v])[::-1])
    return order


@pytest.mark.parametrize("n,roots", [(1, 1), (2, 1), (17, 1), (60, 3), (200, 5)])
def test_topology_matches_naive_dfs(rng, n, roots):
    parents = random_parents(rng, n, roots)
    lengths = rng.integers(0, 9, n)
    lengths[parents < 0] = 1
    tree = DecodingTree.from_parents(parents, lengths)
    topo = tree.topology
    order = naive_preorder(parents)
    assert topo.order.tolist() == order
    flat = np.concatenate(([0], np.cumsum(lengths[order])))[:-1]
    assert topo.flat_start[order].tolist() == flat.tolist()
    for v in range(n):  # ancestor test on pre-order intervals
        path, u = set(), v
        while u >= 0:
            path.add(u)
            u = parents[u]
        got = {a for a in range(n) if topo.tin[a] <= topo.tin[v] < topo.tout[a]}
        assert got == path
        assert topo.path_tokens[v] == sum(lengths[a] for a in path if a != v)


def test_default_queries_are_leaves_in_id_order():
    tree = DecodingTree.from_parents([2, 2, -1, 0], [3, 4, 5, 1])
    assert tree.query_nodes.tolist() == [1, 3]
    assert tree.query_prefix.tolist() == [4, 1]
    assert tree.visible_tokens.tolist() == [9, 9]
    assert tree.kv_indptr.tolist() == [0, 3, 7, 12, 13]


def test_inputs_are_copied_not_mutated():
    parents = np.array([-1, 0, 0])
    lengths = np.array([4, 2, 2])
    tree = DecodingTree.from_parents(parents, lengths)
    parents[1] = 5
    assert tree.parents.tolist() == [-1, 0, 0]


@pytest.mark.parametrize("parents,lengths,match", [
    ([1, 0], [1, 1], "cycle"),
    ([-1, 2, 3, 1], [1, 1, 1, 1], "cycle"),
    ([-1, 0, 0], [1, 1], "lengths"),
    ([-1, 5], [1, 1], "parent of node 1 is 5"),
    ([-1, -3], [1, 1], "parent of node 1"),
    ([-1, 0], [1, -2], "node 1 has negative length"),
    ([-1, 1], [1, 1], "node 1 is its own parent"),
    ([], [], "no nodes"),
])
def test_malformed_trees_raise(parents, lengths, match):
    with pytest.raises(ValueError, match=match):
        DecodingTree.from_parents(parents, lengths)


def test_bad_queries_raise():
    with pytest.raises(ValueError, match="query 0 .*sees no KV token"):
        DecodingTree.from_parents([-1, 0], [0, 3], query_nodes=[1], query_prefix=[0])
    with pytest.raises(ValueError, match="query 1 is at node 7"):
        DecodingTree.from_parents([-1, 0], [2, 3], query_nodes=[1, 7])
    with pytest.raises(ValueError, match="prefix 4 of node 1"):
        DecodingTree.from_parents([-1, 0], [2, 3], query_nodes=[1], query_prefix=[4])
    with pytest.raises(TypeError, match="integers"):
        DecodingTree.from_parents([-1, 0.5], [2, 3])


def test_pages_out_of_range_raise():
    with pytest.raises(ValueError, match="page out of range: node 1 uses page 9"):
        DecodingTree.from_parents([-1, 0], [2, 2], kv_indices=[0, 1, 2, 37], page_size=4, num_slots=16)
    with pytest.raises(ValueError, match="kv_indices has 3 slots"):
        DecodingTree.from_parents([-1, 0], [2, 2], kv_indices=[0, 1, 2])


def test_query_inside_node_sees_prefix():
    tree = DecodingTree.from_parents([-1, 0], [5, 4], query_nodes=[1, 1, 0], query_prefix=[1, 4, 2])
    assert tree.visible_tokens.tolist() == [6, 9, 2]
    assert tree.sees(np.array([0, 1, 1]), np.array([0, 0, 2])).tolist() == [5, 1, 0]


def test_ranges():
    from treeattn.tree.topology import ranges
    rng = np.random.default_rng(0)
    for n, c in ((0, 3), (5, 0), (50, 1), (200, 6), (40, 300)):
        starts = rng.integers(-50, 1000, n)
        ends = starts + rng.integers(-2, c + 1, n)  # empty and reversed ranges give nothing
        exp = [x for s, e in zip(starts, ends) for x in range(s, e)]
        got = ranges(starts, ends)
        assert got.dtype == np.int64 and got.tolist() == exp


def test_paths_list_each_nodes_ancestors_root_first():
    tree = DecodingTree.from_parents([2, 2, -1, 1, -1], [1, 1, 1, 1, 1])
    owner, node = tree.paths(np.array([3, 4, 2]))
    assert owner.tolist() == [0, 0, 0, 1, 2] and node.tolist() == [2, 1, 3, 4, 2]


@pytest.mark.parametrize("inner", [False, True])
def test_pairs_by_node_are_the_effective_paths_sorted_by_node(rng, inner):
    for _ in range(40):
        tree = random_tree(rng, int(rng.integers(1, 80)), int(rng.choice([1, 4, 16])),
                           roots=int(rng.integers(1, 4)), inner_queries=inner)
        pre = np.lexsort((tree.query_prefix, tree.topology.tin[tree.query_nodes]))
        # (queries in pre-order of their nodes take the sort-free path)
        for t in (tree, tree.with_queries(tree.query_nodes[pre], tree.query_prefix[pre])):
            eff, prefix = t.effective_queries
            owner, node = t.paths(eff)
            last = np.append(owner[1:] != owner[:-1], True)
            nxt = np.where(last, -1, np.append(node[1:], -1))
            visible = np.where(last, prefix[owner], t.lengths[node])
            order = np.argsort(node, kind="stable")
            for got, want in zip(t.pairs_by_node, (owner, node, nxt, visible)):
                assert got.dtype == np.int64 and got.tolist() == want[order].tolist()
            below = np.bincount(node, minlength=t.num_nodes)
            assert t.subtree_queries.tolist() == below.tolist()
            extent = np.zeros(t.num_nodes, dtype=np.int64)
            np.maximum.at(extent, node, visible)
            assert t.node_extent.tolist() == extent.tolist()


def _fresh(tree):
    return DecodingTree(tree.parents, tree.lengths, tree.kv_indptr, tree.kv_indices,
                        tree.query_nodes, tree.query_prefix, tree.page_size, tree.num_slots)


@pytest.mark.parametrize("n,roots", [(1, 1), (17, 1), (60, 3)])
def test_reuse_shares_structure_and_matches_a_fresh_tree(rng, n, roots):
    parents = random_parents(rng, n, roots)
    lengths = rng.integers(1, 9, n)
    qn = rng.choice(n, size=min(n, 7), replace=False)
    first = DecodingTree.from_parents(parents, lengths, query_nodes=qn)
    grown = lengths + rng.integers(0, 5, n)
    prefix = np.where(rng.random(qn.size) < 0.5, grown[qn], rng.integers(0, 2, qn.size))
    prefix = np.where(parents[qn] < 0, grown[qn], prefix)  # a query must see some token
    nxt = DecodingTree.from_parents(parents, grown, query_nodes=qn, query_prefix=prefix, reuse=first)
    assert nxt._structure is first._structure
    ref = _fresh(nxt)
    assert ref._structure is not first._structure
    for name in ("depth", "order", "tin", "tout", "child_indptr", "child_indices", "path_tokens",
                 "flat_start"):
        np.testing.assert_array_equal(getattr(nxt.topology, name), getattr(ref.topology, name))
    for a, b in zip(nxt.effective_paths + nxt.visible_pairs, ref.effective_paths + ref.visible_pairs):
        np.testing.assert_array_equal(a, b)
    # other parents or queries: nothing is shared
    other = DecodingTree.from_parents(parents, grown, query_nodes=np.append(qn, qn[0]), reuse=first)
    assert other._structure is not first._structure


def test_reuse_skips_only_checks_of_known_parents():
    tree = DecodingTree.from_parents([-1, 0], [2, 1])
    with pytest.raises(ValueError, match="sees prefix"):
        DecodingTree.from_parents([-1, 0], [2, 1], query_nodes=[1], query_prefix=[2], reuse=tree)
    with pytest.raises(ValueError, match="cycle"):
        DecodingTree.from_parents([1, 0], [2, 1], query_nodes=[1], reuse=tree)


@pytest.mark.parametrize("n,roots", [(1, 1), (17, 1), (60, 3)])
def test_append_matches_a_fresh_tree(rng, n, roots):
    parents = random_parents(rng, n, roots)
    lengths = rng.integers(0, 9, n)
    lengths[parents < 0] += 1  # every query sees a token
    qn = rng.choice(n, size=min(n, 7), replace=False)
    prefix = np.where(rng.random(qn.size) < 0.5, lengths[qn], 0)
    prefix = np.where(parents[qn] < 0, lengths[qn], prefix)
    tree = DecodingTree.from_parents(parents, lengths, query_nodes=qn, query_prefix=prefix,
                                     kv_indices=rng.permutation(int(lengths.sum())) + 5, page_size=4)
    counts = rng.integers(0, 3, n)
    slots = 1000 + rng.permutation(int(counts.sum()))
    got = tree.append(counts, slots)
    # node by node: the old slots, then the node's appended ones
    new = np.split(slots, np.cumsum(counts)[:-1])
    kv = np.concatenate([np.concatenate((tree.kv_indices[tree.kv_indptr[i]:tree.kv_indptr[i + 1]], new[i]))
                         for i in range(n)])
    saw_all = prefix == lengths[qn]
    exp = DecodingTree.from_parents(parents, lengths + counts, query_nodes=qn, kv_indices=kv, page_size=4,
                                    query_prefix=np.where(saw_all, (lengths + counts)[qn], prefix))
    for name in ("parents", "lengths", "kv_indptr", "kv_indices", "query_nodes", "query_prefix"):
        np.testing.assert_array_equal(getattr(got, name), getattr(exp, name))
    assert got._structure is tree._structure and got.page_size == 4
    np.testing.assert_array_equal(got.appended_to(tree), counts)
    assert got.appended_to(exp) is None and exp.appended_to(tree) is None


def test_append_checks_its_input_and_keeps_no_earlier_tree_alive():
    import gc
    import weakref
    tree = DecodingTree.from_parents([-1, 0, 0], [3, 1, 1], num_slots=8)
    with pytest.raises(ValueError, match="counts has 2 entries"):
        tree.append([1, 1], [5, 6])
    with pytest.raises(ValueError, match="counts must be >= 0"):
        tree.append([0, -1, 1], [5])
    with pytest.raises(ValueError, match="slots has 1 entries but counts appends 2"):
        tree.append([0, 1, 1], [5])
    with pytest.raises(ValueError, match="page out of range"):
        tree.append([0, 1, 1], [5, 8])
    first = weakref.ref(tree)
    for step in range(3):
        tree = tree.append([0, 1, 0], [5 + step])
    gc.collect()
    assert first() is None


def test_tree_arrays_are_read_only():
    tree = DecodingTree.from_parents([-1, 0], [3, 2])
    for name in ("parents", "lengths", "kv_indptr", "kv_indices", "query_nodes", "query_prefix"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(tree, name)[0] = 1
