"""Tests of the workload constructors in :mod:`treeattn.tree.builders` and of the engine workloads
(:mod:`treeattn.engine.workloads`) on a tiny random model."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from treeattn.tree import (
    find_shared, load_kernel_suite, medusa_records, suite_trees, tree_from_block_tables,
    tree_from_medusa, tree_from_spec, tree_from_tot_template,
)


def node_slots(tree, node):
    return tree.kv_indices[tree.kv_indptr[node]:tree.kv_indptr[node + 1]]


def visible_slots(tree, q):
    """Slots query ``q`` sees: proper ancestors root->node, then its node's prefix."""
    node = int(tree.query_nodes[q])
    chain, a = [], int(tree.parents[node])
    while a >= 0:
        chain.append(a)
        a = int(tree.parents[a])
    parts = [node_slots(tree, a) for a in reversed(chain)]
    parts.append(node_slots(tree, node)[: tree.query_prefix[q]])
    return np.concatenate(parts)


def parse(spec):
    sizes, lens = ([int(x) for x in p.split(",")] for p in spec.split("_"))
    return sizes, lens


# ---------------------------------------------------------------------------- kernel suite
def test_suites_listed():
    suite = load_kernel_suite()
    assert "format" in suite
    fasttree, pat, both = suite_trees("fasttree"), suite_trees("pat"), suite_trees("all")
    assert fasttree == suite["suites"]["fasttree"] and pat == suite["suites"]["pat"]
    assert set(both) == set(fasttree) | set(pat) and len(both) == len(set(both))
    with pytest.raises(ValueError, match="unknown suite"):
        suite_trees("nope")


@pytest.mark.parametrize("spec", suite_trees("all"))
def test_suite_spec_counts(spec):
    sizes, lens = parse(spec)
    tree = tree_from_spec(spec)
    assert tree.num_nodes == sum(sizes)
    assert tree.num_tokens == sum(s * n for s, n in zip(sizes, lens))
    assert tree.num_queries == sizes[-1]
    assert np.array_equal(tree.query_nodes, np.arange(sum(sizes) - sizes[-1], sum(sizes)))
    assert int((tree.parents < 0).sum()) == sizes[0]
    assert np.all(tree.visible_tokens == sum(lens))


def test_spec_parent_rule_and_forest():
    tree = tree_from_spec("1,2,5_3,2,1")
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 1, 2, 2]
    assert tree.lengths.tolist() == [3, 2, 2, 1, 1, 1, 1, 1]
    forest = tree_from_spec("2,3_4,1")
    assert forest.parents.tolist() == [-1, -1, 0, 0, 1]
    assert forest.query_nodes.tolist() == [2, 3, 4]


def test_spec_scale():
    tree = tree_from_spec("1,4_1000,10", scale=0.01)
    assert tree.lengths.tolist() == [10, 1, 1, 1, 1]
    assert tree_from_spec("1,4_1000,10", scale=2).num_tokens == 2000 + 4 * 20


@pytest.mark.parametrize("spec", ["1,2_3", "1,a_2,3", "0,2_3,3", "1,2", "1,2_3,0", "", "1_2_3"])
def test_spec_malformed(spec):
    with pytest.raises(ValueError, match="malformed tree spec"):
        tree_from_spec(spec)


def test_find_shared(monkeypatch, tmp_path):
    assert (find_shared() / "workloads" / "kernel_suite.json").is_file()
    monkeypatch.setenv("TREEATTN_SHARED", str(tmp_path))
    assert find_shared() == tmp_path
    monkeypatch.setenv("TREEATTN_SHARED", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="TREEATTN_SHARED"):
        find_shared()


# ---------------------------------------------------------------------------- block tables
def check_block_tree(tree, tables, lens, page_size):
    assert tree.num_queries == len(lens)
    assert np.array_equal(tree.visible_tokens, lens)
    for q, (table, n) in enumerate(zip(tables, lens)):
        expect = (np.asarray(table)[:, None] * page_size + np.arange(page_size)).reshape(-1)[:n]
        assert np.array_equal(visible_slots(tree, q), expect)
    # maximal compression: a node with a single child has a request ending in it
    kids = np.bincount(tree.parents[tree.parents >= 0], minlength=tree.num_nodes)
    ends = np.bincount(tree.query_nodes, minlength=tree.num_nodes)
    assert np.all((kids != 1) | (ends > 0))
    # siblings never start with the same (slot, first-page fill) key
    first = [(int(tree.parents[v]), int(node_slots(tree, v)[0]),
              min(page_size, int(tree.lengths[v]))) for v in range(tree.num_nodes)]
    assert len(set(first)) == len(first)


def test_block_tables_share_leading_pages():
    tables, lens = [[0, 1, 2], [0, 1, 3], [0, 1], [0, 4]], [40, 40, 30, 20]
    tree = tree_from_block_tables(tables, lens, page_size=16, num_pages=8)
    check_block_tree(tree, tables, lens, 16)
    assert tree.num_nodes == 6 and tree.num_slots == 128 and tree.page_size == 16
    # requests 0 and 1 share the nodes of pages 0 and 1 (full); request 2 fills page 1 to 14 only
    n0, n1, n2 = (int(x) for x in tree.query_nodes[:3])
    assert tree.parents[n0] == tree.parents[n1] and tree.parents[n0] != n2
    assert tree.parents[tree.parents[n0]] == tree.parents[n2] == 0
    assert np.array_equal(tree_from_block_tables(np.array(tables[:2]), lens[:2], page_size=16).kv_indices,
                          tree_from_block_tables(tables[:2], lens[:2], page_size=16).kv_indices)


def test_block_tables_chain_compression():
    tables, lens = [[7, 1, 2, 3], [7, 1, 2, 5, 6]], [64, 70]
    tree = tree_from_block_tables(tables, lens, page_size=16)
    check_block_tree(tree, tables, lens, 16)
    assert tree.lengths.tolist() == [48, 16, 22] and tree.parents.tolist() == [-1, 0, 0]


def test_partial_page_sharing_rule():
    same = tree_from_block_tables([[0, 1], [0, 1]], [20, 20], page_size=16)
    assert same.num_nodes == 1 and same.query_nodes.tolist() == [0, 0]
    diff = tree_from_block_tables([[0, 1], [0, 1]], [20, 24], page_size=16)
    assert diff.num_nodes == 3 and sorted(diff.lengths.tolist()) == [4, 8, 16]
    check_block_tree(diff, [[0, 1], [0, 1]], [20, 24], 16)
    # a request ending at a full page continues into another request's path (query inside the path)
    inner = tree_from_block_tables([[0, 1], [0, 1, 2]], [32, 40], page_size=16)
    assert inner.lengths.tolist() == [32, 8] and inner.query_nodes.tolist() == [0, 1]
    check_block_tree(inner, [[0, 1], [0, 1, 2]], [32, 40], 16)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_block_tables_random(data):
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    base = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    tables, lens = [], []
    for _ in range(data.draw(st.integers(1, 6))):
        keep = data.draw(st.integers(0, len(base)))
        table = base[:keep] + data.draw(st.lists(st.integers(0, 9), min_size=0 if keep else 1, max_size=3))
        tables.append(table)
        lens.append(data.draw(st.integers((len(table) - 1) * page_size + 1, len(table) * page_size)))
    tree = tree_from_block_tables(tables, lens, page_size=page_size, num_pages=10)
    check_block_tree(tree, tables, lens, page_size)


@pytest.mark.parametrize("tables, lens, kwargs, match", [
    ([[0]], [20], {}, "request 0: block table has 1 pages"),
    ([[0, 1], [2]], [20, 0], {}, "request 1 has length 0"),
    ([[0, 1], [2, 9]], [20, 20], {"num_pages": 8}, "request 1: page 9"),
    ([[0, -1]], [20], {}, "request 0: page -1"),
    ([[0, 1]], [20, 20], {}, "one block table per request"),
])
def test_block_tables_errors(tables, lens, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tree_from_block_tables(tables, lens, page_size=16, **kwargs)


# ---------------------------------------------------------------------------- Tree-of-Thoughts
@pytest.mark.parametrize("name", ["sorting", "docmerge", "keyword", "set"])
@pytest.mark.parametrize("index", [0, 3])
def test_tot_templates(name, index):
    files = {"sorting": "sorting128ToT", "docmerge": "docmergeToT", "keyword": "keywordToT", "set": "set128ToT"}
    path = find_shared() / "workloads" / "deft" / "reasoning" / f"{files[name]}.json"
    nodes = json.loads(path.read_text())[index]["data"]
    ids = sorted(int(k) for k in nodes)
    tree = tree_from_tot_template(name, index)
    assert tree.num_nodes == len(ids) and int((tree.parents < 0).sum()) == 1
    leaves = [i for i, k in enumerate(ids) if not nodes[str(k)]["children"]]
    assert tree.query_nodes.tolist() == leaves
    assert np.array_equal(tree.query_prefix, tree.lengths[leaves])
    assert tree.lengths.tolist() == [max(1, nodes[str(k)]["value"]) for k in ids]
    assert tree_from_tot_template(path, index).num_tokens == tree.num_tokens
    small = tree_from_tot_template(name, index, scale=0.1)
    assert small.num_queries == tree.num_queries and small.num_tokens < tree.num_tokens


def write_tot(tmp_path, data):
    path = tmp_path / "tot.json"
    path.write_text(json.dumps([{"data": data}]))
    return path


def tot_node(i, value, children):
    return {"id": i, "value": value, "start": 0, "end": value, "children": children}


@pytest.mark.parametrize("data, match", [
    ({"0": {"id": 0, "value": 5}}, "lacks"),
    ({"0": tot_node(0, 5, [1])}, "child 1, which is not a node"),
    ({"0": tot_node(0, 5, [1, 2]), "1": tot_node(1, 2, [2]), "2": tot_node(2, 1, [])}, "two parents"),
    ({"0": tot_node(0, 5, []), "1": tot_node(1, 2, [2]), "2": tot_node(2, 1, [1])}, "cycle"),
    ({}, "no nodes"),
])
def test_tot_malformed(tmp_path, data, match):
    with pytest.raises(ValueError, match=match):
        tree_from_tot_template(write_tot(tmp_path, data))


def test_tot_empty_entry_and_bad_index():
    with pytest.raises(ValueError, match="no nodes"):
        tree_from_tot_template("keyword", 2)
    with pytest.raises(ValueError, match="no entry 1000"):
        tree_from_tot_template("set", 1000)


# ---------------------------------------------------------------------------- Medusa
@pytest.mark.parametrize("size", [32, 256, "APPS_tree_size64"])
def test_medusa_compress_same_visibility(size):
    ctx = 50
    plain = tree_from_medusa(size, context_len=ctx, compress=False)
    comp = tree_from_medusa(size, context_len=ctx, compress=True)
    path = find_shared() / "workloads" / "deft" / "speculative" / (
        f"tree_size{size}.json" if isinstance(size, int) else f"{size}.json")
    paths = json.loads(path.read_text())["Tree_Structure"]
    assert plain.num_queries == comp.num_queries == len(paths) + 1
    assert plain.num_nodes == len(paths) + 1 and comp.num_nodes < plain.num_nodes
    assert plain.num_tokens == comp.num_tokens == ctx + len(paths)
    assert np.any(comp.query_prefix[1:] > 1)  # queries inside merged nodes
    expect = [ctx] + [ctx + len(p) for p in paths]
    assert plain.visible_tokens.tolist() == comp.visible_tokens.tolist() == expect
    for q in range(plain.num_queries):
        a, b = visible_slots(plain, q), visible_slots(comp, q)
        assert a.size == expect[q]
        assert sorted(a.tolist()) == sorted(b.tolist())


def write_medusa(tmp_path, structure):
    path = tmp_path / "medusa.json"
    path.write_text(json.dumps({"Tree_ID": 0, "Tree_Structure": structure, "Token_Tree_size": 5,
                                "Records": [{"Accept_length": [1, 2]}]}))
    return path


def test_medusa_chain_layout(tmp_path):
    path = write_medusa(tmp_path, [[0], [1], [0, 0], [0, 0, 0]])
    tree = tree_from_medusa(path, context_len=4)
    assert tree.parents.tolist() == [-1, 0, 0] and tree.lengths.tolist() == [4, 3, 1]
    assert tree.query_nodes.tolist() == [0, 1, 2, 1, 1]
    assert tree.query_prefix.tolist() == [4, 1, 1, 2, 3]
    assert node_slots(tree, 1).tolist() == [4, 6, 7] and node_slots(tree, 2).tolist() == [5]
    assert medusa_records(path) == [{"Accept_length": [1, 2]}]


@pytest.mark.parametrize("structure, match", [
    ([[0], [0, 1, 0]], "no parent path"),
    ([[0], [0]], "duplicate"),
    ([[], [0]], "empty"),
])
def test_medusa_malformed(tmp_path, structure, match):
    with pytest.raises(ValueError, match=match):
        tree_from_medusa(write_medusa(tmp_path, structure), context_len=8)


def test_medusa_records_and_context_check():
    records = medusa_records(32)
    assert records and all("Accept_length" in r for r in records)
    assert isinstance(records[0]["Accept_length"], list)
    with pytest.raises(ValueError, match="context_len"):
        tree_from_medusa(32, context_len=0)


# ---------------------------------------------------------------------------- engine workloads
@pytest.fixture(scope="module")
def tiny_model(one_thread):
    from treeattn.engine import TreeModel
    return TreeModel.random("tiny")


def _run_workload(model, name, **kw):
    from treeattn.engine import TreeEngine, WorkloadSpec, build_workload
    eng = TreeEngine(model, page_size=8, kv_tokens=8192)
    start = eng.pool.num_free_pages
    ctl, total = build_workload(WorkloadSpec(name, vocab_size=model.config.vocab_size, **kw))
    return eng, start, ctl, total, eng.run(ctl)


def test_rollout_workload_ends_every_sample_and_frees_its_pages(tiny_model):
    from treeattn.engine.workloads import rollout_lengths
    eng, start, ctl, total, out = _run_workload(tiny_model, "rollout", n=4, num_prompts=3, max_new_tokens=20,
                                                prompt_len=12, seed=1)
    lengths = rollout_lengths((3, 4), 20, median=5.0, sigma=0.6, seed=1)
    assert total == 20 and len(out["leaves"]) == 12 and ctl.forced.tolist() == lengths.tolist()
    for leaf in out["leaves"]:
        gen = len(leaf["tokens"]) - 12
        forced = lengths[leaf["prompt"], leaf["sample"]]
        assert gen <= forced and (leaf["finished"] or gen == 20)
    if (lengths <= 20).all():
        assert eng.tree.num_nodes == 0 and eng.pool.num_free_pages == start
    again = _run_workload(tiny_model, "rollout", n=4, num_prompts=3, max_new_tokens=20, prompt_len=12, seed=1)[4]
    assert [leaf["tokens"] for leaf in again["leaves"]] == [leaf["tokens"] for leaf in out["leaves"]]


def test_rollout_lengths_are_capped_lognormal():
    from treeattn.engine.workloads import rollout_lengths
    x = rollout_lengths((200, 50), 64, median=16, sigma=0.7, seed=0)
    assert x.min() >= 1 and x.max() == 65 and 14 <= np.median(x) <= 18
    assert np.array_equal(x, rollout_lengths((200, 50), 64, median=16, sigma=0.7, seed=0))
    with pytest.raises(ValueError, match="median"):
        rollout_lengths((2, 2), 8, median=0, sigma=1, seed=0)


def test_best_of_n_workload_prunes_to_the_best(tiny_model):
    eng, start, ctl, total, out = _run_workload(tiny_model, "best-of-n", n=8, max_new_tokens=20, keep_every=4,
                                                keep_fraction=0.5, min_keep=1)
    assert total == 20 and ctl.selections == 3 and len(out["leaves"]) == 1   # 8 -> 4 -> 2 -> 1 at steps 4, 8, 12
    assert len(out["leaves"][0]["tokens"]) == 16 + 20 and [s.queries for s in eng.stats][:6] == [8] * 4 + [4] * 2
    eng.reset()
    assert eng.pool.num_free_pages == start
    # the same samples decoded without selection: the survivor is the best at every selection
    from treeattn.engine import Sampler, SamplingController
    full = eng.run(SamplingController(ctl.prompts, n=8, sampler=Sampler(seed=0), max_new_tokens=20,
                                      logprobs=True))["leaves"]
    alive = list(range(8))
    for k in (4, 8, 12):
        alive = sorted(alive, key=lambda j: -sum(full[j]["logprobs"][:k]))[: len(alive) // 2]
    assert alive == [out["leaves"][0]["sample"]]
    assert full[alive[0]]["tokens"] == out["leaves"][0]["tokens"]


@pytest.mark.parametrize("name, width", [("beam-4", 4), ("beam-8", 8), ("beam-16", 16), ("sample-16", 16)])
def test_sized_workloads(tiny_model, name, width):
    _, _, ctl, total, out = _run_workload(tiny_model, name, max_new_tokens=3)
    assert total == 3
    if name.startswith("beam"):
        assert ctl.k == width and len(out["sequences"]) == width
    else:
        assert len(out["leaves"]) == width


def test_bad_workload_sizes():
    from treeattn.engine import WorkloadSpec, build_workload
    for name in ("beam-0", "sample-x"):
        with pytest.raises(ValueError, match="positive integer"):
            build_workload(WorkloadSpec(name, vocab_size=16))
    with pytest.raises(ValueError, match="keep_fraction"):
        build_workload(WorkloadSpec("best-of-n", vocab_size=16, keep_fraction=1.0))
