"""Persistent launches (``Launch.programs``): fewer programs than units x KV heads, each looping
over them in the grid's order, give the reference output for every planner, with and without a
tree mask, the heads-inner grid and the last launch's merge."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import TOL, random_tree, rel_l2

from treeattn import TreeAttention
from treeattn.plan.cost import CostModel
from treeattn.reference import reference_attention
from treeattn.workloads import tree_from_spec


def persistent(plan, programs: int):
    """``plan`` with every launch persistent over at most ``programs`` programs."""
    return dataclasses.replace(plan, launches=tuple(dataclasses.replace(ln, programs=programs)
                                                    for ln in plan.launches))


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
                         cost=CostModel(side_streams=True, tall_first_s=0.0, merge_last_min_group=1))
    plan = attn.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, strategy="node")
    assert plan.merge_last and len(plan.launches) > 1
    q = torch.randn(tree.num_queries, 8, 32, dtype=torch.float64)
    k = torch.randn(tree.num_tokens, 1, 2, 32, dtype=torch.float64)
    v = torch.randn_like(k)
    ref = reference_attention(q, k, v, tree)[0]
    out = attn.run(*[t.float().to(device) for t in (q, k, v)], persistent(plan, 2))
    assert rel_l2(out, ref) <= TOL[torch.float32]
