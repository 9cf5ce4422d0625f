"""The Triton kernels (under TRITON_INTERPRET=1 on CPU) and the torch backend against a float64
reference, over strategies, tree shapes, page sizes, GQA ratios, head dims and dtypes.

The full grid is too large for CI's two cores, so each axis is covered by a sampled case list
in which every strategy, dtype, head dim, GQA ratio, page size and tree family appears."""
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import TOL, forests, paged_case, paged_copy, random_tree, rel_l2
from treeattn import STRATEGIES, TreeAttention, reference_attention
from treeattn.plan import CostModel
from treeattn.plan.select.profiles import H200
from treeattn.tree import tree_from_medusa, tree_from_spec

TREES = {
    "suite_deep": lambda rng: tree_from_spec("1,2,4,8_16,8,8,3"),
    "suite_forest": lambda rng: tree_from_spec("2,8,16_24,12,5"),
    "suite_wide": lambda rng: tree_from_spec("1,24_40,3"),
    "medusa": lambda rng: tree_from_medusa(32, context_len=45),
    "random": lambda rng: random_tree(rng, 25, 30, roots=2),
    "random_inner_queries": lambda rng: random_tree(rng, 20, 20, roots=1, inner_queries=True),
    "chain": lambda rng: tree_from_spec("1,1,1,1,1_7,9,1,13,2"),
    "one_node": lambda rng: tree_from_spec("1_19"),
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEADS = ((4, 4), (8, 2), (8, 1))  # MHA, GQA 4, GQA 8
DIMS = (64, 96, 128)
PAGES = (1, 16)


def _cases():
    combos = []
    for i, (strategy, tree) in enumerate(itertools.product(STRATEGIES, TREES)):
        combos.append((strategy, tree, DTYPES[i % 3], HEADS[(i // 3) % 3], DIMS[(i // 2) % 3],
                       PAGES[i % 2]))
    return combos


#: where the Triton tests run the kernels: the GPU when there is one, else the interpreter on CPU
#: (tensors are made on the CPU, with the host's random generator, and moved)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,tree_name,dtype,heads,head_dim,page_size", _cases())
def test_triton_matches_float64_reference(rng, strategy, tree_name, dtype, heads, head_dim, page_size):
    tree = TREES[tree_name](rng)
    hq, hkv = heads
    q = torch.randn(tree.num_queries, hq, head_dim).to(dtype)
    k = torch.randn(tree.num_tokens, hkv, head_dim).to(dtype)
    v = torch.randn(tree.num_tokens, hkv, head_dim).to(dtype)
    paged, kc, vc = paged_copy(tree, k, v, page_size, rng)
    o_ref, lse_ref = reference_attention(q, kc, vc, paged)
    w = TreeAttention(device=DEVICE, backend="triton")
    plan = w.plan(paged, num_qo_heads=hq, num_kv_heads=hkv, head_dim=head_dim, dtype=dtype, strategy=strategy)
    q, kc, vc = on_device(q, kc, vc)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    lse = torch.full((tree.num_queries, hq), float("nan"), device=DEVICE)
    w.run(q, kc, vc, plan, out=out, lse=lse)
    assert rel_l2(out, o_ref) <= TOL[dtype]
    assert rel_l2(lse, lse_ref) <= 1e-5


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_backend_matches_reference(rng, strategy, dtype):
    tree = random_tree(rng, 60, 40, roots=3, inner_queries=True)
    q = torch.randn(tree.num_queries, 8, 32, dtype=dtype)
    k = torch.randn(tree.num_tokens, 1, 2, 32, dtype=dtype)
    v = torch.randn(tree.num_tokens, 1, 2, 32, dtype=dtype)
    o_ref, lse_ref = reference_attention(q, k, v, tree)
    w = TreeAttention(backend="torch")
    plan = w.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=dtype, strategy=strategy)
    out, lse = w.run(q, k, v, plan, return_lse=True)
    assert rel_l2(out, o_ref) <= TOL[dtype]
    assert rel_l2(lse, lse_ref) <= 1e-6


def test_plan_is_reused_across_layers(rng):
    tree = tree_from_spec("1,3,9_20,10,4")
    w = TreeAttention(device=DEVICE, backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, strategy="greedy")
    for _ in range(3):
        q, k, v = on_device(torch.randn(tree.num_queries, 4, 64), torch.randn(tree.num_tokens, 1, 2, 64),
                            torch.randn(tree.num_tokens, 1, 2, 64))
        assert rel_l2(w.run(q, k, v, plan), reference_attention(q, k, v, tree)[0]) <= 1e-4


def test_sm_scale_and_large_logits(rng):
    tree = tree_from_spec("1,4_33,5")
    q = torch.randn(tree.num_queries, 2, 64, device=DEVICE) * 30  # large logits: online softmax must stay finite
    k = torch.randn(tree.num_tokens, 1, 2, 64, device=DEVICE)
    v = torch.randn(tree.num_tokens, 1, 2, 64, device=DEVICE)
    w = TreeAttention(device=DEVICE, backend="triton")
    plan = w.plan(tree, num_qo_heads=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, strategy="flatten")
    out = w.run(q, k, v, plan, sm_scale=0.3)
    assert rel_l2(out, reference_attention(q, k, v, tree, sm_scale=0.3)[0]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=4)
@given(tree=forests(max_nodes=30, max_len=40), page_size=st.sampled_from(PAGES),
       seed=st.integers(0, 2**31))
def test_triton_random_forests(strategy, tree, page_size, seed):
    rng = np.random.default_rng(seed)
    q = torch.randn(tree.num_queries, 4, 64)
    k = torch.randn(tree.num_tokens, 1, 64)
    v = torch.randn(tree.num_tokens, 1, 64)
    paged, kc, vc = paged_copy(tree, k, v, page_size, rng)
    w = TreeAttention(device=DEVICE, backend="triton")
    plan = w.plan(paged, num_qo_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float32, strategy=strategy)
    assert rel_l2(w.run(*on_device(q, kc, vc), plan), reference_attention(q, kc, vc, paged)[0]) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@given(tree=forests(max_nodes=300, max_len=300), page_size=st.sampled_from(PAGES),
       seed=st.integers(0, 2**31))
def test_torch_backend_random_forests(strategy, tree, page_size, seed):
    rng = np.random.default_rng(seed)
    q = torch.randn(tree.num_queries, 2, 16, dtype=torch.float64)
    k = torch.randn(tree.num_tokens, 2, 16, dtype=torch.float64)
    v = torch.randn(tree.num_tokens, 2, 16, dtype=torch.float64)
    paged, kc, vc = paged_copy(tree, k, v, page_size, rng)
    w = TreeAttention(backend="torch")
    plan = w.plan(paged, num_qo_heads=2, num_kv_heads=2, head_dim=16, dtype=torch.float64, strategy=strategy)
    assert rel_l2(w.run(q, kc, vc, plan), reference_attention(q, kc, vc, paged)[0]) <= 1e-10


@pytest.mark.parametrize("strategy,spec,hkv", [("sequence", "3_600", 2), ("node", "1,4_300,70", 4),
                                               ("flatten", "1,3_40,9", 1)])
def test_heads_inner_grid_order_matches_reference(rng, device, strategy, spec, hkv):
    """A launch whose grid runs a work unit's KV heads side by side (``heads_inner``; the builder
    sets it for long work units) computes the same result; forced on every launch here."""
    tree = tree_from_spec(spec)
    q, k, v = (torch.randn(n, h, 32, device=device) for n, h in ((tree.num_queries, 4), (tree.num_tokens, hkv),
                                                                  (tree.num_tokens, hkv)))
    w = TreeAttention(device=device, backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=hkv, head_dim=32, dtype=torch.float32,
                  strategy=strategy)
    inner = dataclasses.replace(plan, launches=tuple(dataclasses.replace(ln, heads_inner=True)
                                                     for ln in plan.launches))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((tree.num_queries, 4), float("nan"), device=device)
    w.run(q, k[:, None], v[:, None], inner, out=out, lse=lse)
    o_ref, lse_ref = reference_attention(q, k[:, None], v[:, None], tree)
    assert rel_l2(out, o_ref) <= 1e-4 and rel_l2(lse, lse_ref) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("strategy,spec,hkv", [("sequence", "3_600", 2), ("node", "1,4_300,70", 4),
                                               ("pack", "1,3_129,33", 1), ("flatten", "1,3_40,9", 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_tail_matches_reference(rng, device, strategy, spec, hkv, dtype):
    """``split_tail`` (whole KV tiles through the select-free step, a unit's partial last tile
    after the loop; the builder sets it for tall unmasked launches) computes the same result on
    units of odd lengths; forced on every launch here (masked launches ignore it)."""
    tree = tree_from_spec(spec)
    q, k, v = (torch.randn(n, h, 32, device=device).to(dtype) for n, h in (
        (tree.num_queries, 4), (tree.num_tokens, hkv), (tree.num_tokens, hkv)))
    _assert_split_tails_match_reference(tree, q, k, v, strategy)


def _assert_split_tails_match_reference(tree, q, k, v, strategy):
    """``strategy``'s plan of ``tree`` with ``split_tail`` forced on every launch, run over ``q
    [Q, 4, 32]`` and contiguous ``k``, ``v [T, Hkv, 32]`` (page size 1), against the float64
    reference (fp32 1e-4, 16 bits 1e-2 relative L2)."""
    w = TreeAttention(device=q.device, backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=k.shape[1], head_dim=32, dtype=q.dtype, strategy=strategy)
    tails = dataclasses.replace(plan, launches=tuple(dataclasses.replace(ln, split_tail=True)
                                                     for ln in plan.launches))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((tree.num_queries, 4), float("nan"), device=q.device)
    w.run(q, k[:, None], v[:, None], tails, out=out, lse=lse)
    o_ref, lse_ref = reference_attention(q.double(), k[:, None].double(), v[:, None].double(), tree)
    tol = 1e-4 if q.dtype == torch.float32 else 1e-2
    assert rel_l2(out.double(), o_ref) <= tol and rel_l2(lse.double(), lse_ref) <= tol


@pytest.mark.parametrize("ramp", [0.05, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_whole_tiles_with_growing_scores_match_reference(device, dtype, ramp):
    """The select-free step over whole unmasked KV tiles keeps the running max and rescales
    the state as scores grow along the sequence, by a little (``ramp`` 0.05) or by a lot (1.0:
    in 16 bits a stale max would overflow ``p``), and gives the reference's result."""
    tree = tree_from_spec("1,3_600,70")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(tree.num_queries, 4, 32, generator=g)
    scale = (1.0 + ramp * torch.arange(tree.num_tokens) / 64.0)[:, None, None]
    k = torch.randn(tree.num_tokens, 2, 32, generator=g) * scale
    v = torch.randn(tree.num_tokens, 2, 32, generator=g)
    _assert_split_tails_match_reference(tree, *(t.to(dtype).to(device) for t in (q, k, v)), "node")


@pytest.mark.slow
@pytest.mark.parametrize("strategy,spec", [("node", "1,4,16_300,40,9"), ("pack", "2,8_300,20"), ("flatten", "2,8_64,20")])
def test_tall_first_launch_order_matches_reference(rng, device, strategy, spec):
    """Running a plan's launches tallest first (``Plan.tall_first``: the builder sets it when a
    program is long; forced here) computes the same result."""
    tree = tree_from_spec(spec)
    q, k, v = (torch.randn(n, h, 32, device=device) for n, h in ((tree.num_queries, 8), (tree.num_tokens, 2),
                                                                  (tree.num_tokens, 2)))
    w = TreeAttention(device=device, backend="triton")
    plan = w.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32, strategy=strategy)
    assert len(plan.launches) > 1
    out = torch.full_like(q, float("nan"))
    lse = torch.full((tree.num_queries, 8), float("nan"), device=device)
    w.run(q, k[:, None], v[:, None], dataclasses.replace(plan, tall_first=not plan.tall_first), out=out, lse=lse)
    o_ref, lse_ref = reference_attention(q.double(), k[:, None].double(), v[:, None].double(), tree)
    assert rel_l2(out.double(), o_ref) <= 1e-4 and rel_l2(lse.double(), lse_ref) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("strategy,spec,tall_first", [
    ("node", "2,8_300,20", False), ("greedy", "1,4,16_300,40,9", True), ("node", "1,20_400,20", True),
    ("node_chunk", "1,2,8_40,24,5", False), ("flatten", "2,8_30,9", True), ("flatten", "2,8_300,20", False),
    ("node", "1,3_600,5", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_last_launch_merges_like_the_merge_launch(rng, device, strategy, spec, tall_first, dtype):
    """``Plan.merge_last``: the launch that runs last (the first with ``tall_first``) folds each
    query's other partial rows, written by the launches before it, into its own row and writes
    the output and LSE: no merge launch. It matches the float64 reference and the merge launch."""
    from treeattn.launchers import merge_partials, partial_attention

    tree, hq, hkv, d = tree_from_spec(spec), 8, 2, 32
    q = torch.randn(tree.num_queries, hq, d).to(dtype)
    k, v = (torch.randn(tree.num_tokens, hkv, d).to(dtype) for _ in range(2))
    paged, kc, vc = paged_copy(tree, k, v, 16, rng)
    o_ref, lse_ref = reference_attention(q.double(), kc.double(), vc.double(), paged)
    q, kc, vc = (t.to(device) for t in (q, kc, vc))
    w = TreeAttention(device=device, backend="triton", streams=0, cost=CostModel(
        side_streams=tall_first, profile=dataclasses.replace(H200, tall_first_s=0.0, merge_last_min_group=1)))
    plan = w.plan(paged, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype, strategy=strategy)
    assert plan.merge_last and plan.tall_first == tall_first and plan.merge_q_indices.numel() > 0
    w._workspace.fill_(float("nan"))  # (the last launch writes no partial row the output needs)
    out, lse = w.run(q, kc, vc, plan, return_lse=True)
    assert rel_l2(out.double().cpu(), o_ref) <= TOL[dtype] and rel_l2(lse.double().cpu(), lse_ref) <= TOL[dtype]
    # the same plan through the partial rows and the merge launch
    o_part, lse_part = w.partial_buffers(plan)
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    partial_attention(q, kc, vc, plan, o_part, lse_part, sm_scale=d ** -0.5, out=out2, lse_out=lse2)
    merge_partials(o_part, lse_part, plan.merge_q_indices, plan.merge_indptr, plan.merge_indices, out2, lse2,
                   max_rows=plan.merge_rows_max)
    assert rel_l2(out.float(), out2.float()) <= TOL[dtype] and rel_l2(lse, lse2) <= 1e-5


@pytest.mark.parametrize("strategy,spec,last", [("paths", "1,2,4,8_16,8,8,3", False), ("node", "1,20_400,20", True),
                                                 ("sequence", "3_600", False)])
def test_int64_offsets_match_int32_ones(rng, device, monkeypatch, strategy, spec, last):
    """The kernel takes int64 element offsets (``WIDE``) only where a tensor spans 2^31
    elements, too large for a test: with that test forced, the masked, gathered, contig and
    merging launches give the int32 path's output."""
    import treeattn.launchers as ops

    tree, hq, hkv, d = tree_from_spec(spec), 8, 2, 32
    q = torch.randn(tree.num_queries, hq, d)
    k, v = (torch.randn(tree.num_tokens, hkv, d) for _ in range(2))
    paged, kc, vc = paged_copy(tree, k, v, 16, rng)
    o_ref, _ = reference_attention(q.double(), kc.double(), vc.double(), paged)
    q, kc, vc = (t.to(device) for t in (q, kc, vc))
    w = TreeAttention(device=device, backend="triton", streams=0, cost=CostModel(
        side_streams=last, profile=dataclasses.replace(H200, tall_first_s=0.0, merge_last_min_group=1 if last else 64)))
    plan = w.plan(paged, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, strategy=strategy)
    assert plan.merge_last == last
    launched = []  # (WIDE of every attention launch)
    keep = ops._keep
    monkeypatch.setattr(ops, "_keep", lambda kernel, grid, args, kwargs: (
        launched.append(kwargs.get("WIDE")), keep(kernel, grid, args, kwargs))[1])
    narrow = w.run(q, kc, vc, plan)
    assert launched and not any(launched)
    launched.clear()
    monkeypatch.setattr(ops, "_wide", lambda *args: True)
    wide = w.run(q, kc, vc, w.plan(paged, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=torch.float32,
                                   strategy=strategy))
    assert {x for x in launched if x is not None} == {True}
    assert rel_l2(wide.double().cpu(), o_ref) <= TOL[torch.float32]
    assert rel_l2(wide.double().cpu(), narrow.double().cpu()) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams and PDL are CUDA launch modes")
@pytest.mark.parametrize("spec", ["1,8,64_512,256,32", "2,8_300,20"])
def test_last_launch_merge_on_one_stream_matches_side_streams(spec):
    """On the GPU, the default launch mode (one stream, PDL on Hopper: the last launch merges) and
    side streams with the merge launch give the same output within fp16 rounding, eagerly and
    replayed from a CUDA graph."""
    from treeattn.bench.timing import capture

    tree = tree_from_spec(spec)
    q, k, v = (torch.randn(n, h, 128, device="cuda", dtype=torch.float16)
               for n, h in ((tree.num_queries, 32), (tree.num_tokens, 8), (tree.num_tokens, 8)))
    mode = TreeAttention(device="cuda").cost  # the default launch mode's, folding at any GQA group
    one = TreeAttention(device="cuda", cost=dataclasses.replace(
        mode, profile=dataclasses.replace(mode.profile, merge_last_min_group=1)))
    side = TreeAttention(device="cuda", streams=3, pdl=False)
    plan = one.plan(tree, num_qo_heads=32, num_kv_heads=8, head_dim=128, strategy="node")
    assert plan.merge_last
    want = torch.empty_like(q)
    graph = capture(side, side.plan(tree, num_qo_heads=32, num_kv_heads=8, head_dim=128, strategy="node"),
                    q, k[:, None], v[:, None], want)
    graph.replay()
    out = one.run(q, k[:, None], v[:, None], plan)
    replayed = torch.full_like(q, float("nan"))
    capture(one, plan, q, k[:, None], v[:, None], replayed).replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out) and rel_l2(out.float(), want.float()) <= 1e-3


def test_merge_last_needs_a_plan_that_allows_it(device):
    """Asking the kernels to merge in the last launch of a plan without ``merge_last`` (one
    launch; or beside side streams) is an error, not a wrong output."""
    from treeattn.launchers import partial_attention

    tree = tree_from_spec("1,3_600,5")
    w = TreeAttention(device=device, backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, strategy="sequence")
    assert not plan.merge_last
    q = torch.randn(tree.num_queries, 4, 32, device=device)
    kc = torch.randn(tree.num_tokens, 1, 2, 32, device=device)
    o_part, lse_part = w.partial_buffers(plan)
    with pytest.raises(ValueError, match="merge_last"):
        partial_attention(q, kc, kc, plan, o_part, lse_part, sm_scale=0.1, out=torch.empty_like(q),
                          merge_last=True)


def test_builder_orders_heads_inner_for_long_work_units():
    """Long work units (>= the profile's heads_inner_min_tokens KV tokens on average in a launch)
    get the heads-inner grid order; short ones, and items with several query tiles, keep the
    work-unit-major order."""
    w = TreeAttention(backend="triton", cost=CostModel(target_programs=1))  # no KV split
    min_tokens = w.cost.profile.heads_inner_min_tokens
    long_plan = w.plan(tree_from_spec(f"4_{min_tokens}"), num_qo_heads=8, num_kv_heads=2,
                       head_dim=32, strategy="sequence")
    short_plan = w.plan(tree_from_spec("4_100"), num_qo_heads=8, num_kv_heads=2, head_dim=32,
                        strategy="sequence")
    tiled_plan = w.plan(tree_from_spec(f"1,64_{min_tokens},1"), num_qo_heads=8, num_kv_heads=2,
                        head_dim=32, strategy="node")
    assert all(ln.heads_inner for ln in long_plan.launches)
    assert not any(ln.heads_inner for ln in short_plan.launches)
    assert not any(ln.heads_inner for ln in tiled_plan.launches)
    assert max(ln.block_m for ln in tiled_plan.launches) == 128  # the root item: 256 rows, 2 tiles


@pytest.mark.parametrize("strategy,spec", [("sequence", "1,3_9,5"), ("flatten", "1,3_600,5"),
                                           ("greedy", None)])
def test_single_row_queries_skip_the_merge(rng, device, strategy, spec):
    """A query's only partial row is written to ``out``/``lse`` by the attention kernel; only
    queries with several rows go through the workspace and the merge. Poisoned workspace rows
    of direct queries must not leak into the output."""
    # (a fixed random forest with queries on inner nodes: some queries see one item, some more)
    tree = tree_from_spec(spec) if spec else random_tree(np.random.default_rng(0), 20, 20, roots=2,
                                                         inner_queries=True)
    q, k, v = (torch.randn(n, h, 32, device=device) for n, h in ((tree.num_queries, 4), (tree.num_tokens, 2),
                                                                  (tree.num_tokens, 2)))
    w = TreeAttention(device=device, backend="triton")
    plan = w.plan(tree, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                  strategy=strategy)
    w._workspace.fill_(float("nan"))
    out, lse = w.run(q, k[:, None], v[:, None], plan, return_lse=True)
    o_ref, lse_ref = reference_attention(q, k[:, None], v[:, None], tree)
    assert rel_l2(out, o_ref) <= 1e-4 and rel_l2(lse, lse_ref) <= 1e-5
    merged = plan.merge_q_indices.numel()
    if strategy == "sequence":  # one row per query: no merge launch at all
        assert plan.num_direct == tree.num_queries and merged == 0
    elif strategy == "flatten":  # the long leaves are split: every query merged
        assert plan.num_direct == 0 and merged == tree.num_queries
    else:  # queries on inner nodes see one item, the others several
        assert plan.num_direct > 0 and merged > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_balance_split_of_a_verification_tree(rng, device, dtype):
    """Tall query tiles over one long context among tiny draft-token items: greedy splits the
    context by its fair share of the work (the balance path alone: target_programs=1)."""
    tree = tree_from_medusa(32, context_len=300)
    q = torch.randn(tree.num_queries, 8, 64).to(dtype)
    k = torch.randn(tree.num_tokens, 2, 64).to(dtype)
    v = torch.randn(tree.num_tokens, 2, 64).to(dtype)
    paged, kc, vc = paged_copy(tree, k, v, 16, rng)
    o_ref, lse_ref = reference_attention(q, kc, vc, paged)
    w = TreeAttention(device=device, backend="triton", cost=CostModel(target_programs=1, min_split_tokens=64))
    plan = w.plan(paged, num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, strategy="greedy")
    assert "fair share" in plan.reason
    out, lse = w.run(*(t.to(device) for t in (q, kc, vc)), plan, return_lse=True)
    assert rel_l2(out, o_ref) <= TOL[dtype]
    assert rel_l2(lse, lse_ref) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_packed_leaf_items_match_float64_reference(rng, device, hq, hkv):
    """Leaf items packed 2 and 4 per work item run in the Triton kernel (the interpreter on CPU):
    each query attends to its own leaf only, through the tree mask of the packed items' launch."""
    from treeattn.plan import HeadConfig, PLANNERS
    from treeattn.plan.lower.build import build_plan
    from treeattn.plan.strategies.leaf_packing import pack_leaf_items

    d = 16
    q, paged, kc, vc, o_ref = paged_case(tree_from_spec("1,4,16_40,9,5"), hq, hkv, d, rng)
    heads = HeadConfig(hq, hkv, d, torch.float32)
    items, _ = PLANNERS["node"](paged, heads, CostModel())
    for factor in (2, 4):
        plan = build_plan(paged, pack_leaf_items(items, paged, factor, group=hq // hkv), heads, strategy="node",
                          device=device)
        assert plan.num_items < items.num_items
        w = TreeAttention(torch.empty(plan.workspace_bytes() // 4 + 1, device=device), device=device, backend="triton")
        assert rel_l2(w.run(*(t.to(device) for t in (q, kc, vc)), plan), o_ref) <= 1e-4


def test_pdl_needs_a_hopper_gpu_and_one_stream():
    """Programmatic dependent launches are a CUDA (sm_90+) launch mode; elsewhere, or beside side
    streams, asking for them is an error rather than a silent fallback."""
    with pytest.raises(ValueError, match="pdl"):
        TreeAttention(device="cpu", backend="triton", pdl=True)
    assert not TreeAttention(device="cpu", backend="triton", streams=0, pdl=None).pdl  # (where supported)
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert TreeAttention(device="cuda", streams=0, pdl=None).pdl == hopper
        assert not TreeAttention(device="cuda", streams=3, pdl=None).pdl
        with pytest.raises(ValueError, match="streams=0"):
            TreeAttention(device="cuda", streams=2, pdl=True)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper or later GPU")
@pytest.mark.parametrize("strategy,spec", [("node", "1,4,16_300,40,9"), ("pack", "2,8_300,20"),
                                           ("greedy", "1,20_400,20"), ("sequence", "3_600")])
def test_pdl_launches_match_serial_launches(rng, strategy, spec):
    """With ``pdl`` a multi-launch plan's launches overlap on one stream and the merge waits on the
    device: eager and graph-replayed runs give the serial launches' output bit for bit, and match
    the float64 reference."""
    tree = tree_from_spec(spec)
    q, k, v = (torch.randn(n, h, 64, device="cuda", dtype=torch.float16)
               for n, h in ((tree.num_queries, 8), (tree.num_tokens, 2), (tree.num_tokens, 2)))
    serial = TreeAttention(device="cuda", streams=0, pdl=False)
    plan = serial.plan(tree, num_qo_heads=8, num_kv_heads=2, head_dim=64, strategy=strategy)
    want, want_lse = serial.run(q, k[:, None], v[:, None], plan, return_lse=True)
    w = TreeAttention(torch.empty(plan.workspace_bytes() // 4 + 1, device="cuda"), streams=0, pdl=True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((tree.num_queries, 8), float("nan"), device="cuda")
    w.run(q, k[:, None], v[:, None], plan, out=out, lse=lse)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        w.run(q, k[:, None], v[:, None], plan, out=out, lse=lse)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    o_ref, _ = reference_attention(q.double(), k[:, None].double(), v[:, None].double(), tree)
    assert rel_l2(out.double(), o_ref) <= 1e-2
