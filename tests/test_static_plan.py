"""Graph-stable plans (treeattn.engine.static_plan): padding to capacity classes changes no
output, and plans of the same shape class share one signature (one CUDA graph)."""
import numpy as np
import pytest
import torch

from helpers import TOL, random_tree, rel_l2
from treeattn import STRATEGIES, HeadConfig, TreeAttention, make_plan, reference_attention
from treeattn.engine.static_plan import StaticPlanBuffer, capacity
from treeattn.workloads import tree_from_medusa, tree_from_spec

TREES = {
    "medusa": lambda rng: tree_from_medusa(32, context_len=45),
    "suite": lambda rng: tree_from_spec("1,3,9_40,10,4"),
    "random": lambda rng: random_tree(rng, 20, 30, roots=2, inner_queries=True),
    "one_query": lambda rng: tree_from_spec("1_19"),
}


def test_capacity_classes():
    assert [capacity(n) for n in (0, 1, 2, 3, 5, 16, 17, 1000)] == [0, 1, 2, 4, 8, 16, 32, 1024]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("tree_name", sorted(TREES))
def test_padded_plan_gives_the_same_attention(rng, device, strategy, tree_name):
    tree = TREES[tree_name](rng)
    heads = HeadConfig(8, 2, 64, torch.float32)
    n, pad = tree.num_queries, 3  # three padded queries, as in a graph bucket
    q = torch.randn(n + pad, 8, 64)
    k = torch.randn(tree.num_tokens, 1, 2, 64)
    v = torch.randn_like(k)
    o_ref, lse_ref = reference_attention(q[:n], k, v, tree)
    plan = make_plan(tree, heads, strategy=strategy)
    static = StaticPlanBuffer(device).place(plan, n + pad)
    sp = static.plan
    assert sp.num_queries == n + pad
    for x in sp.launches:  # every launch's grid is a capacity class
        assert x.work_end - x.work_start == capacity(x.work_end - x.work_start)
    assert sp.merge_q_indices.numel() == capacity(plan.merge_q_indices.numel())
    w = TreeAttention(torch.empty(sp.workspace_bytes() // 4 + 1, device=device), backend="triton")
    out = torch.full_like(q, float("nan"), device=device)
    lse = torch.full((n + pad, 8), float("nan"), device=device)
    w.run(q.to(device), k.to(device), v.to(device), sp, out=out, lse=lse)
    assert rel_l2(out[:n].cpu(), o_ref) <= TOL[torch.float32]
    assert rel_l2(lse[:n].cpu(), lse_ref) <= 1e-5


def test_plans_of_one_shape_class_share_a_signature(rng):
    """Two steps of a growing tree: same classes -> same signature (and tensor addresses);
    a different class or bucket -> a different one."""
    heads = HeadConfig(8, 2, 64, torch.float16)
    buf = StaticPlanBuffer("cpu")
    sigs, ptrs = [], []
    for ctx in (300, 301, 302):
        plan = make_plan(tree_from_medusa(32, context_len=ctx), heads, strategy="flatten")
        sp = buf.place(plan, 48)
        sigs.append(sp.signature)
        ptrs.append(sp.plan.kv_indices.data_ptr())
    assert sigs[0] == sigs[1] == sigs[2] and ptrs[0] == ptrs[1] == ptrs[2]
    plan = make_plan(tree_from_medusa(32, context_len=300), heads, strategy="flatten")
    assert buf.place(plan, 64).signature != sigs[0]
    other = buf.place(make_plan(tree_from_medusa(32, context_len=5000), heads, strategy="flatten"), 48)
    assert other.signature != sigs[0]


def test_place_rejects_too_few_queries_and_device_plans():
    plan = make_plan(tree_from_spec("1,4_20,3"), HeadConfig(4, 4, 32))
    buf = StaticPlanBuffer("cpu")
    with pytest.raises(ValueError, match="cannot pad"):
        buf.place(plan, plan.num_queries - 1)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="host"):
            buf.place(make_plan(tree_from_spec("1,4_20,3"), HeadConfig(4, 4, 32), device="cuda"), 8)
