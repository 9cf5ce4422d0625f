"""The workload-shaped tree set (:mod:`treeattn.tree.families`) and the leave-one-family-out
cross-validation of ``auto``'s choice (:mod:`treeattn.plan.select.crossval`)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from treeattn import STRATEGIES, TreeAttention, reference_attention
from treeattn.bench.timing import roofline_us
from treeattn.cli.main import main
from treeattn.plan import PLANNERS
from treeattn.plan.select.crossval import choose, cross_validate, timed_cases
from treeattn.tree import (WORKLOAD_FAMILIES, tree_by_name, tree_family, workload_names, workload_tree,
                           workload_trees)

@pytest.fixture(scope="module")
def full():
    return workload_trees()


def test_the_set_covers_every_family_with_named_valid_trees(full):
    names = [w.name for w in full]
    assert 40 <= len(full) <= 80 and len(set(names)) == len(names) and names == workload_names()
    assert {w.family for w in full} == set(WORKLOAD_FAMILIES)
    for w in full:
        t = w.tree
        assert t.num_queries >= 1 and tree_family(w.name) == w.family
        # every token is seen by some query (nothing finished is left behind)
        assert int(t.node_extent.sum()) == t.num_tokens, w.name
    by = {w.name: w.tree for w in full}
    assert by["best-of-16-keep4-p1500-g48"].num_tokens == 1692 and by["best-of-16-keep4-p1500-g48"].num_queries == 4
    assert all(by[n].num_queries == int(n.split("-")[1][1:]) for n in names if n.startswith("beam-"))
    assert all(16384 <= by[n].lengths[0] <= 65536 for n in names if n.startswith("doc-qa"))
    rooflines = [roofline_us(w.tree.num_tokens, w.tree.num_queries, 32, 8, 128, 4.25e12) for w in full]
    assert sum(r < 15 for r in rooflines) >= 10 and max(rooflines) > 50  # small decode steps and large ones


def test_trees_are_deterministic_and_scale_keeps_their_shape(full):
    small = workload_trees(["beam", "rl-group", "speculative"], scale=1 / 16)
    for w in small:
        one = workload_tree(w.name)  # built again: the same tree
        before = next(x for x in full if x.name == w.name).tree
        assert one.family == w.family
        assert np.array_equal(one.tree.parents, before.parents) and np.array_equal(one.tree.lengths, before.lengths)
        assert np.array_equal(w.tree.parents, before.parents)
        assert np.array_equal(w.tree.query_nodes, before.query_nodes)
        assert w.tree.num_tokens < before.num_tokens
    assert tree_by_name("1,2_8,4").num_tokens == 16 and tree_family("1,2_8,4") == "suite-2-level"
    assert [tree_family(s) for s in ("2,4_8,4", "1,2,4_8,4,2", "1,2,4,8,16_1,1,1,1,1")] == \
        ["suite-forest", "suite-3-4-level", "suite-deep"]
    with pytest.raises(ValueError, match="unknown workload families"):
        workload_trees(["beams"])
    with pytest.raises(ValueError, match="no workload tree named"):
        workload_tree("beam-k3")
    with pytest.raises(ValueError, match="scale must be positive"):
        workload_trees(["beam"], scale=0)


@pytest.mark.parametrize("family", WORKLOAD_FAMILIES)
def test_every_strategy_is_exact_on_the_familys_smallest_tree(one_thread, family):
    """Every strategy's plan of the family's smallest tree (lengths / 32), run by the torch backend
    in float64, against the float64 reference."""
    w = min(workload_trees([family], scale=1 / 32), key=lambda w: w.tree.num_tokens)
    tree, gen = w.tree, torch.Generator().manual_seed(0)
    q = torch.randn(tree.num_queries, 4, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(tree.num_tokens, 1, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    ref, _ = reference_attention(q, k, v, tree)
    wrapper = TreeAttention(backend="torch")
    for s in STRATEGIES:
        plan = wrapper.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float64, strategy=s)
        err = (wrapper.run(q, k, v, plan) - ref).abs().max().item()
        assert err < 1e-12, f"{w.name} {s}: max error {err}"


def test_the_triton_kernel_is_exact_on_a_small_beam_tree(one_thread, device):
    tree = workload_tree("beam-k4-p1024-g64", scale=1 / 64).tree
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(tree.num_queries, 4, 16, generator=gen)
    k, v = (torch.randn(tree.num_tokens, 1, 2, 16, generator=gen) for _ in range(2))
    ref, _ = reference_attention(q, k, v, tree, dtype=torch.float64)
    w = TreeAttention(device=device, backend="triton")
    # (node: one item a node, merged per query; auto takes one unmerged launch at this size)
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, strategy="node")
    out = w.run(q.to(device), k.to(device), v.to(device), plan)
    assert (out.double().cpu() - ref).abs().max().item() < 1e-5


def _result(trees, heads=((32, 8),)) -> dict:
    """A bench kernels result timing every strategy: each tree's ``sequence`` plan 5 us, the others 10 us."""
    graph_us = {"auto": 10.0, **{s: 10.0 for s in PLANNERS}, "sequence": 5.0}
    rows = [{"tree": t, "hq": hq, "hkv": hkv, "graph_us": dict(graph_us)} for t in trees for hq, hkv in heads]
    return {"device": "NVIDIA H200", "dtype": "float16", "head_dim": 128, "streams": 0, "pdl": True, "tma": True,
            "rows": rows}


def test_cross_validation_scores_the_held_out_familys_choices(tmp_path, capsys):
    trees = ["1,4_40,8", "2,6_30,9", "best-of-16-keep4-p1500-g48", "beam-k4-p1024-g64"]
    result = _result(trees)
    cases = timed_cases([result])
    assert [c.family for c in cases] == ["suite-2-level", "suite-forest", "best-of-n", "beam"]
    report = cross_validate(cases, names=("sm_bandwidth", "mask_cost"), rounds=1, points=3)
    assert set(report["families"]) == {"suite-2-level", "suite-forest", "best-of-n", "beam"}
    for case in cases:  # under the run's constants: 1.0 where auto picks sequence, else 2.0
        got = report["families"][case.family]["as_is"]
        assert got["worst"] == (1.0 if choose(case) == "sequence" else 2.0) and got["cases"] == 1
    pooled = report["all"]["refit"]
    assert pooled["cases"] == 4 and all(1.0 <= c[3] <= 2.0 for c in pooled["choices"])
    # the CLI: the same report, printed and written
    path, out = tmp_path / "kernels.json", tmp_path / "cv.json"
    path.write_text(json.dumps(result))
    argv = ["calibrate", "--cross-validate", str(path), "--refit", "sm_bandwidth", "--out", str(out)]
    assert main(argv) == 0
    assert "each family left out" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["constants"] == ["sm_bandwidth"] and written["results"] == [str(path)]
    with pytest.raises(SystemExit) as exit_:  # a zero cannot be refitted
        main(argv[:-2] + ["--refit", "launch_overhead_s"])
    assert exit_.value.code == 2


def test_cross_validation_needs_every_strategy_and_two_families():
    result = _result(["1,4_40,8"])
    with pytest.raises(ValueError, match="two families or more"):
        cross_validate(timed_cases([result]))
    del result["rows"][0]["graph_us"]["paths"]
    with pytest.raises(ValueError, match=r"no graph_us for \['paths'\]"):
        timed_cases([result])
